#include "services/router/http_openai.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "engine/sampling/json_schema.h"
#include "services/common/sampling_convert.h"

namespace tandem::router {
namespace {

using json = nlohmann::ordered_json;

HttpError Bad(std::string param, std::string message) {
  HttpError e;
  e.status = 400;
  e.message = std::move(message);
  e.param = std::move(param);
  return e;
}

const char* TypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "a number";
    default:
      return "an integer";
  }
}

// Typed access to a request object's fields. A null field counts as absent (clients send
// `"stop": null` for "unset"); a field of the wrong type records the first error, and every
// later call is a no-op, so a parser can read all fields and check `error` once.
class Fields {
 public:
  explicit Fields(const json& j) : j_(j) {}

  const json* Get(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  void Bool(const char* key, std::optional<bool>* out) {
    const json* v = Get(key);
    if (v == nullptr || error) return;
    if (!v->is_boolean()) return Fail(key, "a boolean", *v);
    *out = v->get<bool>();
  }
  void Number(const char* key, std::optional<double>* out) {
    const json* v = Get(key);
    if (v == nullptr || error) return;
    if (!v->is_number()) return Fail(key, "a number", *v);
    *out = v->get<double>();
  }
  void Int(const char* key, int64_t lo, int64_t hi, std::optional<int64_t>* out) {
    const json* v = Get(key);
    if (v == nullptr || error) return;
    if (!v->is_number_integer()) return Fail(key, "an integer", *v);
    // Unsigned values beyond int64 would wrap; compare before converting.
    if (v->is_number_unsigned() &&
        v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      error = Bad(key, absl::StrCat(key, " is out of range"));
      return;
    }
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) {
      error = Bad(key, absl::StrCat(key, " must be in [", lo, ", ", hi, "], got ", x));
      return;
    }
    *out = x;
  }
  void String(const char* key, std::optional<std::string>* out) {
    const json* v = Get(key);
    if (v == nullptr || error) return;
    if (!v->is_string()) return Fail(key, "a string", *v);
    *out = v->get<std::string>();
  }

  std::optional<HttpError> error;

 private:
  void Fail(const char* key, const char* want, const json& got) {
    error = Bad(key, absl::StrCat(key, " must be ", want, ", got ", TypeName(got)));
  }
  const json& j_;
};

// The request body as a JSON object, nested at most kMaxJsonNesting deep.
std::optional<HttpError> ParseBody(std::string_view body, json* out) {
  if (NestingOf(body) > kMaxJsonNesting) {
    return Bad("", absl::StrCat("the request body nests deeper than ", kMaxJsonNesting,
                                " levels"));
  }
  *out = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (out->is_discarded()) return Bad("", "the request body is not valid JSON");
  if (!out->is_object()) return Bad("", "the request body must be a JSON object");
  return std::nullopt;
}

std::string NewId(ApiKind kind) {
  static const uint64_t salt = std::random_device{}() * 0x9e3779b97f4a7c15ull;
  static std::atomic<uint64_t> counter{1};
  return absl::StrFormat("%s-%016x%08x", kind == ApiKind::kChat ? "chatcmpl" : "cmpl", salt,
                         counter.fetch_add(1));
}

uint64_t RandomSeed() {
  thread_local std::mt19937_64 rng(std::random_device{}() ^
                                   static_cast<uint64_t>(absl::GetCurrentTimeNanos()));
  return rng() >> 1;  // stays positive as a JSON integer in logs
}

// The text of a message's content: a string, or an array of {"type": "text", "text": ...}
// parts (joined), or null (an assistant turn that only called tools).
std::optional<HttpError> MessageContent(const json& content, size_t i, std::string* out) {
  const std::string param = absl::StrCat("messages[", i, "].content");
  if (content.is_null()) return std::nullopt;
  if (content.is_string()) {
    *out = content.get<std::string>();
    return std::nullopt;
  }
  if (!content.is_array()) {
    return Bad(param, absl::StrCat(param, " must be a string or an array of parts, got ",
                                   TypeName(content)));
  }
  for (size_t k = 0; k < content.size(); ++k) {
    const json& part = content[k];
    auto type = part.is_object() ? part.find("type") : part.end();
    auto text = part.is_object() ? part.find("text") : part.end();
    if (!part.is_object() || type == part.end() || !type->is_string() ||
        type->get<std::string>() != "text" || text == part.end() || !text->is_string()) {
      return Bad(param, absl::StrCat(param, "[", k,
                                     "]: only {\"type\": \"text\", \"text\": ...} parts are "
                                     "supported"));
    }
    *out += text->get<std::string>();
  }
  return std::nullopt;
}

std::optional<HttpError> ParseMessages(const json& j, std::vector<ChatMessage>* out) {
  auto it = j.find("messages");
  if (it == j.end() || it->is_null()) return Bad("messages", "messages is required");
  if (!it->is_array()) {
    return Bad("messages", absl::StrCat("messages must be an array, got ", TypeName(*it)));
  }
  if (it->size() > kMaxChatMessages) {
    return Bad("messages", absl::StrCat("messages holds ", it->size(), " messages; at most ",
                                        kMaxChatMessages));
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const json& m = (*it)[i];
    const std::string param = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return Bad(param, absl::StrCat(param, " must be an object"));
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return Bad(param + ".role", absl::StrCat(param, ".role is required (a string)"));
    }
    ChatMessage cm;
    cm.role = role->get<std::string>();
    auto content = m.find("content");
    if (content != m.end()) {
      if (auto e = MessageContent(*content, i, &cm.content)) return e;
    }
    if (auto calls = m.find("tool_calls"); calls != m.end() && !calls->is_null()) {
      if (!calls->is_array()) return Bad(param + ".tool_calls", param + ".tool_calls must be an array");
      for (size_t k = 0; k < calls->size(); ++k) {
        const json& c = (*calls)[k];
        const std::string cp = absl::StrCat(param, ".tool_calls[", k, "]");
        auto fn = c.is_object() ? c.find("function") : c.end();
        if (fn == c.end() || !fn->is_object() || !fn->contains("name") ||
            !(*fn)["name"].is_string()) {
          return Bad(cp, cp + " must be {\"id\", \"type\": \"function\", \"function\": "
                              "{\"name\", \"arguments\"}}");
        }
        ToolCall tc;
        tc.id = c.contains("id") && c["id"].is_string() ? c["id"].get<std::string>() : "";
        tc.name = (*fn)["name"].get<std::string>();
        if (auto args = fn->find("arguments"); args != fn->end() && !args->is_null()) {
          if (!args->is_string()) return Bad(cp, cp + ".function.arguments must be a string");
          tc.arguments = args->get<std::string>();
        }
        cm.tool_calls.push_back(std::move(tc));
      }
    }
    if (auto id = m.find("tool_call_id"); id != m.end() && id->is_string()) {
      cm.tool_call_id = id->get<std::string>();
    }
    out->push_back(std::move(cm));
  }
  return std::nullopt;
}

