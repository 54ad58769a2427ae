#include "engine/sampling/grammar_text.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/sampling/json_schema.h"
#include "engine/tokenizer/unicode.h"

namespace tandem::engine {
namespace {

using Seq = GrammarBuilder::Seq;
using Ranges = GrammarBuilder::CodepointRanges;
constexpr uint32_t kAnyMax = 0x10ffff;

Ranges Complement(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  uint32_t next = 0;
  for (auto [lo, hi] : r) {
    if (lo > next) out.push_back({next, lo - 1});
    if (hi >= next) next = hi + 1;
  }
  if (next <= kAnyMax) out.push_back({next, kAnyMax});
  return out;
}

// What GBNF and regular expressions share: reading UTF-8 and escapes, character classes,
// counted repetition, and the limits.
class TextParser {
 public:
  TextParser(std::string what, std::string_view src) : what_(std::move(what)), src_(src) {}
  virtual ~TextParser() = default;

 protected:
  bool AtEnd() const { return pos_ >= src_.size(); }
  char Peek(size_t ahead = 0) const {
    return pos_ + ahead < src_.size() ? src_[pos_ + ahead] : '\0';
  }
  bool Eat(char c) {
    if (AtEnd() || src_[pos_] != c) return false;
    ++pos_;
    return true;
  }
  absl::Status Error(const std::string& msg) const {
    return absl::InvalidArgumentError(absl::StrCat(what_, " at offset ", pos_, ": ", msg));
  }

  // One code point of the source (valid UTF-8 only).
  absl::StatusOr<uint32_t> NextCodepoint() {
    const auto b0 = static_cast<uint8_t>(src_[pos_]);
    const int n = b0 < 0x80         ? 1
                  : (b0 >> 5) == 6  ? 2
                  : (b0 >> 4) == 14 ? 3
                  : (b0 >> 3) == 30 ? 4
                                    : 0;
    if (n == 0 || pos_ + static_cast<size_t>(n) > src_.size()) return Error("invalid UTF-8");
    uint32_t cp = n == 1 ? b0 : n == 2 ? (b0 & 0x1f) : n == 3 ? (b0 & 0x0f) : (b0 & 0x07);
    for (int i = 1; i < n; ++i) {
      const auto b = static_cast<uint8_t>(src_[pos_ + static_cast<size_t>(i)]);
      if ((b & 0xc0) != 0x80) return Error("invalid UTF-8");
      cp = (cp << 6) | (b & 0x3f);
    }
    pos_ += static_cast<size_t>(n);
    return cp;
  }

  absl::StatusOr<uint32_t> Hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      const char c = Peek();
      int d = c >= '0' && c <= '9'   ? c - '0'
              : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                     : -1;
      if (d < 0) return Error(absl::StrCat("expected ", digits, " hex digits"));
      v = v * 16 + static_cast<uint32_t>(d);
      ++pos_;
    }
    if (v > kAnyMax) return Error("code point past U+10FFFF");
    return v;
  }

  // After a backslash: the code point of a character escape shared by both syntaxes, or
  // nullopt (nothing consumed) when the escape is not one.
  absl::StatusOr<std::optional<uint32_t>> CharEscape() {
    const char c = Peek();
    static constexpr std::pair<char, char> kSimple[] = {{'n', '\n'}, {'r', '\r'}, {'t', '\t'},
                                                        {'f', '\f'}, {'v', '\v'}, {'0', '\0'}};
    for (const auto& [name, value] : kSimple) {
      if (c == name) {
        ++pos_;
        return std::optional<uint32_t>(static_cast<uint32_t>(value));
      }
    }
    if (c == 'u' && Peek(1) == '{') {  // u{...}: 1 to 6 hex digits
      pos_ += 2;
      const size_t close = src_.find('}', pos_);
      const size_t n = close == std::string_view::npos ? 0 : close - pos_;
      if (n < 1 || n > 6) return Error("expected \\u{1 to 6 hex digits}");
      absl::StatusOr<uint32_t> v = Hex(static_cast<int>(n));
      if (!v.ok()) return v.status();
      ++pos_;  // '}'
      return std::optional<uint32_t>(*v);
    }
    if (c == 'x' || c == 'u' || c == 'U') {
      ++pos_;
      absl::StatusOr<uint32_t> v = Hex(c == 'x' ? 2 : c == 'u' ? 4 : 8);
      if (!v.ok()) return v.status();
      return std::optional<uint32_t>(*v);
    }
    if (c != '\0' && static_cast<uint8_t>(c) < 0x80 && !std::isalnum(c)) {
      ++pos_;  // an escaped punctuation character stands for itself
      return std::optional<uint32_t>(static_cast<uint32_t>(c));
    }
    return std::optional<uint32_t>();
  }

