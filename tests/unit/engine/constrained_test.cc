// Constrained decoding: the JSON grammars against an independent JSON Schema validator (random
// walks through each grammar byte by byte), token masks against token-by-token matching, and
// generation on a random tiny model, whose every constrained output must parse and validate.
#include <unistd.h>

#include <filesystem>
#include <limits>
#include <map>
#include <random>
#include <regex>

#include "absl/strings/str_cat.h"
#include "engine/runtime/scheduler.h"
#include "engine/sampling/constraint.h"
#include "engine/sampling/grammar.h"
#include "engine/sampling/grammar_text.h"
#include "engine/sampling/json_schema.h"
#include "engine/tokenizer/unicode.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::engine {
namespace {

using json = nlohmann::ordered_json;
using ::testing::HasSubstr;

// --- A JSON Schema validator for the keywords json_schema.h supports, from the spec. ---

size_t CodePoints(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xc0) != 0x80;
  return n;
}

bool TypeMatches(const json& v, const std::string& t) {
  if (t == "object") return v.is_object();
  if (t == "array") return v.is_array();
  if (t == "string") return v.is_string();
  if (t == "number") return v.is_number();
  if (t == "integer") return v.is_number_integer();
  if (t == "boolean") return v.is_boolean();
  if (t == "null") return v.is_null();
  return false;
}

bool Valid(const json& v, const json& s, const json& root) {
  if (s.is_boolean()) return s.get<bool>();
  if (auto r = s.find("$ref"); r != s.end()) {
    const std::string ref = r->get<std::string>();
    if (ref == "#") return Valid(v, root, root);
    const std::string name = ref.substr(ref.rfind('/') + 1);
    const json& defs = root.contains("$defs") ? root["$defs"] : root["definitions"];
    return Valid(v, defs[name], root);
  }
  if (s.contains("const") && v != s["const"]) return false;
  if (auto e = s.find("enum"); e != s.end()) {
    if (std::find(e->begin(), e->end(), v) == e->end()) return false;
  }
  if (auto a = s.find("anyOf"); a != s.end()) {
    if (std::none_of(a->begin(), a->end(), [&](const json& x) { return Valid(v, x, root); })) {
      return false;
    }
  }
  if (auto a = s.find("oneOf"); a != s.end()) {
    if (std::count_if(a->begin(), a->end(), [&](const json& x) { return Valid(v, x, root); }) !=
        1) {
      return false;
    }
  }
  if (auto t = s.find("type"); t != s.end()) {
    bool any = false;
    if (t->is_string()) {
      any = TypeMatches(v, t->get<std::string>());
    } else {
      for (const json& x : *t) any = any || TypeMatches(v, x.get<std::string>());
    }
    if (!any) return false;
  }
  if (v.is_object()) {
    const json props = s.value("properties", json::object());
    for (const auto& [k, x] : v.items()) {
      if (props.contains(k)) {
        if (!Valid(x, props[k], root)) return false;
      } else if (s.contains("additionalProperties") && s["additionalProperties"] == false) {
        return false;
      }
    }
    for (const json& r : s.value("required", json::array())) {
      if (!v.contains(r.get<std::string>())) return false;
    }
  }
  if (v.is_array()) {
    if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return false;
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return false;
    if (auto it = s.find("items"); it != s.end()) {
      for (const json& x : v) {
        if (!Valid(x, *it, root)) return false;
      }
    }
  }
  if (v.is_string()) {
    const size_t n = CodePoints(v.get<std::string>());
    if (s.contains("minLength") && n < s["minLength"].get<size_t>()) return false;
    if (s.contains("maxLength") && n > s["maxLength"].get<size_t>()) return false;
  }
  return true;
}

// An NPC's state: every kind of keyword the compiler handles, a definition and a union.
const char kNpcSchema[] = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "mood": {"enum": ["calm", "angry", "afraid"]},
    "hp": {"type": "integer"},
    "speed": {"type": "number"},
    "hostile": {"type": "boolean"},
    "items": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "target": {"anyOf": [{"type": "null"}, {"type": "string", "minLength": 1, "maxLength": 4}]},
    "pos": {"$ref": "#/$defs/vec"},
    "note": {"type": ["string", "null"], "maxLength": 5},
    "tags": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"const": "x"}},
    "line": {"type": "string", "description": "what the NPC says", "maxLength": 20}
  },
  "required": ["name", "mood", "hp", "pos", "line"],
  "additionalProperties": false,
  "$defs": {"vec": {"type": "object", "additionalProperties": false, "required": ["x", "y"],
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}}
})";