// prompt: a string, [string], [ids] or [[ids]]; exactly one prompt per request.
std::optional<HttpError> ParsePrompt(const json& j, const RouterModel& model,
                                     v1::GenerateRequest* g) {
  auto it = j.find("prompt");
  if (it == j.end() || it->is_null()) return Bad("prompt", "prompt is required");
  const json* p = &*it;
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) {
    p = &(*p)[0];
  } else if (p->is_array() && !p->empty() && ((*p)[0].is_string() || (*p)[0].is_array())) {
    return Bad("prompt",
               absl::StrCat("prompt: only one prompt per request is supported, got ", p->size()));
  }
  if (p->is_string()) {
    g->set_text(p->get<std::string>());
    return std::nullopt;
  }
  if (p->is_array()) {
    if (p->empty()) return Bad("prompt", "prompt must not be empty");
    v1::TokenIds* ids = g->mutable_token_ids();
    for (size_t i = 0; i < p->size(); ++i) {
      const json& t = (*p)[i];
      if (!t.is_number_integer() || t.get<int64_t>() < 0 ||
          t.get<int64_t>() >= model.vocab_size()) {
        return Bad("prompt", absl::StrCat("prompt[", i, "] must be a token id in [0, ",
                                          model.vocab_size(), ")"));
      }
      ids->add_ids(static_cast<int32_t>(t.get<int64_t>()));
    }
    return std::nullopt;
  }
  return Bad("prompt", absl::StrCat("prompt must be a string, an array of token ids, or an array "
                                    "holding one of these, got ",
                                    TypeName(*p)));
}

std::optional<HttpError> ParseStop(Fields& f, v1::SamplingParams* s) {
  const json* v = f.Get("stop");
  if (v == nullptr) return std::nullopt;
  if (v->is_string()) {
    if (!v->get<std::string>().empty()) s->add_stop(v->get<std::string>());
    return std::nullopt;
  }
  if (!v->is_array()) {
    return Bad("stop",
               absl::StrCat("stop must be a string or an array of strings, got ", TypeName(*v)));
  }
  for (size_t i = 0; i < v->size(); ++i) {
    if (!(*v)[i].is_string()) return Bad("stop", absl::StrCat("stop[", i, "] must be a string"));
    if (!(*v)[i].get<std::string>().empty()) s->add_stop((*v)[i].get<std::string>());
  }
  return std::nullopt;
}

// Options this server does not implement but that would change the answer's shape: refused,
// so a client never silently gets something other than what it asked for.
std::optional<HttpError> RefuseUnsupported(Fields& f, ApiKind kind, int32_t n) {
  std::optional<int64_t> best_of;
  f.Int("best_of", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
        &best_of);
  if (f.error) return f.error;
  if (best_of && *best_of != n) {
    return Bad("best_of", absl::StrCat("best_of must equal n (", n, "), got ", *best_of));
  }
  if (kind == ApiKind::kChat) {
    if (const json* v = f.Get("echo"); v != nullptr && !(v->is_boolean() && !v->get<bool>())) {
      return Bad("echo", "echo is supported on completions only");
    }
  }
  if (const json* v = f.Get("suffix"); v != nullptr && !(v->is_string() && v->empty())) {
    return Bad("suffix", "suffix is not supported");
  }
  if (const json* v = f.Get("logit_bias"); v != nullptr && !(v->is_object() && v->empty())) {
    return Bad("logit_bias", "logit_bias is not supported");
  }
  return std::nullopt;
}

bool ValidToolName(const std::string& n) {
  if (n.empty() || n.size() > 64) return false;
  return std::all_of(n.begin(), n.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
  });
}