  // A shorthand class (\d \w \s and their negations), or nullopt (nothing consumed).
  std::optional<Ranges> ShorthandClass() {
    Ranges r;
    const char c = Peek();
    switch (c) {
      case 'd':
      case 'D':
        r = {{'0', '9'}};
        break;
      case 'w':
      case 'W':
        r = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
        break;
      case 's':
      case 'S':
        r = {{'\t', '\r'}, {' ', ' '}};
        break;
      default:
        return std::nullopt;
    }
    ++pos_;
    return std::isupper(c) ? Complement(std::move(r)) : r;
  }

  // After '[': the class up to and including ']'. `shorthands`: \d \w \s are allowed inside.
  absl::StatusOr<Ranges> Class(bool shorthands) {
    const bool negate = Eat('^');
    Ranges r;
    bool first = true;
    while (true) {
      if (AtEnd()) return Error("unterminated character class");
      if (Peek() == ']' && !first) {
        ++pos_;
        break;
      }
      first = false;
      absl::StatusOr<uint32_t> lo = ClassChar(shorthands, &r);
      if (!lo.ok()) return lo.status();
      if (*lo == kShorthand) continue;
      if (Peek() == '-' && Peek(1) != ']' && Peek(1) != '\0') {
        ++pos_;
        absl::StatusOr<uint32_t> hi = ClassChar(/*shorthands=*/false, &r);
        if (!hi.ok()) return hi.status();
        if (*hi < *lo) return Error("a class range runs backwards");
        r.push_back({*lo, *hi});
      } else {
        r.push_back({*lo, *lo});
      }
    }
    return negate ? Complement(std::move(r)) : r;
  }

  // {m}, {m,}, {m,n} (and {,n} when `open_min`) after '{': min and max (max -1: unbounded).
  absl::StatusOr<std::pair<int, int>> Counts(bool open_min) {
    auto number = [&]() -> std::optional<int> {
      if (!std::isdigit(static_cast<unsigned char>(Peek()))) return std::nullopt;
      int v = 0;
      while (std::isdigit(static_cast<unsigned char>(Peek()))) {
        v = std::min(v * 10 + (Peek() - '0'), kMaxGrammarRepeat + 1);
        ++pos_;
      }
      return v;
    };
    std::optional<int> lo = number();
    if (!lo && !(open_min && Peek() == ',')) return Error("expected a count after '{'");
    int min = lo.value_or(0), max = min;
    if (Eat(',')) {
      std::optional<int> hi = number();
      max = hi.value_or(-1);
    }
    if (!Eat('}')) return Error("expected '}'");
    if (min > kMaxGrammarRepeat || max > kMaxGrammarRepeat) {
      return Error(absl::StrCat("a repetition count is over ", kMaxGrammarRepeat));
    }
    if (max >= 0 && max < min) return Error("a repetition's maximum is below its minimum");
    return std::make_pair(min, max);
  }

  // One alternative; it stops before '|', ')' or whatever ends it in the syntax.
  virtual absl::StatusOr<Seq> Sequence() = 0;

  // Alternatives separated by '|', added to `rule`.
  absl::Status Alternatives(uint32_t rule) {
    do {
      absl::StatusOr<Seq> s = Sequence();
      if (!s.ok()) return s.status();
      b_.AddAlt(rule, std::move(*s));
    } while (Eat('|'));
    return absl::OkStatus();
  }