// A recursive one: a tree of integers.
const char kTreeSchema[] = R"({
  "type": "object",
  "properties": {"v": {"type": "integer"},
                 "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
  "required": ["v"], "additionalProperties": false
})";

// A random walk through g, one allowed byte at a time; stops at random once complete. Empty
// when it runs past max_len.
std::string RandomDocument(const Grammar& g, std::mt19937& rng, size_t max_len) {
  std::vector<Grammar::Stack> state = g.Start(), next;
  std::string out;
  while (out.size() < max_len) {
    std::vector<uint8_t> allowed;
    for (int b = 0; b < 256; ++b) {
      g.Advance(state, static_cast<uint8_t>(b), &next);
      if (!next.empty()) allowed.push_back(static_cast<uint8_t>(b));
    }
    if (Grammar::Complete(state) && (allowed.empty() || rng() % 4 == 0)) return out;
    EXPECT_FALSE(allowed.empty()) << "dead end after " << out;
    if (allowed.empty()) return "";
    const uint8_t b = allowed[rng() % allowed.size()];
    out.push_back(static_cast<char>(b));
    g.Advance(state, b, &next);
    state.swap(next);
  }
  return "";
}

TEST(JsonGrammarTest, RandomDocumentsOfASchemaParseAndValidate) {
  for (const char* text : {kNpcSchema, kTreeSchema}) {
    const json schema = json::parse(text);
    absl::StatusOr<Grammar> g = JsonSchemaGrammar(schema);
    ASSERT_TRUE(g.ok()) << g.status();
    std::mt19937 rng(7);
    int done = 0;
    for (int i = 0; i < 300; ++i) {
      const std::string doc = RandomDocument(*g, rng, 20000);
      if (doc.empty()) continue;
      ++done;
      const json v = json::parse(doc, nullptr, false);
      ASSERT_FALSE(v.is_discarded()) << doc;
      EXPECT_TRUE(Valid(v, schema, schema)) << doc;
    }
    EXPECT_GT(done, 250);
  }
}

TEST(JsonGrammarTest, JsonObjectGrammarMakesObjects) {
  const Grammar g = JsonObjectGrammar();
  std::mt19937 rng(3);
  int done = 0;
  for (int i = 0; i < 100; ++i) {
    const std::string doc = RandomDocument(g, rng, 4000);
    if (doc.empty()) continue;
    ++done;
    const json v = json::parse(doc, nullptr, false);
    ASSERT_FALSE(v.is_discarded()) << doc;
    EXPECT_TRUE(v.is_object()) << doc;
  }
  EXPECT_GT(done, 60);
}

TEST(JsonGrammarTest, TheGrammarRefusesWhatTheSchemaRefuses) {
  const json schema = json::parse(kNpcSchema);
  absl::StatusOr<Grammar> g = JsonSchemaGrammar(schema);
  ASSERT_TRUE(g.ok()) << g.status();
  auto accepts = [&](const std::string& doc) {
    std::vector<Grammar::Stack> s = g->Start(), next;
    for (char c : doc) {
      g->Advance(s, static_cast<uint8_t>(c), &next);
      if (next.empty()) return false;
      s.swap(next);
    }
    return Grammar::Complete(s);
  };
  const std::string ok =
      R"({"name": "Ada", "mood": "calm", "hp": 12, "pos": {"x": 1.5, "y": -2e3}, "line": "hi"})";
  EXPECT_TRUE(accepts(ok));
  EXPECT_TRUE(Valid(json::parse(ok), schema, schema));
  for (const std::string bad : {
           R"({"name": "Ada", "mood": "bored", "hp": 12, "pos": {"x": 1, "y": 2}, "line": ""})",
           R"({"name": "", "mood": "calm", "hp": 12, "pos": {"x": 1, "y": 2}, "line": ""})",
           R"({"name": "Ada", "mood": "calm", "hp": 1.5, "pos": {"x": 1, "y": 2}, "line": ""})",
           R"({"name": "Ada", "mood": "calm", "hp": 1, "pos": {"x": 1}, "line": ""})",
           R"({"name": "Ada", "mood": "calm", "hp": 1, "pos": {"x": 1, "y": 2}})",
           R"({"name": "Ada", "mood": "calm", "hp": 1, "pos": {"x": 1, "y": 2}, "line": "",)"
           R"( "extra": 1})",
           R"({"name": "Ada", "mood": "calm", "hp": 1, "pos": {"x": 1, "y": 2}, "line": "",)"
           R"( "tags": []})",
       }) {
    EXPECT_FALSE(accepts(bad)) << bad;
    EXPECT_FALSE(Valid(json::parse(bad), schema, schema)) << bad;
  }
}