// tools and tool_choice (chat). Sets out's tool names and choice, *specs to the tools as the
// chat template lists them (none for tool_choice "none"), and, for "required" or a named
// function, the output constraint: one call's JSON, {"name", "arguments"}, whose arguments
// follow the function's parameters schema.
std::optional<HttpError> ParseTools(Fields& f, OpenAiRequest* out, std::vector<std::string>* specs,
                                    v1::SamplingParams* s) {
  const json* tools = f.Get("tools");
  if (tools != nullptr && !tools->is_array()) return Bad("tools", "tools must be an array");
  if (tools != nullptr && tools->size() > kMaxTools) {
    return Bad("tools", absl::StrCat("tools holds ", tools->size(), " tools; at most ", kMaxTools));
  }
  std::vector<json> params;
  for (size_t i = 0; tools != nullptr && i < tools->size(); ++i) {
    const json& t = (*tools)[i];
    const std::string p = absl::StrCat("tools[", i, "]");
    auto fn = t.is_object() ? t.find("function") : t.end();
    if (!t.is_object() || t.value("type", "") != "function" || fn == t.end() ||
        !fn->is_object()) {
      return Bad(p, p + " must be {\"type\": \"function\", \"function\": {...}}");
    }
    auto name = fn->find("name");
    if (name == fn->end() || !name->is_string() || !ValidToolName(name->get<std::string>())) {
      return Bad(p + ".function.name",
                 p + ".function.name must be 1 to 64 letters, digits, '_' or '-'");
    }
    if (std::find(out->tool_names.begin(), out->tool_names.end(), name->get<std::string>()) !=
        out->tool_names.end()) {
      return Bad(p + ".function.name",
                 absl::StrCat(p, ".function.name '", name->get<std::string>(),
                              "' names another tool too"));
    }
    json parameters = json{{"type", "object"}, {"properties", json::object()}};
    if (auto pa = fn->find("parameters"); pa != fn->end() && !pa->is_null()) {
      if (!pa->is_object()) {
        return Bad(p + ".function.parameters", p + ".function.parameters must be an object");
      }
      if (absl::StatusOr<engine::Grammar> g = engine::JsonSchemaGrammar(*pa); !g.ok()) {
        return Bad(p + ".function.parameters",
                   absl::StrCat(p, ".function.parameters: ", g.status().message()));
      }
      parameters = *pa;
    }
    out->tool_names.push_back(name->get<std::string>());
    params.push_back(std::move(parameters));
    specs->push_back(json{{"type", "function"}, {"function", *fn}}.dump());
  }
  const json* choice = f.Get("tool_choice");
  std::string named;
  out->tool_choice = out->tool_names.empty() ? ToolChoice::kNone : ToolChoice::kAuto;
  if (choice != nullptr) {
    if (choice->is_string() && (*choice == "none" || *choice == "auto" || *choice == "required")) {
      out->tool_choice = *choice == "none"   ? ToolChoice::kNone
                         : *choice == "auto" ? ToolChoice::kAuto
                                             : ToolChoice::kRequired;
    } else if (choice->is_object() && choice->value("type", "") == "function" &&
               choice->contains("function") && (*choice)["function"].is_object() &&
               (*choice)["function"].contains("name") &&
               (*choice)["function"]["name"].is_string()) {
      out->tool_choice = ToolChoice::kNamed;
      named = (*choice)["function"]["name"].get<std::string>();
      if (std::find(out->tool_names.begin(), out->tool_names.end(), named) ==
          out->tool_names.end()) {
        return Bad("tool_choice", absl::StrCat("tool_choice names '", named,
                                               "', which is not one of the tools"));
      }
    } else {
      return Bad("tool_choice",
                 "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": "
                 "\"function\", \"function\": {\"name\": ...}}");
    }
    if (out->tool_names.empty() && out->tool_choice != ToolChoice::kNone &&
        out->tool_choice != ToolChoice::kAuto) {
      return Bad("tool_choice", "tool_choice needs tools");
    }
    if (out->tool_names.empty()) out->tool_choice = ToolChoice::kNone;
  }
  if (out->tool_choice == ToolChoice::kNone) {
    specs->clear();  // the model is not told about tools it may not call
    return std::nullopt;
  }
  if (out->tool_choice == ToolChoice::kAuto) return std::nullopt;
  if (s->has_response_format()) {
    return Bad("response_format",
               "response_format cannot be combined with tool_choice \"required\" or a named "
               "function (the answer is the call's JSON)");
  }
  json any = json::array();
  for (size_t i = 0; i < out->tool_names.size(); ++i) {
    if (!named.empty() && out->tool_names[i] != named) continue;
    any.push_back({{"type", "object"},
                   {"properties", {{"name", {{"const", out->tool_names[i]}}},
                                   {"arguments", params[i]}}},
                   {"required", {"name", "arguments"}},
                   {"additionalProperties", false}});
  }
  s->mutable_response_format()->set_json_schema(
      (any.size() == 1 ? any[0] : json{{"anyOf", any}}).dump());
  return std::nullopt;
}

std::string NewCallId() {
  thread_local std::mt19937_64 rng(std::random_device{}() ^
                                   static_cast<uint64_t>(absl::GetCurrentTimeNanos()));
  return absl::StrFormat("call_%016x%08x", rng(), static_cast<uint32_t>(rng()));
}

// {"name", "arguments"} as a call to one of r's tools (arguments an object; "parameters" is
// accepted for it, as some models write).
std::optional<ToolCall> CallFromJson(const OpenAiRequest& r, const json& j) {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return std::nullopt;
  const std::string name = j["name"].get<std::string>();
  if (std::find(r.tool_names.begin(), r.tool_names.end(), name) == r.tool_names.end()) {
    return std::nullopt;
  }
  const json* args = j.contains("arguments")    ? &j["arguments"]
                     : j.contains("parameters") ? &j["parameters"]
                                                : nullptr;
  if (args == nullptr || !args->is_object()) return std::nullopt;
  return ToolCall{NewCallId(), name, args->dump()};
}

// response_format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
// "json_schema": {"name", "schema", "strict"}}. The schema itself is checked where it is
// compiled (the router's validation names what it gets wrong).
std::optional<HttpError> ParseResponseFormat(Fields& f, v1::SamplingParams* s) {
  const json* v = f.Get("response_format");
  if (v == nullptr) return std::nullopt;
  auto type = v->is_object() ? v->find("type") : v->end();
  if (!v->is_object() || type == v->end() || !type->is_string()) {
    return Bad("response_format", "response_format must be an object with a \"type\"");
  }
  const std::string t = type->get<std::string>();
  if (t == "text") return std::nullopt;
  if (t == "json_object") {
    s->mutable_response_format()->set_json_object(true);
    return std::nullopt;
  }
  if (t != "json_schema") {
    return Bad("response_format.type",
               absl::StrCat("response_format.type must be \"text\", \"json_object\" or "
                            "\"json_schema\", got \"",
                            t, "\""));
  }
  auto js = v->find("json_schema");
  if (js == v->end() || !js->is_object()) {
    return Bad("response_format.json_schema", "response_format.json_schema must be an object");
  }
  auto schema = js->find("schema");
  if (schema == js->end() || !(schema->is_object() || schema->is_boolean())) {
    return Bad("response_format.json_schema.schema",
               "response_format.json_schema.schema is required (a JSON Schema object)");
  }
  if (auto name = js->find("name"); name != js->end() && !name->is_string()) {
    return Bad("response_format.json_schema.name",
               "response_format.json_schema.name must be a string");
  }
  s->mutable_response_format()->set_json_schema(schema->dump());
  return std::nullopt;
}

