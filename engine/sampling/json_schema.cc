#include "engine/sampling/json_schema.h"

#include <array>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tandem::engine {
namespace {

using json = nlohmann::ordered_json;
using Seq = GrammarBuilder::Seq;

absl::Status Bad(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("json_schema", path, ": ", what));
}

// Keywords that only describe: skipped.
const std::set<std::string>& Annotations() {
  static const auto* s = new std::set<std::string>{
      "title", "description", "default", "examples", "$schema", "$id", "$comment", "strict"};
  return *s;
}

// Keywords this compiler turns into grammar.
const std::set<std::string>& Understood() {
  static const auto* s = new std::set<std::string>{
      "type",      "properties", "required",  "additionalProperties", "items",
      "minItems",  "maxItems",   "minLength", "maxLength",            "enum",
      "const",     "anyOf",      "oneOf",     "$ref",                 "$defs",
      "definitions"};
  return *s;
}

class JsonGrammar {
 public:
  explicit JsonGrammar(const json* root) : root_(root) {
    ws_ = b_.Choice({{}, b_.Literal(" ")});
    str_char_ = StringChar();
    string_ = String(0, -1);
    // Numbers: at most 15 integer and 15 fraction digits, and a 2-digit exponent (finite as a
    // double).
    const Seq digit = {b_.Bytes(ByteSet::Range('0', '9'))};
    const uint32_t int_part =
        b_.Choice({b_.Literal("0"), {b_.Bytes(ByteSet::Range('1', '9')),
                                     GrammarBuilder::Ref(b_.Repeat(digit, 0, 14))}});
    const uint32_t sign = b_.Choice({{}, b_.Literal("-")});
    integer_ = b_.Choice({{GrammarBuilder::Ref(sign), GrammarBuilder::Ref(int_part)}});
    const uint32_t frac =
        b_.Choice({{}, {b_.Byte('.'), GrammarBuilder::Ref(b_.Repeat(digit, 1, 15))}});
    ByteSet e = ByteSet::Of('e');
    e.Add('E');
    ByteSet pm = ByteSet::Of('+');
    pm.Add('-');
    const uint32_t exp = b_.Choice(
        {{}, {b_.Bytes(e), GrammarBuilder::Ref(b_.Choice({{}, {b_.Bytes(pm)}})),
              GrammarBuilder::Ref(b_.Repeat(digit, 1, 2))}});
    number_ = b_.Choice({{GrammarBuilder::Ref(integer_), GrammarBuilder::Ref(frac),
                          GrammarBuilder::Ref(exp)}});
    boolean_ = b_.Choice({b_.Literal("true"), b_.Literal("false")});
    null_ = b_.Choice({b_.Literal("null")});
  }

  GrammarBuilder& builder() { return b_; }

  // Any JSON value nested `depth` levels deep (objects and arrays stop at kMaxJsonDepth).
  uint32_t AnyValue(int depth) {
    if (auto it = any_value_.find(depth); it != any_value_.end()) return it->second;
    const uint32_t r = b_.NewRule();
    any_value_[depth] = r;
    for (uint32_t p : {string_, number_, boolean_, null_}) b_.AddAlt(r, {Ref(p)});
    if (depth < kMaxJsonDepth) {
      b_.AddAlt(r, {Ref(AnyObject(depth + 1))});
      b_.AddAlt(r, {Ref(Array(AnyValue(depth + 1), 0, -1))});
    }
    return r;
  }
  uint32_t AnyObject(int depth) {
    if (auto it = any_object_.find(depth); it != any_object_.end()) return it->second;
    const uint32_t r = b_.NewRule();
    any_object_[depth] = r;
    const uint32_t value = depth < kMaxJsonDepth ? AnyValue(depth) : AnyValue(kMaxJsonDepth);
    // member ::= string ':' ws value
    Seq member = {Ref(string_), b_.Byte(':'), Ref(ws_), Ref(value)};
    Seq more = {b_.Byte(','), Ref(ws_)};
    more.insert(more.end(), member.begin(), member.end());
    Seq full = {b_.Byte('{')};
    full.insert(full.end(), member.begin(), member.end());
    full.push_back(Ref(b_.Repeat(more, 0, -1)));
    full.push_back(b_.Byte('}'));
    b_.AddAlt(r, b_.Literal("{}"));
    b_.AddAlt(r, std::move(full));
    return r;
  }
  // '[' items ']' with between min and max items (max < 0: unbounded).
  uint32_t Array(uint32_t item, int min, int max) {
    const uint32_t r = b_.NewRule();
    if (min == 0) b_.AddAlt(r, b_.Literal("[]"));
    if (max == 0) return r;
    Seq more = {b_.Byte(','), Ref(ws_), Ref(item)};
    const uint32_t rest = b_.Repeat(more, std::max(min - 1, 0), max < 0 ? -1 : max - 1);
    b_.AddAlt(r, {b_.Byte('['), Ref(item), Ref(rest), b_.Byte(']')});
    return r;
  }
  uint32_t String(int min, int max) {
    return b_.Choice({{b_.Byte('"'), Ref(b_.Repeat({Ref(str_char_)}, min, max)), b_.Byte('"')}});
  }