TEST(JsonGrammarTest, UnsupportedKeywordsAndBadSchemasAreNamed) {
  struct Case {
    const char* schema;
    const char* needle;
  };
  for (const Case& c : {
           Case{R"({"type": "integer", "minimum": 3})", "keyword \"minimum\""},
           Case{R"({"type": "string", "pattern": "a+"})", "keyword \"pattern\""},
           Case{R"({"type": "object", "properties": {"a": {"type": "strin"}}})",
                ".properties.a.type"},
           Case{R"({"$ref": "#/$defs/missing"})", "does not name a definition"},
           Case{R"({"type": "object", "properties": {"a": {}}, "required": ["b"]})",
                "not a property"},
           Case{R"({"type": "string", "minLength": 5, "maxLength": 2})", "greater than"},
           Case{R"({"enum": []})", "non-empty"},
           Case{"[1, 2", "not valid JSON"},
       }) {
    absl::StatusOr<Grammar> g = JsonSchemaGrammarFromText(c.schema);
    ASSERT_FALSE(g.ok()) << c.schema;
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(g.status().message()), HasSubstr(c.needle)) << c.schema;
  }
  EXPECT_THAT(std::string(JsonSchemaGrammarFromText(std::string(kMaxSchemaBytes + 1, ' '))
                              .status()
                              .message()),
              HasSubstr("bytes; at most"));
}

TEST(GrammarTest, LeftRecursionIsRefused) {
  GrammarBuilder b;
  const uint32_t a = b.NewRule();
  const uint32_t n = b.Choice({{}, b.Literal(" ")});
  b.AddAlt(a, {GrammarBuilder::Ref(n), GrammarBuilder::Ref(a), b.Byte('x')});
  b.AddAlt(a, b.Literal("y"));
  absl::StatusOr<Grammar> g = std::move(b).Build(a);
  ASSERT_FALSE(g.ok());
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("left-recursive"));
}

// --- Tokens: a random tiny model with a byte-fallback vocabulary. ---

// --- Grammars written as text, against std::regex (ECMAScript) and hand references. ---

bool Accepts(const Grammar& g, const std::string& s) {
  std::vector<Grammar::Stack> state = g.Start(), next;
  for (unsigned char c : s) {
    g.Advance(state, c, &next);
    if (next.empty()) return false;
    state.swap(next);
  }
  return Grammar::Complete(state);
}

std::string Utf8(uint32_t cp) {
  std::string s;
  unicode::AppendUtf8(cp, &s);
  return s;
}

std::string RandomString(std::mt19937& rng, std::string_view alphabet, size_t max_len) {
  std::string s(rng() % (max_len + 1), ' ');
  for (char& c : s) c = alphabet[rng() % alphabet.size()];
  return s;
}