// vLLM's extension structured_outputs: exactly one of {"regex": pattern}, {"grammar": GBNF}
// or {"choice": [strings]} (the output is one of them; compiled as a regex of the escaped
// strings). Not with a response_format other than text. Checked where it is compiled.
std::optional<HttpError> ParseStructuredOutputs(Fields& f, v1::SamplingParams* s) {
  const json* v = f.Get("structured_outputs");
  if (v == nullptr) return std::nullopt;
  const char* kWhat =
      "structured_outputs must be an object with one of \"regex\", \"grammar\" or \"choice\"";
  if (!v->is_object() || v->size() != 1) return Bad("structured_outputs", kWhat);
  if (s->has_response_format()) {
    return Bad("structured_outputs",
               "structured_outputs cannot be combined with a response_format other than text");
  }
  const auto& [key, val] = *v->items().begin();
  if (key == "regex" || key == "grammar") {
    if (!val.is_string()) {
      return Bad(absl::StrCat("structured_outputs.", key),
                 absl::StrCat("structured_outputs.", key, " must be a string"));
    }
    if (key == "regex") {
      s->mutable_response_format()->set_regex(val.get<std::string>());
    } else {
      s->mutable_response_format()->set_grammar(val.get<std::string>());
    }
    return std::nullopt;
  }
  if (key != "choice") return Bad("structured_outputs", kWhat);
  if (!val.is_array() || val.empty() ||
      !std::all_of(val.begin(), val.end(), [](const json& c) { return c.is_string(); })) {
    return Bad("structured_outputs.choice",
               "structured_outputs.choice must be a non-empty array of strings");
  }
  std::string regex;
  for (const json& c : val) {
    if (!regex.empty()) regex += '|';
    regex += '(';
    for (char ch : c.get<std::string>()) {
      if (std::strchr("\\^$.|?*+()[]{}", ch) != nullptr && ch != '\0') regex += '\\';
      regex += ch;
    }
    regex += ')';
  }
  s->mutable_response_format()->set_regex(regex);
  return std::nullopt;
}

std::optional<HttpError> ParseSampling(Fields& f, ApiKind kind, v1::SamplingParams* s,
                                       std::optional<int64_t>* max_tokens) {
  constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();
  std::optional<double> temperature, top_p, min_p, presence, frequency, repetition;
  std::optional<int64_t> seed, top_k, mct;
  std::optional<bool> ignore_eos, speculative;
  f.Number("temperature", &temperature);
  f.Number("top_p", &top_p);
  f.Number("min_p", &min_p);
  f.Number("presence_penalty", &presence);
  f.Number("frequency_penalty", &frequency);
  f.Number("repetition_penalty", &repetition);
  f.Int("seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), &seed);
  f.Int("top_k", -1, kI32, &top_k);
  f.Int("max_tokens", 1, kI32, max_tokens);
  if (kind == ApiKind::kChat) f.Int("max_completion_tokens", 1, kI32, &mct);
  f.Bool("ignore_eos", &ignore_eos);
  // Extension field, as ignore_eos is: false keeps this request off speculative decoding.
  f.Bool("speculative", &speculative);
  if (f.error) return f.error;
  if (mct && !*max_tokens) *max_tokens = mct;
  if (temperature) s->set_temperature(static_cast<float>(*temperature));
  if (top_p) s->set_top_p(static_cast<float>(*top_p));
  if (min_p) s->set_min_p(static_cast<float>(*min_p));
  if (presence) s->set_presence_penalty(static_cast<float>(*presence));
  if (frequency) s->set_frequency_penalty(static_cast<float>(*frequency));
  if (repetition) s->set_repetition_penalty(static_cast<float>(*repetition));
  if (top_k) s->set_top_k(static_cast<int32_t>(*top_k));
  s->set_seed(seed ? static_cast<uint64_t>(*seed) : RandomSeed());
  if (ignore_eos) s->set_ignore_eos(*ignore_eos);
  if (speculative) s->set_speculative(*speculative);
  if (auto e = ParseStop(f, s)) return e;
  if (const json* v = f.Get("stop_token_ids")) {
    if (!v->is_array()) return Bad("stop_token_ids", "stop_token_ids must be an array of ids");
    for (const json& id : *v) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > kI32) {
        return Bad("stop_token_ids", "stop_token_ids must be an array of token ids");
      }
      s->add_stop_token_ids(static_cast<int32_t>(id.get<int64_t>()));
    }
  }
  return std::nullopt;
}

// Chat: logprobs (a boolean) and top_logprobs (0..20, needs logprobs). Completions: logprobs,
// the number of alternatives (0..20). Sets *out to -1 (off) or the number of alternatives.
std::optional<HttpError> ParseLogprobs(Fields& f, ApiKind kind, int32_t* out) {
  *out = -1;
  std::optional<int64_t> top;
  if (kind == ApiKind::kChat) {
    std::optional<bool> on;
    f.Bool("logprobs", &on);
    f.Int("top_logprobs", 0, engine::kMaxTopLogprobs, &top);
    if (f.error) return f.error;
    if (top && !on.value_or(false)) {
      return Bad("top_logprobs", "top_logprobs needs logprobs: true");
    }
    if (on.value_or(false)) *out = static_cast<int32_t>(top.value_or(0));
    return std::nullopt;
  }
  f.Int("logprobs", 0, engine::kMaxTopLogprobs, &top);
  if (f.error) return f.error;
  if (top) *out = static_cast<int32_t>(*top);
  return std::nullopt;
}

// One token as chat logprobs spell it: its text, and its bytes (a token may hold part of a
// UTF-8 character; the text then carries U+FFFD where the bytes do not).
json ChatToken(const engine::Tokenizer& tok, int32_t id, float logprob) {
  const std::string piece = tok.TokenToPiece(id, /*special=*/true);
  json bytes = json::array();
  for (unsigned char c : piece) bytes.push_back(static_cast<int>(c));
  return {{"token", piece}, {"logprob", logprob}, {"bytes", std::move(bytes)}};
}