  // The postfix operators after an element (* + ? {m} {m,} {m,n}, and GBNF's {,n}; a regex's
  // may be lazy, which changes nothing when the whole output must match), applied to *e.
  absl::Status Postfix(bool regex, Seq* e) {
    while (true) {
      int min, max;
      if (Eat('*')) {
        min = 0, max = -1;
      } else if (Eat('+')) {
        min = 1, max = -1;
      } else if (Eat('?')) {
        min = 0, max = 1;
      } else if (Peek() == '{' && (std::isdigit(static_cast<unsigned char>(Peek(1))) ||
                                   (!regex && Peek(1) == ','))) {
        ++pos_;
        absl::StatusOr<std::pair<int, int>> c = Counts(/*open_min=*/!regex);
        if (!c.ok()) return c.status();
        std::tie(min, max) = *c;
      } else {
        return absl::OkStatus();
      }
      if (regex) {
        if (Peek() == '+') return Error("possessive quantifiers are not supported");
        Eat('?');
      }
      *e = Repeat(*e, min, max);
    }
  }

  Seq Repeat(const Seq& body, int min, int max) {
    if (min == 1 && max == 1) return body;
    // The copies of a longer body refer to one rule that holds it.
    const Seq one = body.size() > 1 ? Seq{GrammarBuilder::Ref(b_.Choice({body}))} : body;
    copies_ += static_cast<size_t>(max < 0 ? min + 1 : max);
    return {GrammarBuilder::Ref(b_.Repeat(one, min, max))};
  }

  Seq Char(uint32_t cp) {
    std::string s;
    unicode::AppendUtf8(cp, &s);
    return b_.Literal(s);
  }

  absl::StatusOr<Seq> ClassElem(const Ranges& r) {
    absl::StatusOr<uint32_t> rule = b_.Codepoints(r);
    if (!rule.ok()) return Error(std::string(rule.status().message()));
    return Seq{GrammarBuilder::Ref(*rule)};
  }

  absl::Status SizeError() const {
    return absl::InvalidArgumentError(absl::StrCat(what_, " is too large (over ", kMaxSchemaRules,
                                                   " grammar rules or ", kMaxCopies,
                                                   " repeated elements)"));
  }
  absl::StatusOr<Grammar> Finish(uint32_t root) {
    if (TooLarge()) return SizeError();
    absl::StatusOr<Grammar> g = std::move(b_).Build(root);
    if (!g.ok())
      return absl::InvalidArgumentError(
          absl::StrCat(what_, ": ", std::string(g.status().message())));
    return g;
  }
  // The grammar's size: its rules, and the elements that counted repetitions copy.
  bool TooLarge() const { return b_.rules() > kMaxSchemaRules || copies_ > kMaxCopies; }

  std::string what_;
  std::string_view src_;
  size_t pos_ = 0;
  GrammarBuilder b_;

 private:
  static constexpr size_t kMaxCopies = 50 * kMaxSchemaRules;
  size_t copies_ = 0;
  static constexpr uint32_t kShorthand = 0xffffffff;
  // One class member: a code point, or kShorthand after adding a shorthand class to `r`.
  absl::StatusOr<uint32_t> ClassChar(bool shorthands, Ranges* r) {
    if (!Eat('\\')) return NextCodepoint();
    if (shorthands) {
      if (std::optional<Ranges> s = ShorthandClass()) {
        r->insert(r->end(), s->begin(), s->end());
        return kShorthand;
      }
    }
    absl::StatusOr<std::optional<uint32_t>> e = CharEscape();
    if (!e.ok()) return e.status();
    if (!*e) return Error(absl::StrCat("unsupported escape \\", std::string(1, Peek())));
    return **e;
  }
};

class GbnfParser : public TextParser {
 public:
  explicit GbnfParser(std::string_view text) : TextParser("grammar", text) {}