TEST(GrammarTextTest, CodepointClassesMatchExactlyTheirCodePointsInUtf8) {
  std::mt19937 rng(5);
  for (int round = 0; round < 6; ++round) {
    GrammarBuilder::CodepointRanges ranges;
    for (int i = 0; i < 4; ++i) {
      // Bounds drawn from every encoded length, and the surrogates' neighbourhood.
      const uint32_t scale[] = {0x80, 0x800, 0x10000, 0xe000, 0x110000};
      const uint32_t lo = rng() % scale[rng() % 5];
      ranges.push_back({lo, lo + rng() % 0x3000});
    }
    GrammarBuilder b;
    absl::StatusOr<uint32_t> r = b.Codepoints(ranges);
    ASSERT_TRUE(r.ok()) << r.status();
    absl::StatusOr<Grammar> g = std::move(b).Build(*r);
    ASSERT_TRUE(g.ok()) << g.status();
    auto in = [&](uint32_t cp) {
      if (cp >= 0xd800 && cp <= 0xdfff) return false;
      return std::any_of(ranges.begin(), ranges.end(),
                         [&](auto rg) { return cp >= rg.first && cp <= rg.second; });
    };
    std::vector<uint32_t> probe;
    for (auto [lo, hi] : ranges) {
      for (uint32_t d : {0u, 1u}) {
        probe.push_back(lo - d);
        probe.push_back(lo + d);
        probe.push_back(hi - d);
        probe.push_back(hi + d);
      }
    }
    for (int i = 0; i < 4000; ++i) probe.push_back(rng() % 0x110000);
    for (uint32_t cp : probe) {
      if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) continue;
      EXPECT_EQ(Accepts(*g, Utf8(cp)), in(cp)) << std::hex << cp;
    }
    // Every walk through the grammar is one code point in the ranges, encoded canonically.
    for (int i = 0; i < 300; ++i) {
      const std::string s = RandomDocument(*g, rng, 8);
      ASSERT_FALSE(s.empty());
      std::u32string cps;
      size_t pos = 0;
      const auto b0 = static_cast<uint8_t>(s[0]);
      const int n = b0 < 0x80 ? 1 : b0 < 0xe0 ? 2 : b0 < 0xf0 ? 3 : 4;
      ASSERT_EQ(s.size(), static_cast<size_t>(n));
      uint32_t cp = n == 1 ? b0 : b0 & (0x7f >> n);
      for (pos = 1; pos < s.size(); ++pos) {
        cp = (cp << 6) | (static_cast<uint8_t>(s[pos]) & 0x3f);
      }
      EXPECT_TRUE(in(cp)) << std::hex << cp;
      EXPECT_EQ(Utf8(cp), s);
    }
  }
  GrammarBuilder b;
  EXPECT_FALSE(b.Codepoints({{0xd800, 0xdfff}}).ok());
}

TEST(GrammarTextTest, RegexMatchesWhatStdRegexMatches) {
  struct Case {
    const char* pattern;
    // The same language for std::regex's ECMAScript (which lacks named groups and \u{...});
    // null: the pattern itself.
    const char* reference;
    const char* alphabet;
    bool ascii_only;  // every match is ASCII, so std::regex (bytewise) can judge random walks
  };
  const Case cases[] = {
      {"[a-c]+(,[a-c]+)*", nullptr, "abcd,", true},
      {"(ab|a)(bc|c)?d{1,3}", nullptr, "abcd", true},
      {"\\d{3}-\\d{2,}", nullptr, "0129-a", true},
      {"(?:yes|no|maybe)\\.?", nullptr, "yesnomab.", true},
      {"\\w+\\s[\\d_]", nullptr, "ab_ 9\t-", true},
      {"^a[\\w.-]c$", nullptr, "abc.-_ ", true},
      {"x{2}y{0,2}z*?", nullptr, "xyz", true},
      {"[\\d.+-]+e?", nullptr, "12.+-e", true},
      {"(?<tag>[A-Z][a-z]*)(, (?P<more>[A-Z][a-z]*))*", "([A-Z][a-z]*)(, ([A-Z][a-z]*))*",
       "AbcZ, ", true},
      {"\\u0041\\x42\\u{43}[\\t\\n]", "ABC[\\t\\n]", "ABC\t\nD", true},
      {"[^abc]x?", nullptr, "abcxyz,\n", false},
      {"a.c|\\D\\W", nullptr, "ab\nc-1 ", false},
  };
  std::mt19937 rng(9);
  for (const Case& c : cases) {
    absl::StatusOr<Grammar> g = RegexGrammar(c.pattern);
    ASSERT_TRUE(g.ok()) << c.pattern << ": " << g.status();
    const std::regex re(c.reference ? c.reference : c.pattern);
    int matched = 0;
    for (int i = 0; i < 3000; ++i) {
      const std::string s = RandomString(rng, c.alphabet, 7);
      const bool want = std::regex_match(s, re);
      EXPECT_EQ(Accepts(*g, s), want) << c.pattern << " on '" << s << "'";
      matched += want;
    }
    EXPECT_GT(matched, 0) << c.pattern;  // the alphabet reaches the language
    if (!c.ascii_only) continue;
    for (int i = 0; i < 200; ++i) {
      const std::string s = RandomDocument(*g, rng, 64);
      if (s.empty()) continue;  // ran past the length bound (unbounded repeats)
      EXPECT_TRUE(std::regex_match(s, re)) << c.pattern << " made '" << s << "'";
    }
  }
}