// choices[i].logprobs of a chat response or chunk, for `ids`.
json ChatLogprobs(const engine::Tokenizer& tok, std::span<const int32_t> ids,
                  std::span<const v1::TokenLogprobs> lps) {
  json content = json::array();
  for (size_t i = 0; i < ids.size() && i < lps.size(); ++i) {
    json e = ChatToken(tok, ids[i], lps[i].logprob());
    json top = json::array();
    for (int k = 0; k < lps[i].top_ids_size() && k < lps[i].top_logprobs_size(); ++k) {
      top.push_back(ChatToken(tok, lps[i].top_ids(k), lps[i].top_logprobs(k)));
    }
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return {{"content", std::move(content)}, {"refusal", nullptr}};
}

// choices[i].logprobs of a completion: tokens, token_logprobs, top_logprobs (the alternatives
// and the sampled token, by text) and text_offset (from *offset, which advances).
json CompletionLogprobs(const engine::Tokenizer& tok, std::span<const int32_t> ids,
                        std::span<const v1::TokenLogprobs> lps, int64_t* offset) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  for (size_t i = 0; i < ids.size() && i < lps.size(); ++i) {
    const std::string piece = tok.TokenToPiece(ids[i], /*special=*/true);
    json alternatives = json::object();
    for (int k = 0; k < lps[i].top_ids_size() && k < lps[i].top_logprobs_size(); ++k) {
      alternatives[tok.TokenToPiece(lps[i].top_ids(k), true)] = lps[i].top_logprobs(k);
    }
    alternatives[piece] = lps[i].logprob();
    tokens.push_back(piece);
    token_logprobs.push_back(lps[i].logprob());
    top.push_back(std::move(alternatives));
    offsets.push_back(*offset);
    *offset += static_cast<int64_t>(piece.size());
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top)},
          {"text_offset", std::move(offsets)}};
}

std::string ParamFromMessage(std::string_view msg, ApiKind kind) {
  constexpr std::string_view kSampling = "sampling.";
  if (msg.substr(0, kSampling.size()) == kSampling) {
    std::string_view rest = msg.substr(kSampling.size());
    size_t n = 0;
    while (n < rest.size() &&
           (std::isalnum(static_cast<unsigned char>(rest[n])) || rest[n] == '_')) {
      ++n;
    }
    std::string p(rest.substr(0, n));
    if (p == "stop_strings") p = "stop";
    // A grammar or regex came from structured_outputs (json formats from response_format).
    const std::string_view format = rest.substr(std::min(rest.size(), n + 1));
    if (p == "response_format" &&
        (format.substr(0, 7) == "grammar" || format.substr(0, 5) == "regex")) {
      p = "structured_outputs";
    }
    return p;
  }
  if (msg.substr(0, 6) == "prompt") return kind == ApiKind::kChat ? "messages" : "prompt";
  return "";
}

json Usage(std::span<const Accumulated> choices) {
  int64_t prompt = 0, completion = 0;
  for (const Accumulated& a : choices) {
    prompt = std::max<int64_t>(prompt, a.prompt_tokens);
    completion += a.completion_tokens;
  }
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion}};
}

}  // namespace