  absl::StatusOr<Grammar> Parse() {
    SkipSpace();
    if (AtEnd()) return Error("no rules");
    while (!AtEnd()) {
      const size_t at = pos_;
      std::string name = Name();
      if (name.empty()) return Error("expected a rule name");
      SkipSpace();
      if (!EatText("::=")) return Error(absl::StrCat("expected '::=' after ", name));
      if (!defined_.insert(name).second) {
        pos_ = at;
        return Error(absl::StrCat("rule ", name, " is defined twice"));
      }
      if (absl::Status st = Alternatives(Rule(name)); !st.ok()) return st;
      SkipSpace();
    }
    for (const auto& [name, id] : rules_) {
      if (!defined_.contains(name)) {
        return absl::InvalidArgumentError(absl::StrCat("grammar: rule ", name, " is not defined"));
      }
    }
    if (!defined_.contains("root")) return absl::InvalidArgumentError("grammar: no root rule");
    return Finish(rules_["root"]);
  }

 private:
  void SkipSpace() {
    while (!AtEnd()) {
      if (Peek() == '#') {
        while (!AtEnd() && Peek() != '\n') ++pos_;
      } else if (std::isspace(static_cast<unsigned char>(Peek()))) {
        ++pos_;
      } else {
        break;
      }
    }
  }
  static bool NameChar(char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
  }
  std::string Name() {
    const size_t start = pos_;
    while (!AtEnd() && NameChar(Peek())) ++pos_;
    return std::string(src_.substr(start, pos_ - start));
  }
  bool EatText(std::string_view t) {
    if (src_.substr(pos_, t.size()) != t) return false;
    pos_ += t.size();
    return true;
  }
  // Whether `name ::=` starts here: the end of the rule before it.
  bool AtRuleStart() {
    const size_t save = pos_;
    const bool named = !Name().empty();
    SkipSpace();
    const bool yes = named && src_.substr(pos_, 3) == "::=";
    pos_ = save;
    return yes;
  }
  uint32_t Rule(const std::string& name) {
    auto [it, fresh] = rules_.try_emplace(name, 0);
    if (fresh) it->second = b_.NewRule();
    return it->second;
  }

  absl::StatusOr<Seq> Sequence() override {
    Seq seq;
    while (true) {
      SkipSpace();
      if (AtEnd() || Peek() == '|' || Peek() == ')' || AtRuleStart()) return seq;
      absl::StatusOr<Seq> e = Primary();
      if (!e.ok()) return e.status();
      if (absl::Status st = Postfix(/*regex=*/false, &*e); !st.ok()) return st;
      seq.insert(seq.end(), e->begin(), e->end());
      if (TooLarge()) return SizeError();
    }
  }

  absl::StatusOr<Seq> Primary() {
    if (Eat('"')) {
      std::string lit;
      while (!Eat('"')) {
        if (AtEnd()) return Error("unterminated literal");
        uint32_t cp;
        if (Eat('\\')) {
          absl::StatusOr<std::optional<uint32_t>> e = CharEscape();
          if (!e.ok()) return e.status();
          if (!*e) return Error(absl::StrCat("unsupported escape \\", std::string(1, Peek())));
          cp = **e;
        } else {
          absl::StatusOr<uint32_t> c = NextCodepoint();
          if (!c.ok()) return c.status();
          cp = *c;
        }
        unicode::AppendUtf8(cp, &lit);
      }
      return b_.Literal(lit);
    }
    if (Eat('[')) {
      absl::StatusOr<Ranges> r = Class(/*shorthands=*/false);
      if (!r.ok()) return r.status();
      return ClassElem(*r);
    }
    if (Eat('.')) return ClassElem({{0, kAnyMax}});
    if (Eat('(')) {
      const uint32_t r = b_.NewRule();
      if (absl::Status st = Alternatives(r); !st.ok()) return st;
      SkipSpace();
      if (!Eat(')')) return Error("expected ')'");
      return Seq{GrammarBuilder::Ref(r)};
    }
    const std::string name = Name();
    if (name.empty()) return Error(absl::StrCat("unexpected '", std::string(1, Peek()), "'"));
    return Seq{GrammarBuilder::Ref(Rule(name))};
  }