TEST(GrammarTextTest, GbnfAcceptsWhatItsRulesSay) {
  // A list, against the equivalent regular expression.
  absl::StatusOr<Grammar> list = GbnfGrammar(R"(
    # a comma-separated list
    root ::= item ("," ws item)*   # items
    item ::= [a-c]+ | "<" [^<>]{1,2} ">"
    ws ::= " "?
  )");
  ASSERT_TRUE(list.ok()) << list.status();
  const std::regex re("([a-c]+|<[^<>]{1,2}>)(, ?([a-c]+|<[^<>]{1,2}>))*");
  std::mt19937 rng(3);
  int matched = 0;
  for (int i = 0; i < 4000; ++i) {
    const std::string s = RandomString(rng, "abcd,< >", 9);
    const bool want = std::regex_match(s, re);
    EXPECT_EQ(Accepts(*list, s), want) << s;
    matched += want;
  }
  EXPECT_GT(matched, 100);
  // Recursion: balanced brackets, against a counter.
  absl::StatusOr<Grammar> brackets = GbnfGrammar(
      "root ::= pair*\n"
      "pair ::= \"(\" root \")\" | \"[\" root \"]\"\n");
  ASSERT_TRUE(brackets.ok()) << brackets.status();
  auto balanced = [](const std::string& s) {
    std::string st;
    for (char c : s) {
      if (c == '(' || c == '[') {
        st.push_back(c);
      } else if (st.empty() || st.back() != (c == ')' ? '(' : '[')) {
        return false;
      } else {
        st.pop_back();
      }
    }
    return st.empty();
  };
  matched = 0;
  for (int i = 0; i < 4000; ++i) {
    const std::string s = RandomString(rng, "()[]", 8);
    EXPECT_EQ(Accepts(*brackets, s), balanced(s)) << s;
    matched += balanced(s);
  }
  EXPECT_GT(matched, 50);
  // Escapes, non-ASCII classes, '.', counted repetition.
  absl::StatusOr<Grammar> esc = GbnfGrammar(
      "root ::= \"\\u00e9\\x41\\\"\" [α-ω]{2} . \"\\n\"{,2} x\nx ::= [\\]\\-]+");
  ASSERT_TRUE(esc.ok()) << esc.status();
  EXPECT_TRUE(Accepts(*esc, "éA\"αβ🙂\n\n]-"));
  EXPECT_TRUE(Accepts(*esc, "éA\"ωωz-"));
  EXPECT_FALSE(Accepts(*esc, "éA\"αz-"));        // one Greek letter short
  EXPECT_FALSE(Accepts(*esc, "éA\"αβz\n\n\n-"));  // three newlines
  EXPECT_FALSE(Accepts(*esc, "éA\"αβz"));         // x needs one character
}