json ErrorJson(const HttpError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

HttpError ErrorFromStatus(const absl::Status& st, ApiKind kind) {
  HttpError e;
  e.message = std::string(st.message());
  switch (st.code()) {
    case absl::StatusCode::kInvalidArgument:
      e.status = 400;
      e.param = ParamFromMessage(e.message, kind);
      break;
    case absl::StatusCode::kNotFound:
      e.status = 400;
      e.param = "model";
      e.code = "model_not_found";
      break;
    case absl::StatusCode::kUnauthenticated:
      e.status = 401;
      e.code = "invalid_api_key";
      break;
    case absl::StatusCode::kAlreadyExists:
      e.status = 409;
      e.code = "conflict";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.status = 429;
      e.type = "rate_limit_error";
      e.code = "rate_limit_exceeded";
      break;
    case absl::StatusCode::kUnavailable:
      e.status = 503;
      e.type = "service_unavailable_error";
      e.code = "service_unavailable";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      e.status = 504;
      e.type = "timeout_error";
      e.code = "deadline_exceeded";
      break;
    case absl::StatusCode::kCancelled:
      e.status = 499;  // the client went away; nobody reads this
      e.type = "cancelled";
      break;
    default:
      e.status = 500;
      e.type = "server_error";
      e.code = "internal_error";
      break;
  }
  if (e.message.empty()) e.message = st.ToString();
  return e;
}

std::optional<HttpError> ParseOpenAiRequest(ApiKind kind, std::string_view body,
                                            const RouterModel& model, const ChatTemplate& chat,
                                            OpenAiRequest* out) {
  json j;
  if (auto e = ParseBody(body, &j)) return e;
  Fields f(j);
  *out = OpenAiRequest();
  out->kind = kind;
  out->id = NewId(kind);
  out->created = absl::ToUnixSeconds(absl::Now());
  std::optional<std::string> model_name;
  std::optional<bool> stream, include_usage, add_generation_prompt;
  f.String("model", &model_name);
  f.Bool("stream", &stream);
  if (kind == ApiKind::kChat) f.Bool("add_generation_prompt", &add_generation_prompt);
  if (f.error) return f.error;
  if (model_name && !model.Matches(*model_name)) {
    HttpError e =
        Bad("model", absl::StrCat("model '", *model_name,
                                  "' is not served here; this server serves '", model.id(), "'"));
    e.code = "model_not_found";
    return e;
  }
  out->model = model_name && !model_name->empty() ? *model_name : model.id();
  out->stream = stream.value_or(false);
  if (const json* so = f.Get("stream_options")) {
    if (!out->stream) return Bad("stream_options", "stream_options needs stream: true");
    if (!so->is_object()) return Bad("stream_options", "stream_options must be an object");
    Fields sf(*so);
    sf.Bool("include_usage", &include_usage);
    if (sf.error) {
      sf.error->param = "stream_options.include_usage";
      return sf.error;
    }
    out->include_usage = include_usage.value_or(false);
  }
  std::optional<int64_t> n;
  std::optional<bool> echo;
  f.Int("n", 1, kMaxChoices, &n);
  if (kind == ApiKind::kCompletion) f.Bool("echo", &echo);
  if (f.error) return f.error;
  out->n = static_cast<int32_t>(n.value_or(1));
  out->echo = echo.value_or(false);
  if (auto e = RefuseUnsupported(f, kind, out->n)) return e;
  if (auto e = ParseLogprobs(f, kind, &out->logprobs)) return e;
  if (out->echo && out->logprobs >= 0) {
    return Bad("echo", "echo with logprobs is not supported (the prompt's log-probabilities are "
                       "not computed)");
  }
  out->tokenizer = &model.tokenizer();

  v1::GenerateRequest& g = out->generate;
  g.Clear();
  g.set_request_id(out->id);
  g.set_model(model_name.value_or(""));
  std::optional<int64_t> max_tokens;
  if (auto e = ParseSampling(f, kind, g.mutable_sampling(), &max_tokens)) return e;
  if (out->logprobs >= 0) g.mutable_sampling()->set_logprobs(out->logprobs);
  if (auto e = ParseResponseFormat(f, g.mutable_sampling())) return e;
  if (auto e = ParseStructuredOutputs(f, g.mutable_sampling())) return e;
  // Extension field: the request's class at the router's admission queue.
  std::optional<std::string> priority;
  f.String("priority", &priority);
  // OpenAI's end-user id names the conversation: its turns go to the decode worker that holds
  // its KV (GenerateRequest.session_id; the X-Session-Id header takes precedence).
  std::optional<std::string> user;
  f.String("user", &user);
  if (f.error) return f.error;
  if (user) g.set_session_id(*user);
  if (priority) {
    absl::StatusOr<v1::Priority> p = services::PriorityFromName(*priority);
    if (!p.ok()) return Bad("priority", std::string(p.status().message()));
    g.set_priority(*p);
  }
  // Extension fields: the request's TTFT and TPOT targets (services/router/slo.h).
  std::optional<int64_t> ttft_target, tpot_target;
  f.Int("ttft_target_ms", 0, 3'600'000, &ttft_target);
  f.Int("tpot_target_ms", 0, 3'600'000, &tpot_target);
  if (f.error) return f.error;
  g.set_ttft_target_ms(static_cast<uint32_t>(ttft_target.value_or(0)));
  g.set_tpot_target_ms(static_cast<uint32_t>(tpot_target.value_or(0)));
  if (kind == ApiKind::kCompletion) {
    if (auto e = ParsePrompt(j, model, &g)) return e;
    if (out->echo) {
      const auto& ids = g.token_ids().ids();
      out->echo_text =
          g.has_text() ? g.text()
                       : model.tokenizer().Decode(
                             std::span<const int32_t>(ids.data(), static_cast<size_t>(ids.size())),
                             /*special=*/false);
    }
    g.mutable_sampling()->set_max_tokens(static_cast<int32_t>(max_tokens.value_or(16)));
    return std::nullopt;
  }
  std::vector<ChatMessage> messages;
  if (auto e = ParseMessages(j, &messages)) return e;
  std::vector<std::string> tool_specs;
  if (auto e = ParseTools(f, out, &tool_specs, g.mutable_sampling())) return e;
  absl::StatusOr<std::string> text =
      chat.Render(messages, add_generation_prompt.value_or(true), tool_specs);
  if (!text.ok()) {
    std::string msg(text.status().message());
    std::string param = msg.substr(0, msg.find_first_of(" :"));
    return Bad(param, msg);
  }
  g.set_text(*text);
  for (const std::string& s : chat.extra_stop_strings()) g.mutable_sampling()->add_stop(s);
  if (max_tokens) {
    g.mutable_sampling()->set_max_tokens(static_cast<int32_t>(*max_tokens));
  } else {
    // OpenAI's chat default: as many tokens as the context leaves. The router tokenises the
    // same way (add_special, parse_special), so the count matches what it checks; a prompt
    // that fills the context gets 1 and the router's "prompt has N tokens" error.
    const int64_t n = static_cast<int64_t>(
        model.tokenizer().Encode(*text, /*add_special=*/true, /*parse_special=*/true).size());
    g.mutable_sampling()->set_max_tokens(
        static_cast<int32_t>(std::max<int64_t>(1, model.ctx_size() - n)));
  }
  return std::nullopt;
}

void Accumulated::Add(const v1::GenerateResponse& m) {
  text += m.text();
  completion_tokens += m.token_ids_size();
  if (m.prompt_token_ids_size() > 0) prompt_tokens = m.prompt_token_ids_size();
  for (int i = 0; i < m.logprobs_size() && i < m.token_ids_size(); ++i) {
    logprob_ids.push_back(m.token_ids(i));
    logprobs.push_back(m.logprobs(i));
  }
  if (m.finished()) {
    finished = true;
    finish = m.finish_reason();
    if (m.usage().prompt_tokens() > 0) prompt_tokens = m.usage().prompt_tokens();
    if (m.usage().completion_tokens() > 0) completion_tokens = m.usage().completion_tokens();
  }
}

const char* OpenAiFinishReason(v1::FinishReason r) {
  return r == v1::FINISH_REASON_LENGTH ? "length" : "stop";
}

int NestingOf(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

std::optional<HttpError> ParseChatTools(const json& body, OpenAiRequest* r,
                                        std::vector<std::string>* specs, v1::SamplingParams* s) {
  Fields f(body);
  if (auto e = ParseTools(f, r, specs, s)) return e;
  return f.error;
}

ToolCallOutput ParseToolCalls(const OpenAiRequest& r, const std::string& text) {
  ToolCallOutput out;
  if (r.tool_choice == ToolChoice::kNone) {
    out.content = text;
    return out;
  }
  if (r.tool_choice != ToolChoice::kAuto) {
    const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (std::optional<ToolCall> c = CallFromJson(r, j)) {
      out.calls.push_back(std::move(*c));
    } else {
      out.content = text;  // cut short (max_tokens): not a whole call
    }
    return out;
  }
  const std::string_view open = ChatTemplate::kToolCallOpen;
  const std::string_view close = ChatTemplate::kToolCallClose;
  size_t at = 0;
  while (at < text.size()) {
    const size_t b = text.find(open, at);
    if (b == std::string::npos) {
      out.content += text.substr(at);
      break;
    }
    size_t e = text.find(close, b + open.size());
    const size_t body_end = e == std::string::npos ? text.size() : e;
    const std::string body = text.substr(b + open.size(), body_end - b - open.size());
    const size_t next = e == std::string::npos ? text.size() : e + close.size();
    std::optional<ToolCall> c =
        CallFromJson(r, json::parse(body, nullptr, /*allow_exceptions=*/false));
    out.content += text.substr(at, b - at);
    if (c) {
      out.calls.push_back(std::move(*c));
    } else {
      out.content += text.substr(b, next - b);  // not a call after all: it stays text
    }
    at = next;
  }
  return out;
}

namespace {

json ToolCallsJson(const std::vector<ToolCall>& calls, bool with_index) {
  json out = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    json c = {{"id", calls[i].id},
              {"type", "function"},
              {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (with_index) c["index"] = i;
    out.push_back(std::move(c));
  }
  return out;
}

bool AllSpace(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)); });
}

}  // namespace

