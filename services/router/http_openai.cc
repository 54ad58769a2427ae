#include "services/router/http_openai.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "services/common/sampling_convert.h"

namespace tandem::router {
namespace {

using nlohmann::json;

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
std::optional<HttpError> RefuseUnsupported(Fields& f, ApiKind kind) {
  std::optional<int64_t> n, best_of;
  f.Int("n", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), &n);
  f.Int("best_of", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
        &best_of);
  if (f.error) return f.error;
  if (n && *n != 1)
    return Bad("n", absl::StrCat("n must be 1 (only one choice per request is "
                                 "supported), got ",
                                 *n));
  if (best_of && *best_of != 1) {
    return Bad("best_of", absl::StrCat("best_of must be 1, got ", *best_of));
  }
  if (const json* v = f.Get("echo"); v != nullptr && !(v->is_boolean() && !v->get<bool>())) {
    return Bad("echo", "echo is not supported");
  }
  if (const json* v = f.Get("logprobs"); v != nullptr && !(v->is_boolean() && !v->get<bool>()) &&
                                         !(v->is_number_integer() && v->get<int64_t>() == 0)) {
    return Bad("logprobs", "logprobs is not supported");
  }
  if (const json* v = f.Get("top_logprobs"); v != nullptr && !(v->is_number() && *v == 0)) {
    return Bad("top_logprobs", "top_logprobs is not supported");
  }
  if (const json* v = f.Get("suffix"); v != nullptr && !(v->is_string() && v->empty())) {
    return Bad("suffix", "suffix is not supported");
  }
  if (const json* v = f.Get("logit_bias"); v != nullptr && !(v->is_object() && v->empty())) {
    return Bad("logit_bias", "logit_bias is not supported");
  }
  if (kind == ApiKind::kChat) {
    if (const json* v = f.Get("tools"); v != nullptr && !(v->is_array() && v->empty())) {
      return Bad("tools", "tools are not supported");
    }
    if (const json* v = f.Get("response_format"); v != nullptr) {
      auto t = v->is_object() ? v->find("type") : v->end();
      if (!v->is_object() || t == v->end() || *t != "text") {
        return Bad("response_format", "only response_format {\"type\": \"text\"} is supported");
      }
    }
  }
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
    return p;
  }
  if (msg.substr(0, 6) == "prompt") return kind == ApiKind::kChat ? "messages" : "prompt";
  return "";
}

json Usage(const Accumulated& a) {
  return {{"prompt_tokens", a.prompt_tokens},
          {"completion_tokens", a.completion_tokens},
          {"total_tokens", a.prompt_tokens + a.completion_tokens}};
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
  const json j = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("", "the request body is not valid JSON");
  if (!j.is_object()) return Bad("", "the request body must be a JSON object");
  Fields f(j);
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
  if (auto e = RefuseUnsupported(f, kind)) return e;

  v1::GenerateRequest& g = out->generate;
  g.Clear();
  g.set_request_id(out->id);
  g.set_model(model_name.value_or(""));
  std::optional<int64_t> max_tokens;
  if (auto e = ParseSampling(f, kind, g.mutable_sampling(), &max_tokens)) return e;
  // Extension field: the request's class at the router's admission queue.
  std::optional<std::string> priority;
  f.String("priority", &priority);
  if (f.error) return f.error;
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
    g.mutable_sampling()->set_max_tokens(static_cast<int32_t>(max_tokens.value_or(16)));
    return std::nullopt;
  }
  std::vector<ChatMessage> messages;
  if (auto e = ParseMessages(j, &messages)) return e;
  absl::StatusOr<std::string> text = chat.Render(messages, add_generation_prompt.value_or(true));
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

json CompletionJson(const OpenAiRequest& r, const Accumulated& a) {
  json choice = {
      {"index", 0}, {"logprobs", nullptr}, {"finish_reason", OpenAiFinishReason(a.finish)}};
  if (r.kind == ApiKind::kChat) {
    choice["message"] = {{"role", "assistant"}, {"content", a.text}};
  } else {
    choice["text"] = a.text;
  }
  return {{"id", r.id},
          {"object", r.kind == ApiKind::kChat ? "chat.completion" : "text_completion"},
          {"created", r.created},
          {"model", r.model},
          {"choices", json::array({choice})},
          {"usage", Usage(a)}};
}

std::string DumpJson(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

json SseEncoder::Chunk() const {
  json c = {{"id", r_.id},
            {"object", r_.kind == ApiKind::kChat ? "chat.completion.chunk" : "text_completion"},
            {"created", r_.created},
            {"model", r_.model}};
  if (r_.include_usage) c["usage"] = nullptr;
  return c;
}

std::string SseEncoder::Event(const json& j) const { return "data: " + DumpJson(j) + "\n\n"; }

std::string SseEncoder::Open() {
  if (r_.kind != ApiKind::kChat) return "";
  json c = Chunk();
  c["choices"] = json::array({{{"index", 0},
                               {"delta", {{"role", "assistant"}, {"content", ""}}},
                               {"logprobs", nullptr},
                               {"finish_reason", nullptr}}});
  return Event(c);
}

std::string SseEncoder::Delta(std::string_view text) {
  if (text.empty()) return "";
  json c = Chunk();
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
  if (r_.kind == ApiKind::kChat) {
    choice["delta"] = {{"content", std::string(text)}};
  } else {
    choice["text"] = std::string(text);
  }
  c["choices"] = json::array({choice});
  return Event(c);
}

std::string SseEncoder::Finish(const Accumulated& a) {
  json c = Chunk();
  json choice = {
      {"index", 0}, {"logprobs", nullptr}, {"finish_reason", OpenAiFinishReason(a.finish)}};
  if (r_.kind == ApiKind::kChat) {
    choice["delta"] = json::object();
  } else {
    choice["text"] = "";
  }
  c["choices"] = json::array({choice});
  std::string out = Event(c);
  if (r_.include_usage) {
    json u = Chunk();
    u["choices"] = json::array();
    u["usage"] = Usage(a);
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
  const json j = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("", "the request body is not valid JSON");
  if (!j.is_object()) return Bad("", "the request body must be a JSON object");
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
  const json j = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("", "the request body is not valid JSON");
  if (!j.is_object()) return Bad("", "the request body must be a JSON object");
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