  std::map<std::string, uint32_t> rules_;
  std::set<std::string> defined_;
};

class RegexParser : public TextParser {
 public:
  explicit RegexParser(std::string_view pattern) : TextParser("regex", pattern) {}

  absl::StatusOr<Grammar> Parse() {
    Eat('^');
    const uint32_t root = b_.NewRule();
    if (absl::Status st = Alternatives(root); !st.ok()) return st;
    if (!AtEnd()) return Error("unbalanced ')'");
    return Finish(root);
  }

 private:
  absl::StatusOr<Seq> Sequence() override {
    Seq seq;
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      if (Peek() == '$' && (pos_ + 1 == src_.size() || Peek(1) == '|' || Peek(1) == ')')) {
        ++pos_;  // the end of the output: where the match ends anyway
        continue;
      }
      absl::StatusOr<Seq> e = Atom();
      if (!e.ok()) return e.status();
      if (absl::Status st = Postfix(/*regex=*/true, &*e); !st.ok()) return st;
      seq.insert(seq.end(), e->begin(), e->end());
      if (TooLarge()) return SizeError();
    }
    return seq;
  }

  absl::StatusOr<Seq> Atom() {
    const char c = Peek();
    if (c == '*' || c == '+' || c == '?') {
      return Error(absl::StrCat("nothing to repeat before '", std::string(1, c), "'"));
    }
    if (Eat('(')) {
      if (Eat('?')) {
        if (Eat(':')) {
        } else if (Peek() == '<' && Peek(1) != '=' && Peek(1) != '!') {
          while (!AtEnd() && Peek() != '>') ++pos_;
          if (!Eat('>')) return Error("unterminated group name");
        } else if (Peek() == 'P' && Peek(1) == '<') {
          while (!AtEnd() && Peek() != '>') ++pos_;
          if (!Eat('>')) return Error("unterminated group name");
        } else {
          return Error("lookaround and inline flags are not supported");
        }
      }
      const uint32_t r = b_.NewRule();
      if (absl::Status st = Alternatives(r); !st.ok()) return st;
      if (!Eat(')')) return Error("expected ')'");
      return Seq{GrammarBuilder::Ref(r)};
    }
    if (Eat('[')) {
      absl::StatusOr<Ranges> r = Class(/*shorthands=*/true);
      if (!r.ok()) return r.status();
      return ClassElem(*r);
    }
    if (Eat('.')) return ClassElem({{0, '\n' - 1}, {'\n' + 1, kAnyMax}});
    if (c == '^' || c == '$') return Error("anchors are supported only at the ends");
    if (Eat('\\')) {
      if (std::optional<Ranges> s = ShorthandClass()) return ClassElem(*s);
      const char e = Peek();
      if (e == 'b' || e == 'B') return Error("word boundaries are not supported");
      if (e >= '1' && e <= '9') return Error("backreferences are not supported");
      absl::StatusOr<std::optional<uint32_t>> cp = CharEscape();
      if (!cp.ok()) return cp.status();
      if (!*cp) return Error(absl::StrCat("unsupported escape \\", std::string(1, e)));
      return Char(**cp);
    }
    absl::StatusOr<uint32_t> cp = NextCodepoint();
    if (!cp.ok()) return cp.status();
    return Char(*cp);
  }
};

absl::Status CheckSize(const std::string& what, std::string_view text) {
  if (text.size() > kMaxSchemaBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is ", text.size(), " bytes; at most ", kMaxSchemaBytes));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Grammar> GbnfGrammar(std::string_view text) {
  if (absl::Status st = CheckSize("grammar", text); !st.ok()) return st;
  return GbnfParser(text).Parse();
}

absl::StatusOr<Grammar> RegexGrammar(std::string_view pattern) {
  if (absl::Status st = CheckSize("regex", pattern); !st.ok()) return st;
  return RegexParser(pattern).Parse();
}

}  // namespace tandem::engine