v1::GenerateRequest ChoiceRequest(const OpenAiRequest& r, int32_t index) {
  v1::GenerateRequest g = r.generate;
  if (index > 0) {
    g.set_request_id(absl::StrCat(r.id, "-", index));
    g.mutable_sampling()->set_seed(g.sampling().seed() + static_cast<uint64_t>(index));
  }
  return g;
}

json CompletionJson(const OpenAiRequest& r, std::span<const Accumulated> choices) {
  json out = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const Accumulated& a = choices[i];
    json choice = {{"index", i},
                   {"logprobs", nullptr},
                   {"finish_reason", OpenAiFinishReason(a.finish)}};
    if (r.kind == ApiKind::kChat) {
      choice["message"] = {{"role", "assistant"}, {"content", a.text}, {"refusal", nullptr}};
      if (r.tool_choice != ToolChoice::kNone) {
        ToolCallOutput t = ParseToolCalls(r, a.text);
        if (!t.calls.empty()) {
          choice["message"]["content"] = AllSpace(t.content) ? json(nullptr) : json(t.content);
          choice["message"]["tool_calls"] = ToolCallsJson(t.calls, /*with_index=*/false);
          choice["finish_reason"] = "tool_calls";
        }
      }
    } else {
      choice["text"] = r.echo ? r.echo_text + a.text : a.text;
    }
    if (r.logprobs >= 0 && r.tokenizer != nullptr) {
      int64_t offset = 0;
      choice["logprobs"] =
          r.kind == ApiKind::kChat
              ? ChatLogprobs(*r.tokenizer, a.logprob_ids, a.logprobs)
              : CompletionLogprobs(*r.tokenizer, a.logprob_ids, a.logprobs, &offset);
    }
    out.push_back(std::move(choice));
  }
  return {{"id", r.id},
          {"object", r.kind == ApiKind::kChat ? "chat.completion" : "text_completion"},
          {"created", r.created},
          {"model", r.model},
          {"choices", std::move(out)},
          {"usage", Usage(choices)}};
}