  absl::StatusOr<uint32_t> Schema(const json& s, const std::string& path, int depth) {
    if (depth > 64) return Bad(path, "nests more than 64 levels");
    if (b_.rules() > kMaxSchemaRules) {
      return Bad(path, absl::StrCat("is too large (over ", kMaxSchemaRules, " grammar rules)"));
    }
    if (s.is_boolean()) {
      if (!s.get<bool>()) return Bad(path, "false accepts nothing");
      return AnyValue(depth);
    }
    if (!s.is_object()) return Bad(path, "must be an object or a boolean");
    for (const auto& [k, v] : s.items()) {
      if (!Understood().contains(k) && !Annotations().contains(k)) {
        return Bad(path, absl::StrCat("keyword \"", k, "\" is not supported"));
      }
    }
    if (auto it = s.find("$ref"); it != s.end()) {
      if (!it->is_string()) return Bad(path + ".$ref", "must be a string");
      return Ref(it->get<std::string>(), path, depth);
    }
    if (auto it = s.find("const"); it != s.end()) return Literal(*it);
    if (auto it = s.find("enum"); it != s.end()) {
      if (!it->is_array() || it->empty()) return Bad(path + ".enum", "must be a non-empty array");
      std::vector<Seq> alts;
      for (const json& v : *it) alts.push_back(b_.Literal(v.dump()));
      return b_.Choice(std::move(alts));
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (auto it = s.find(key); it != s.end()) {
        if (!it->is_array() || it->empty()) {
          return Bad(absl::StrCat(path, ".", key), "must be a non-empty array");
        }
        std::vector<Seq> alts;
        for (size_t i = 0; i < it->size(); ++i) {
          absl::StatusOr<uint32_t> r =
              Schema((*it)[i], absl::StrCat(path, ".", key, "[", i, "]"), depth + 1);
          if (!r.ok()) return r.status();
          alts.push_back({GrammarBuilder::Ref(*r)});
        }
        return b_.Choice(std::move(alts));
      }
    }
    auto type = s.find("type");
    if (type == s.end()) {
      if (s.contains("properties")) return Object(s, path, depth);
      if (s.contains("items")) return Array(s, path, depth);
      return AnyValue(depth);
    }
    std::vector<std::string> types;
    if (type->is_string()) {
      types.push_back(type->get<std::string>());
    } else if (type->is_array() && !type->empty()) {
      for (const json& t : *type) {
        if (!t.is_string()) return Bad(path + ".type", "must hold type names");
        types.push_back(t.get<std::string>());
      }
    } else {
      return Bad(path + ".type", "must be a type name or a list of them");
    }
    std::vector<Seq> alts;
    for (const std::string& t : types) {
      absl::StatusOr<uint32_t> r = Typed(s, t, path, depth);
      if (!r.ok()) return r.status();
      alts.push_back({GrammarBuilder::Ref(*r)});
    }
    return alts.size() == 1 ? alts[0][0].arg : b_.Choice(std::move(alts));
  }

 private:
  static GrammarBuilder::Elem Ref(uint32_t r) { return GrammarBuilder::Ref(r); }

  uint32_t Literal(const json& v) { return b_.Choice({b_.Literal(v.dump())}); }

  absl::StatusOr<uint32_t> Typed(const json& s, const std::string& t, const std::string& path,
                                 int depth) {
    if (t == "object") return Object(s, path, depth);
    if (t == "array") return Array(s, path, depth);
    if (t == "string") {
      absl::StatusOr<std::pair<int, int>> len = Bounds(s, "minLength", "maxLength", path);
      if (!len.ok()) return len.status();
      return len->first == 0 && len->second < 0 ? string_ : String(len->first, len->second);
    }
    if (t == "number") return number_;
    if (t == "integer") return integer_;
    if (t == "boolean") return boolean_;
    if (t == "null") return null_;
    return Bad(path + ".type", absl::StrCat("\"", t, "\" is not a JSON Schema type"));
  }

