// The OpenAI-compatible API's translation layer, without any networking: JSON request bodies
// into tandem.v1.GenerateRequest, tandem.v1 responses into OpenAI's JSON objects and SSE
// chunks, and status codes into OpenAI-shaped errors. http_server.h does the HTTP part.
//
// Supported: POST /v1/completions and /v1/chat/completions with model, prompt / messages,
// max_tokens (chat: also max_completion_tokens; default 16 for completions and "what the
// context leaves" for chat), temperature, top_p, seed (absent: a random one, as OpenAI samples
// differently each time), stop (string or list), n (1 only), presence_penalty,
// frequency_penalty, stream, stream_options.include_usage, and vLLM's extras top_k, min_p,
// repetition_penalty, ignore_eos, stop_token_ids and (chat) add_generation_prompt. Options that
// would change the output shape and are not implemented (n > 1, best_of > 1, echo, logprobs,
// suffix, logit_bias, tools, a non-text response_format) are refused with 400 rather than
// ignored. Unknown fields are ignored, as OpenAI's clients send extras (user, metadata).
// POST /tokenize and /detokenize follow vLLM's shapes.
//
// Threading: free functions are pure; an SseEncoder belongs to one response.
// Errors: parse functions return an HttpError (status 400, naming the param) instead of
// throwing; nothing here throws.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "services/router/chat_template.h"
#include "services/router/router_model.h"
#include "tandem/v1/inference.pb.h"

namespace tandem::router {

// An error as OpenAI returns it: {"error": {"message", "type", "param", "code"}}.
struct HttpError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty: null
  std::string code;   // empty: null
};

nlohmann::json ErrorJson(const HttpError& e);

enum class ApiKind { kCompletion, kChat };

// A status from the Generate path as an HTTP error: INVALID_ARGUMENT 400 (param derived from
// the field the message names), NOT_FOUND (another model) 400 model_not_found,
// RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, CANCELLED 499, others 500.
HttpError ErrorFromStatus(const absl::Status& st, ApiKind kind);

// A parsed completion or chat request.
struct OpenAiRequest {
  ApiKind kind = ApiKind::kCompletion;
  v1::GenerateRequest generate;  // what goes to the router's Generate
  bool stream = false;
  bool include_usage = false;
  std::string model;    // echoed in responses: the request's name, or the served id
  std::string id;       // cmpl-... / chatcmpl-..., also the router request id
  int64_t created = 0;  // unix seconds
};

// Parses and validates `body`. The model must be the served one (else 400 model_not_found);
// chat messages are rendered with `chat`. Value ranges the engine checks (temperature >= 0,
// top_p in (0, 1], context length) are left to the router, which names the field.
std::optional<HttpError> ParseOpenAiRequest(ApiKind kind, std::string_view body,
                                            const RouterModel& model, const ChatTemplate& chat,
                                            OpenAiRequest* out);

// What a finished Generate stream added up to.
struct Accumulated {
  std::string text;
  int32_t completion_tokens = 0;
  int32_t prompt_tokens = 0;
  bool finished = false;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  void Add(const v1::GenerateResponse& m);
};

const char* OpenAiFinishReason(v1::FinishReason r);  // "stop" or "length"

// The non-streaming response object (text_completion or chat.completion).
nlohmann::json CompletionJson(const OpenAiRequest& r, const Accumulated& a);

// Server-sent events for one streaming response, each returned string a whole number of
// `data: ...\n\n` events.
class SseEncoder {
 public:
  explicit SseEncoder(const OpenAiRequest& r) : r_(r) {}
  std::string Open();                        // chat: the assistant-role chunk; completions: ""
  std::string Delta(std::string_view text);  // "" for empty text
  // The finish chunk, the usage chunk when include_usage, then [DONE].
  std::string Finish(const Accumulated& a);
  // An error after the stream started (the status line is long gone), then [DONE].
  std::string Error(const HttpError& e);

 private:
  nlohmann::json Chunk() const;
  std::string Event(const nlohmann::json& j) const;
  const OpenAiRequest& r_;
};

// JSON text as responses carry it (invalid UTF-8 replaced, never thrown on).
std::string DumpJson(const nlohmann::json& j);

// GET /v1/models and /v1/models/{id}.
nlohmann::json ModelsJson(const RouterModel& model, int64_t created);
nlohmann::json ModelJson(const RouterModel& model, int64_t created);

// POST /tokenize: {"prompt": str, "add_special_tokens": bool = true} or {"messages": [...],
// "add_generation_prompt": bool = true} -> {"tokens", "count", "max_model_len"}.
std::optional<HttpError> Tokenize(std::string_view body, const RouterModel& model,
                                  const ChatTemplate& chat, nlohmann::json* out);
// POST /detokenize: {"tokens": [...]} -> {"prompt": str}; special tokens are rendered.
std::optional<HttpError> Detokenize(std::string_view body, const RouterModel& model,
                                    nlohmann::json* out);

}  // namespace tandem::router