std::string DumpJson(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

json SseEncoder::Chunk() const {
  json c = {{"id", r_.id},
            {"object", r_.kind == ApiKind::kChat ? "chat.completion.chunk" : "text_completion"},
            {"created", r_.created},
            {"model", r_.model}};
  // Chat chunks say "usage": null until the usage chunk, as OpenAI's do; the completions
  // chunk type has no null usage, so there it is left out.
  if (r_.include_usage && r_.kind == ApiKind::kChat) c["usage"] = nullptr;
  return c;
}

std::string SseEncoder::Event(const json& j) const { return "data: " + DumpJson(j) + "\n\n"; }

std::string SseEncoder::Open() {
  if (r_.kind != ApiKind::kChat) {
    if (!r_.echo || r_.echo_text.empty()) return "";
    json c = Chunk();
    c["choices"] = json::array({{{"index", index_},
                                 {"text", r_.echo_text},
                                 {"logprobs", nullptr},
                                 {"finish_reason", nullptr}}});
    return Event(c);
  }
  json c = Chunk();
  c["choices"] = json::array({{{"index", index_},
                               {"delta", {{"role", "assistant"}, {"content", ""}}},
                               {"logprobs", nullptr},
                               {"finish_reason", nullptr}}});
  return Event(c);
}

void SseEncoder::TakeLogprobs(json& choice) {
  if (r_.logprobs < 0 || r_.tokenizer == nullptr) return;
  choice["logprobs"] = r_.kind == ApiKind::kChat
                           ? ChatLogprobs(*r_.tokenizer, ids_, logprobs_)
                           : CompletionLogprobs(*r_.tokenizer, ids_, logprobs_, &text_offset_);
  ids_.clear();
  logprobs_.clear();
}

std::string SseEncoder::Delta(const v1::GenerateResponse& m) {
  for (int i = 0; i < m.logprobs_size() && i < m.token_ids_size(); ++i) {
    ids_.push_back(m.token_ids(i));
    logprobs_.push_back(m.logprobs(i));
  }
  std::string text = m.text();
  if (r_.kind == ApiKind::kChat && r_.tool_choice != ToolChoice::kNone) {
    // Held back while it may be a call: all of it when the answer must be one, else from the
    // first <tool_call> (or a tail that may begin one) on.
    held_ += text;
    text.clear();
    if (r_.tool_choice == ToolChoice::kAuto) {
      const std::string_view open = ChatTemplate::kToolCallOpen;
      size_t keep = held_.find(open);
      if (keep == std::string::npos) {
        keep = held_.size();
        for (size_t k = std::min(held_.size(), open.size() - 1); k > 0; --k) {
          if (open.substr(0, k) == std::string_view(held_).substr(held_.size() - k)) {
            keep = held_.size() - k;
            break;
          }
        }
      }
      if (keep > 0) {
        text = held_.substr(0, keep);
        held_.erase(0, keep);
        sent_ += text;
      }
    }
  }
  if (text.empty()) return "";
  json c = Chunk();
  json choice = {{"index", index_}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
  if (r_.kind == ApiKind::kChat) {
    choice["delta"] = {{"content", text}};
  } else {
    choice["text"] = text;
  }
  TakeLogprobs(choice);
  c["choices"] = json::array({choice});
  return Event(c);
}

std::string SseEncoder::Finish(const Accumulated& a) {
  std::string out;
  const char* finish = OpenAiFinishReason(a.finish);
  if (r_.kind == ApiKind::kChat && r_.tool_choice != ToolChoice::kNone) {
    const ToolCallOutput t = ParseToolCalls(r_, a.text);
    json delta = json::object();
    // The content not sent yet (what was held back and is not a call).
    if (t.content.size() > sent_.size() && t.content.compare(0, sent_.size(), sent_) == 0) {
      delta["content"] = t.content.substr(sent_.size());
    }
    if (!t.calls.empty()) {
      delta["tool_calls"] = ToolCallsJson(t.calls, /*with_index=*/true);
      finish = "tool_calls";
    }
    if (!delta.empty()) {
      json c = Chunk();
      json choice = {{"index", index_}, {"logprobs", nullptr}, {"finish_reason", nullptr},
                     {"delta", std::move(delta)}};
      TakeLogprobs(choice);
      c["choices"] = json::array({choice});
      out += Event(c);
    }
    held_.clear();
  }
  json c = Chunk();
  json choice = {{"index", index_}, {"logprobs", nullptr}, {"finish_reason", finish}};
  if (r_.kind == ApiKind::kChat) {
    choice["delta"] = json::object();
  } else {
    choice["text"] = "";
  }
  if (!ids_.empty()) TakeLogprobs(choice);  // tokens whose text was held back or dropped
  c["choices"] = json::array({choice});
  return out + Event(c);
}

std::string SseEncoder::Done(std::span<const Accumulated> choices) {
  std::string out;
  if (r_.include_usage) {
    json u = Chunk();
    u["choices"] = json::array();
    u["usage"] = Usage(choices);
    out += Event(u);
  }
  return out + "data: [DONE]\n\n";
}

std::string SseEncoder::Error(const HttpError& e) {
  return Event(ErrorJson(e)) + "data: [DONE]\n\n";
}

json ModelJson(const RouterModel& model, int64_t created) {
  return {{"id", model.id()},     {"object", "model"},    {"created", created},
          {"owned_by", "tandem"}, {"root", model.path()}, {"max_model_len", model.ctx_size()}};
}

json ModelsJson(const RouterModel& model, int64_t created) {
  return {{"object", "list"}, {"data", json::array({ModelJson(model, created)})}};
}

std::optional<HttpError> Tokenize(std::string_view body, const RouterModel& model,
                                  const ChatTemplate& chat, json* out) {
  json j;
  if (auto e = ParseBody(body, &j)) return e;
  Fields f(j);
  std::optional<std::string> model_name, prompt;
  std::optional<bool> add_special, add_generation_prompt;
  f.String("model", &model_name);
  f.String("prompt", &prompt);
  f.Bool("add_special_tokens", &add_special);
  f.Bool("add_generation_prompt", &add_generation_prompt);
  if (f.error) return f.error;
  if (model_name && !model.Matches(*model_name)) {
    HttpError e = Bad("model", absl::StrCat("model '", *model_name, "' is not served here"));
    e.code = "model_not_found";
    return e;
  }
  std::string text;
  if (prompt) {
    text = *prompt;
  } else if (f.Get("messages") != nullptr) {
    std::vector<ChatMessage> messages;
    if (auto e = ParseMessages(j, &messages)) return e;
    absl::StatusOr<std::string> r = chat.Render(messages, add_generation_prompt.value_or(true));
    if (!r.ok()) return Bad("messages", std::string(r.status().message()));
    text = *r;
  } else {
    return Bad("prompt", "prompt (a string) or messages is required");
  }
  const std::vector<int32_t> ids =
      model.tokenizer().Encode(text, add_special.value_or(true), /*parse_special=*/true);
  *out = {{"tokens", ids},
          {"count", static_cast<int64_t>(ids.size())},
          {"max_model_len", model.ctx_size()}};
  return std::nullopt;
}

std::optional<HttpError> Detokenize(std::string_view body, const RouterModel& model, json* out) {
  json j;
  if (auto e = ParseBody(body, &j)) return e;
  Fields f(j);
  std::optional<std::string> model_name;
  f.String("model", &model_name);
  if (f.error) return f.error;
  if (model_name && !model.Matches(*model_name)) {
    HttpError e = Bad("model", absl::StrCat("model '", *model_name, "' is not served here"));
    e.code = "model_not_found";
    return e;
  }
  const json* tokens = f.Get("tokens");
  if (tokens == nullptr || !tokens->is_array()) {
    return Bad("tokens", "tokens (an array of token ids) is required");
  }
  std::vector<int32_t> ids;
  for (size_t i = 0; i < tokens->size(); ++i) {
    const json& t = (*tokens)[i];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= model.vocab_size()) {
      return Bad("tokens", absl::StrCat("tokens[", i, "] must be a token id in [0, ",
                                        model.vocab_size(), ")"));
    }
    ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  *out = {{"prompt", model.tokenizer().Decode(ids, /*special=*/true)}};
  return std::nullopt;
}

}  // namespace tandem::router