TEST(GrammarTextTest, BadGrammarsAndPatternsAreRefusedWithTheReason) {
  const std::pair<const char*, const char*> grammars[] = {
      {"root ::= item", "rule item is not defined"},
      {"start ::= \"a\"", "no root rule"},
      {"root ::= \"a\"\nroot ::= \"b\"", "defined twice"},
      {"root ::= root \"a\" | \"b\"", "left-recursive"},
      {"root ::= \"abc", "unterminated literal"},
      {"root ::= [b-a]", "runs backwards"},
      {"root ::= \"a\"{3,2}", "below its minimum"},
      {"root ::= \"a\"{1001}", "over 1000"},
      {"root ::= (\"a\"", "expected ')'"},
      {"root = \"a\"", "expected '::='"},
      {"", "no rules"},
  };
  for (const auto& [text, why] : grammars) {
    absl::StatusOr<Grammar> g = GbnfGrammar(text);
    ASSERT_FALSE(g.ok()) << text;
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(std::string(g.status().message()), HasSubstr(why)) << text;
  }
  const std::pair<const char*, const char*> patterns[] = {
      {"(?=a)b", "lookaround"},   {"(a)\\1", "backreferences"},   {"\\bx", "word boundaries"},
      {"a{3,2}", "below its minimum"}, {"*a", "nothing to repeat"}, {"a++", "possessive"},
      {"(ab", "expected ')'"},    {"ab)", "unbalanced"},          {"[z-a]", "runs backwards"},
      {"a^b", "anchors"},         {"[abc", "unterminated"},       {"\\q", "unsupported escape"},
  };
  for (const auto& [pattern, why] : patterns) {
    absl::StatusOr<Grammar> g = RegexGrammar(pattern);
    ASSERT_FALSE(g.ok()) << pattern;
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << pattern;
    EXPECT_THAT(std::string(g.status().message()), HasSubstr(why)) << pattern;
  }
  const std::string huge(kMaxSchemaBytes + 1, 'a');
  EXPECT_THAT(std::string(RegexGrammar(huge).status().message()), HasSubstr("at most"));
  // What counted repetitions cost is bounded: in rules, and in copies of their bodies.
  std::string many_rules, many_copies;
  for (int i = 0; i < 25; ++i) many_rules += "a{0,1000}";
  for (int i = 0; i < 1001; ++i) many_copies += "(ab){1000}";
  EXPECT_THAT(std::string(RegexGrammar(many_rules).status().message()), HasSubstr("too large"));
  EXPECT_THAT(std::string(RegexGrammar(many_copies).status().message()), HasSubstr("too large"));
  EXPECT_TRUE(RegexGrammar("((ab){1000}){1000}").ok());  // nesting refers, never copies
}

std::shared_ptr<const Model> TinyModel() {
  static std::shared_ptr<const Model> model = [] {
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("tandem-constrained-" + std::to_string(getpid()) + ".gguf"))
                                 .string();
    testing::TinyModelOptions o;
    o.n_ctx = 1024;
    EXPECT_TRUE(testing::WriteTinyModel(o, path).ok());
    auto m = Model::Load(path);
    EXPECT_TRUE(m.ok()) << m.status();
    std::filesystem::remove(path);
    return std::shared_ptr<const Model>(std::move(*m));
  }();
  return model;
}

TEST(TokenConstraintTest, MasksAreWhatTokenByTokenMatchingAllows) {
  const Tokenizer& tok = TinyModel()->tokenizer();
  Constraint c;
  c.kind = Constraint::Kind::kJsonSchema;
  c.text = kNpcSchema;
  absl::StatusOr<std::shared_ptr<const TokenConstraint>> tc = CompileConstraint(c, tok);
  ASSERT_TRUE(tc.ok()) << tc.status();
  // The same schema compiles once.
  EXPECT_EQ(CompileConstraint(c, tok)->get(), tc->get());
  std::mt19937 rng(5);
  for (int run = 0; run < 4; ++run) {
    GrammarMatcher m(*tc);
    for (int step = 0; step < 60 && !m.finished(); ++step) {
      std::vector<float> logits(static_cast<size_t>(tok.vocab_size()), 0.0f);
      m.Apply(logits);
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < tok.vocab_size(); ++id) {
        const bool in_mask = logits[static_cast<size_t>(id)] == 0.0f;
        ASSERT_EQ(in_mask, m.Allowed(id)) << "token " << id << " at step " << step;
        if (in_mask) allowed.push_back(id);
      }
      ASSERT_FALSE(allowed.empty());
      ASSERT_TRUE(m.Accept(allowed[rng() % allowed.size()]).ok());
    }
  }
  EXPECT_GT((*tc)->masks_cached() + (*tc)->masks_computed(), 0);
  // Once complete with nothing more allowed, only end-of-generation tokens remain.
  Constraint obj;
  obj.kind = Constraint::Kind::kJsonSchema;
  obj.text = R"({"enum": [true]})";
  GrammarMatcher m(*CompileConstraint(obj, tok));
  for (char ch : std::string("true")) {
    ASSERT_TRUE(m.Accept(static_cast<int32_t>(static_cast<uint8_t>(ch)) + 3).ok()) << ch;
  }
  EXPECT_TRUE(m.complete());
  EXPECT_TRUE(m.Allowed(tok.eos_id()));
  EXPECT_FALSE(m.Allowed('x' + 3));
  EXPECT_FALSE(m.Accept('x' + 3).ok());
}