  // A (min, max) pair of non-negative integer keywords; max -1 when absent. At most 4096.
  absl::StatusOr<std::pair<int, int>> Bounds(const json& s, const char* lo, const char* hi,
                                            const std::string& path) {
    std::pair<int, int> out = {0, -1};
    for (const char* key : {lo, hi}) {
      auto it = s.find(key);
      if (it == s.end()) continue;
      if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 4096) {
        return Bad(absl::StrCat(path, ".", key), "must be an integer in [0, 4096]");
      }
      (key == lo ? out.first : out.second) = static_cast<int>(it->get<int64_t>());
    }
    if (out.second >= 0 && out.first > out.second) {
      return Bad(path, absl::StrCat(lo, " is greater than ", hi));
    }
    return out;
  }

  absl::StatusOr<uint32_t> Object(const json& s, const std::string& path, int depth) {
    auto props = s.find("properties");
    auto additional = s.find("additionalProperties");
    const bool closed = additional != s.end() && additional->is_boolean() && !*additional;
    if (additional != s.end() && !additional->is_boolean()) {
      return Bad(path + ".additionalProperties", "only true or false is supported");
    }
    if (props == s.end() || props->empty()) {
      return closed ? b_.Choice({b_.Literal("{}")}) : AnyObject(depth);
    }
    if (!props->is_object()) return Bad(path + ".properties", "must be an object");
    std::set<std::string> required;
    if (auto it = s.find("required"); it != s.end()) {
      if (!it->is_array()) return Bad(path + ".required", "must be an array of names");
      for (const json& n : *it) {
        if (!n.is_string()) return Bad(path + ".required", "must be an array of names");
        if (!props->contains(n.get<std::string>())) {
          return Bad(path + ".required",
                     absl::StrCat("names \"", n.get<std::string>(), "\", not a property"));
        }
        required.insert(n.get<std::string>());
      }
    }
    // Members in the schema's order: after(i, comma) matches members i.. where `comma` says
    // whether one was written before (so the next needs ", ").
    struct Member {
      Seq kv;
      bool required;
    };
    std::vector<Member> members;
    for (const auto& [name, sub] : props->items()) {
      absl::StatusOr<uint32_t> v = Schema(sub, absl::StrCat(path, ".properties.", name), depth + 1);
      if (!v.ok()) return v.status();
      Seq kv = b_.Literal(json(name).dump());
      kv.push_back(b_.Byte(':'));
      kv.push_back(Ref(ws_));
      kv.push_back(Ref(*v));
      members.push_back({std::move(kv), required.contains(name)});
    }
    const size_t n = members.size();
    std::vector<std::array<uint32_t, 2>> after(n + 1);
    after[n] = {b_.Choice({{}}), b_.Choice({{}})};
    for (size_t i = n; i-- > 0;) {
      for (int comma = 0; comma < 2; ++comma) {
        Seq with;
        if (comma) {
          with.push_back(b_.Byte(','));
          with.push_back(Ref(ws_));
        }
        with.insert(with.end(), members[i].kv.begin(), members[i].kv.end());
        with.push_back(Ref(after[i + 1][1]));
        std::vector<Seq> alts = {std::move(with)};
        if (!members[i].required) alts.push_back({Ref(after[i + 1][comma])});
        after[i][comma] = b_.Choice(std::move(alts));
      }
    }
    return b_.Choice({{b_.Byte('{'), Ref(after[0][0]), b_.Byte('}')}});
  }

  absl::StatusOr<uint32_t> Array(const json& s, const std::string& path, int depth) {
    absl::StatusOr<std::pair<int, int>> n = Bounds(s, "minItems", "maxItems", path);
    if (!n.ok()) return n.status();
    uint32_t item;
    if (auto it = s.find("items"); it != s.end()) {
      absl::StatusOr<uint32_t> r = Schema(*it, path + ".items", depth + 1);
      if (!r.ok()) return r.status();
      item = *r;
    } else {
      item = AnyValue(std::min(depth + 1, kMaxJsonDepth));
    }
    return Array(item, n->first, n->second);
  }

  absl::StatusOr<uint32_t> Ref(const std::string& ref, const std::string& path, int depth) {
    if (auto it = refs_.find(ref); it != refs_.end()) return it->second;
    const json* target = nullptr;
    if (ref == "#") {
      target = root_;
    } else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        const std::string p = prefix;
        if (ref.rfind(p, 0) != 0) continue;
        const std::string key = p == "#/$defs/" ? "$defs" : "definitions";
        auto defs = root_->find(key);
        if (defs == root_->end() || !defs->is_object()) break;
        auto t = defs->find(ref.substr(p.size()));
        if (t != defs->end()) target = &*t;
      }
    }
    if (target == nullptr) {
      return Bad(path + ".$ref", absl::StrCat("\"", ref, "\" does not name a definition here"));
    }
    // The rule exists before its body, so a definition may refer to itself.
    const uint32_t r = b_.NewRule();
    refs_[ref] = r;
    absl::StatusOr<uint32_t> body = Schema(*target, absl::StrCat(" ", ref), depth + 1);
    if (!body.ok()) return body.status();
    b_.AddAlt(r, {GrammarBuilder::Ref(*body)});
    return r;
  }

  uint32_t StringChar() {
    GrammarBuilder& b = b_;
    ByteSet plain = ByteSet::Range(0x20, 0x7f);
    plain.bits['"' >> 6] &= ~(uint64_t{1} << ('"' & 63));
    plain.bits['\\' >> 6] &= ~(uint64_t{1} << ('\\' & 63));
    ByteSet esc;
    for (char c : std::string("\"\\/bfnrt")) esc.Add(static_cast<uint8_t>(c));
    ByteSet hex = ByteSet::Range('0', '9');
    hex.AddRange('a', 'f');
    hex.AddRange('A', 'F');
    const auto cont = b.Bytes(ByteSet::Range(0x80, 0xbf));
    const auto h = b.Bytes(hex);
    // \u escapes of a code point outside the surrogates, or a high and a low surrogate in turn
    // (parsers refuse a lone one).
    ByteSet not_d = hex;
    not_d.bits['d' >> 6] &= ~(uint64_t{1} << ('d' & 63));
    not_d.bits['D' >> 6] &= ~(uint64_t{1} << ('D' & 63));
    ByteSet d = ByteSet::Of('d');
    d.Add('D');
    ByteSet high = ByteSet::Range('8', '9');
    high.AddRange('a', 'b');
    high.AddRange('A', 'B');
    ByteSet low = ByteSet::Range('c', 'f');
    low.AddRange('C', 'F');
    const auto u = b.Byte('u');
    const auto bs = b.Byte('\\');
    std::vector<Seq> alts = {
        {b.Bytes(plain)},
        {bs, b.Bytes(esc)},
        {bs, u, b.Bytes(not_d), h, h, h},
        {bs, u, b.Bytes(d), b.Bytes(ByteSet::Range('0', '7')), h, h},
        {bs, u, b.Bytes(d), b.Bytes(high), h, h, bs, u, b.Bytes(d), b.Bytes(low), h, h},
        // UTF-8 sequences of 2, 3 and 4 bytes, without overlong forms or surrogates.
        {b.Bytes(ByteSet::Range(0xc2, 0xdf)), cont},
        {b.Bytes(ByteSet::Of(0xe0)), b.Bytes(ByteSet::Range(0xa0, 0xbf)), cont},
        {b.Bytes(ByteSet::Range(0xe1, 0xec)), cont, cont},
        {b.Bytes(ByteSet::Of(0xed)), b.Bytes(ByteSet::Range(0x80, 0x9f)), cont},
        {b.Bytes(ByteSet::Range(0xee, 0xef)), cont, cont},
        {b.Bytes(ByteSet::Of(0xf0)), b.Bytes(ByteSet::Range(0x90, 0xbf)), cont, cont},
        {b.Bytes(ByteSet::Range(0xf1, 0xf3)), cont, cont, cont},
        {b.Bytes(ByteSet::Of(0xf4)), b.Bytes(ByteSet::Range(0x80, 0x8f)), cont, cont},
    };
    return b.Choice(std::move(alts));
  }

  const json* root_;
  GrammarBuilder b_;
  uint32_t ws_ = 0, str_char_ = 0, string_ = 0, number_ = 0, integer_ = 0, boolean_ = 0,
           null_ = 0;
  std::map<int, uint32_t> any_value_, any_object_;
  std::map<std::string, uint32_t> refs_;
};

}  // namespace

Grammar JsonObjectGrammar() {
  const json none;
  JsonGrammar g(&none);
  const uint32_t root = g.AnyObject(1);
  absl::StatusOr<Grammar> out = std::move(g.builder()).Build(root);
  return std::move(*out);  // built from fixed rules: cannot fail
}

absl::StatusOr<Grammar> JsonSchemaGrammar(const json& schema) {
  JsonGrammar g(&schema);
  absl::StatusOr<uint32_t> root = g.Schema(schema, "", 0);
  if (!root.ok()) return root.status();
  return std::move(g.builder()).Build(*root);
}

absl::StatusOr<Grammar> JsonSchemaGrammarFromText(std::string_view schema_text) {
  if (schema_text.size() > kMaxSchemaBytes) {
    return absl::InvalidArgumentError(absl::StrCat("json_schema is ", schema_text.size(),
                                                   " bytes; at most ", kMaxSchemaBytes));
  }
  const json schema = json::parse(schema_text.begin(), schema_text.end(), nullptr,
                                  /*allow_exceptions=*/false);
  if (schema.is_discarded()) return absl::InvalidArgumentError("json_schema is not valid JSON");
  return JsonSchemaGrammar(schema);
}

}  // namespace tandem::engine