std::unique_ptr<Engine> MakeEngine() {
  EngineOptions o;
  o.threads = 2;
  o.ctx_size = 1024;
  o.max_seqs = 8;
  o.max_batch_tokens = 64;
  return std::move(*Engine::Create(TinyModel(), o));
}

struct Output {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason reason = FinishReason::kNone;
  absl::Status status;
};

std::vector<Output> Generate(Engine* e, const std::vector<SamplingParams>& params,
                        const std::vector<std::vector<int32_t>>& prompts) {
  Scheduler s(e);
  std::vector<Output> out(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    GenerationRequest r;
    r.id = absl::StrCat("r", i);
    r.prompt = prompts[i];
    r.sampling = params[i];
    r.on_event = [&out, i](const TokenEvent& ev) {
      if (ev.token >= 0) out[i].tokens.push_back(ev.token);
      out[i].text += ev.text;
      if (ev.finished) {
        out[i].reason = ev.reason;
        out[i].status = ev.status;
      }
    };
    EXPECT_TRUE(s.Submit(std::move(r)).ok());
  }
  EXPECT_TRUE(s.RunUntilIdle().ok());
  return out;
}

TEST(ConstrainedGenerationTest, EverySampledOutputParsesAndValidates) {
  auto e = MakeEngine();
  for (const char* text : {kNpcSchema, kTreeSchema, ""}) {
    const json schema = *text ? json::parse(text) : json();
    std::vector<SamplingParams> params;
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < 16; ++i) {
      SamplingParams p;
      p.temperature = 1.0f;
      p.seed = 100 + static_cast<uint64_t>(i);
      p.max_tokens = 900;
      p.constraint.kind = *text ? Constraint::Kind::kJsonSchema : Constraint::Kind::kJsonObject;
      p.constraint.text = text;
      params.push_back(p);
      prompts.push_back(testing::RandomTokens(5, 250, static_cast<uint32_t>(i)));
    }
    const std::vector<Output> out = Generate(e.get(), params, prompts);
    for (const Output& o : out) {
      ASSERT_TRUE(o.status.ok()) << o.status;
      EXPECT_EQ(o.reason, FinishReason::kStop) << o.text;
      const json v = json::parse(o.text, nullptr, false);
      ASSERT_FALSE(v.is_discarded()) << o.text;
      if (*text) {
        EXPECT_TRUE(Valid(v, schema, schema)) << o.text;
      } else {
        EXPECT_TRUE(v.is_object()) << o.text;
      }
    }
  }
}

TEST(ConstrainedGenerationTest, GreedyIsUnchangedWhenTheGrammarAllowsEveryToken) {
  const Tokenizer& tok = TinyModel()->tokenizer();
  GrammarBuilder b;
  const uint32_t root = b.Repeat({b.Bytes(ByteSet::Range(0, 255))}, 0, -1);
  absl::StatusOr<Grammar> g = std::move(b).Build(root);
  ASSERT_TRUE(g.ok());
  auto c = TokenConstraint::Create(std::move(*g), VocabTrie::Get(tok));
  ASSERT_TRUE(c.ok());
  SamplingParams p;
  p.temperature = 0;
  Sampler plain(p), constrained(p);
  constrained.Constrain(std::make_unique<GrammarMatcher>(*c));
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0, 2);
  int compared = 0;
  for (int step = 0; step < 300; ++step) {
    std::vector<float> l(static_cast<size_t>(tok.vocab_size()));
    for (float& x : l) x = d(rng);
    std::vector<float> l2 = l;
    const int32_t a = plain.Sample(l, {});
    const int32_t t = constrained.Sample(l2, {});
    // Only tokens without text (<unk>, <s>) are outside every byte grammar.
    if (tok.TokenToPiece(a, false).empty() && !tok.IsEog(a)) continue;
    EXPECT_EQ(a, t) << step;
    ++compared;
  }
  EXPECT_GT(compared, 250);
}

TEST(ConstrainedGenerationTest, AMovedRequestContinuesUnderItsConstraint) {
  // Greedy, so the continuation depends only on the tokens: the first k output tokens moved
  // into the prompt with constraint.generated = k give the rest of the same output.
  auto e = MakeEngine();
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 400;
  p.constraint.kind = Constraint::Kind::kJsonSchema;
  p.constraint.text = kNpcSchema;
  const std::vector<int32_t> prompt = testing::RandomTokens(6, 250, 77);
  const Output whole = Generate(e.get(), {p}, {prompt})[0];
  ASSERT_EQ(whole.reason, FinishReason::kStop);
  ASSERT_GT(whole.tokens.size(), 12u);
  const size_t k = 10;
  std::vector<int32_t> moved = prompt;
  moved.insert(moved.end(), whole.tokens.begin(), whole.tokens.begin() + k);
  SamplingParams q = p;
  q.max_tokens = p.max_tokens - static_cast<int32_t>(k);
  q.constraint.generated = static_cast<int32_t>(k);
  const Output rest = Generate(e.get(), {q}, {moved})[0];
  ASSERT_TRUE(rest.status.ok()) << rest.status;
  EXPECT_EQ(rest.tokens, std::vector<int32_t>(whole.tokens.begin() + k, whole.tokens.end()));
  // Output that breaks the constraint is refused.
  Scheduler s(e.get());
  GenerationRequest r;
  r.id = "bad";
  r.prompt = prompt;  // its tokens are not a JSON prefix
  r.sampling = q;
  r.sampling.constraint.generated = 3;
  const absl::Status st = s.Submit(std::move(r));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("breaks the constraint"));
}

TEST(ConstrainedGenerationTest, RegexAndGbnfOutputsMatch) {
  auto e = MakeEngine();
  struct Case {
    Constraint::Kind kind;
    const char* text;
    const char* reference;  // std::regex for the same language
  };
  const Case cases[] = {
      {Constraint::Kind::kRegex, "(north|south|east|west) [1-9]\\d{0,2} (steps|paces)\\.",
       "(north|south|east|west) [1-9][0-9]{0,2} (steps|paces)\\."},
      {Constraint::Kind::kGrammar,
       "root ::= action (\", \" action){0,3}\n"
       "action ::= (\"attack\" | \"defend\" | \"flee\") \"(\" [a-z]{1,8} \")\"\n",
       "(attack|defend|flee)\\([a-z]{1,8}\\)(, (attack|defend|flee)\\([a-z]{1,8}\\)){0,3}"},
  };
  for (const Case& c : cases) {
    std::vector<SamplingParams> params;
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < 12; ++i) {
      SamplingParams p;
      p.temperature = i == 0 ? 0.0f : 1.0f;
      p.seed = 300 + static_cast<uint64_t>(i);
      p.max_tokens = 200;
      p.constraint.kind = c.kind;
      p.constraint.text = c.text;
      params.push_back(p);
      prompts.push_back(testing::RandomTokens(5, 250, 40 + static_cast<uint32_t>(i)));
    }
    const std::regex re(c.reference);
    for (const Output& o : Generate(e.get(), params, prompts)) {
      ASSERT_TRUE(o.status.ok()) << o.status;
      EXPECT_EQ(o.reason, FinishReason::kStop) << o.text;
      EXPECT_TRUE(std::regex_match(o.text, re)) << o.text;
    }
  }
}

}  // namespace
}  // namespace tandem::engine
