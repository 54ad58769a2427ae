// The OpenAI-compatible API's translation layer, without any networking: JSON request bodies
// into tandem.v1.GenerateRequest, tandem.v1 responses into OpenAI's JSON objects and SSE
// chunks, and status codes into OpenAI-shaped errors. http_server.h does the HTTP part.
//
// Supported: POST /v1/completions and /v1/chat/completions with model, prompt / messages,
// max_tokens (chat: also max_completion_tokens; default 16 for completions and "what the
// context leaves" for chat), temperature, top_p, seed (absent: a random one, as OpenAI samples
// differently each time), stop (string or list), presence_penalty, frequency_penalty, n (up to
// kMaxChoices; best_of only equal to n), echo (completions), stream,
// stream_options.include_usage, logprobs (chat: with top_logprobs; the model's raw
// distribution, up to 20 alternatives), response_format (text, json_object, json_schema;
// engine/sampling/json_schema.h), and vLLM's extras top_k, min_p, repetition_penalty,
// ignore_eos, stop_token_ids and (chat) add_generation_prompt. Options that would change the
// output shape and are not implemented (best_of other than n, echo with logprobs, suffix,
// logit_bias) are refused with 400 rather than ignored. Chat takes tools and tool_choice (none,
// auto, required, or a named function), answering with tool_calls.
// Unknown fields are ignored, as OpenAI's clients send extras (user, metadata).
// POST /tokenize and /detokenize follow vLLM's shapes.
//
// Threading: free functions are pure; an SseEncoder belongs to one choice of one response.
// Errors: parse functions return an HttpError (status 400, naming the param) instead of
// throwing; nothing here throws.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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

nlohmann::ordered_json ErrorJson(const HttpError& e);

enum class ApiKind { kCompletion, kChat };

// A status from the Generate path as an HTTP error: INVALID_ARGUMENT 400 (param derived from
// the field the message names), NOT_FOUND (another model) 400 model_not_found,
// RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, CANCELLED 499, others 500.
HttpError ErrorFromStatus(const absl::Status& st, ApiKind kind);

// How a chat request with tools may use them (tool_choice): kNone also when it has none.
enum class ToolChoice { kNone, kAuto, kRequired, kNamed };

// The most tools one chat request may offer.
inline constexpr size_t kMaxTools = 128;
// The deepest a request body may nest objects and arrays (a JSON Schema included).
inline constexpr int kMaxJsonNesting = 64;

// A parsed completion or chat request.
struct OpenAiRequest {
  ApiKind kind = ApiKind::kCompletion;
  v1::GenerateRequest generate;  // what goes to the router's Generate
  bool stream = false;
  bool include_usage = false;
  std::string model;    // echoed in responses: the request's name, or the served id
  std::string id;       // cmpl-... / chatcmpl-..., also the router request id
  int64_t created = 0;  // unix seconds
  // logprobs (chat: logprobs true, with top_logprobs alternatives; completions: the number of
  // alternatives): -1 off, else the alternatives per token. The tokenizer spells the tokens.
  int32_t logprobs = -1;
  const engine::Tokenizer* tokenizer = nullptr;
  // Chat with tools: their names, and how they may be used. kRequired and kNamed constrain
  // the output to one call's JSON ({"name", "arguments"}, each tool's parameters schema);
  // kAuto leaves the model free and finds <tool_call> blocks in what it writes.
  std::vector<std::string> tool_names;
  ToolChoice tool_choice = ToolChoice::kNone;
  int32_t n = 1;           // choices, each its own Generate call (ChoiceRequest)
  bool echo = false;       // completions: the prompt's text before each choice's text
  std::string echo_text;
};

// The most choices one request may ask for (n).
inline constexpr int32_t kMaxChoices = 16;

// The Generate call of choice `index`: choice 0 is r.generate; a later one has its own request
// id (the response id, "-", the index) and seed (r's plus the index), so seeded choices differ
// from one another and stay reproducible.
v1::GenerateRequest ChoiceRequest(const OpenAiRequest& r, int32_t index);

// Parses and validates `body`. The model must be the served one (else 400 model_not_found);
// chat messages are rendered with `chat`. Value ranges the engine checks (temperature >= 0,
// top_p in (0, 1], context length) are left to the router, which names the field.
std::optional<HttpError> ParseOpenAiRequest(ApiKind kind, std::string_view body,
                                            const RouterModel& model, const ChatTemplate& chat,
                                            OpenAiRequest* out);

// How deep JSON text nests objects and arrays (a linear scan, run before parsing text that
// might be hostile).
int NestingOf(std::string_view text);

// A chat request's tools and tool_choice in OpenAI's JSON shape ({"tools": [...],
// "tool_choice": ...}; what the gRPC Chat rpc's fields become), taken as ParseOpenAiRequest
// takes them: sets r's tool names and choice, *specs to the tools as the chat template lists
// them, and for "required" or a named tool the output constraint in *s.
std::optional<HttpError> ParseChatTools(const nlohmann::ordered_json& body, OpenAiRequest* r,
                                        std::vector<std::string>* specs, v1::SamplingParams* s);

// What a finished Generate stream added up to.
struct Accumulated {
  std::string text;
  int32_t completion_tokens = 0;
  int32_t prompt_tokens = 0;
  bool finished = false;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  // With logprobs asked for: each generated token and its log-probabilities.
  std::vector<int32_t> logprob_ids;
  std::vector<v1::TokenLogprobs> logprobs;
  void Add(const v1::GenerateResponse& m);
};

const char* OpenAiFinishReason(v1::FinishReason r);  // "stop" or "length"

// A chat answer to a request that offered tools: the calls it makes, and its other text (with
// the call blocks removed; empty when there is none).
struct ToolCallOutput {
  std::vector<ToolCall> calls;
  std::string content;
};
ToolCallOutput ParseToolCalls(const OpenAiRequest& r, const std::string& text);

// The non-streaming response object (text_completion or chat.completion), one choice per
// element of `choices`; usage counts the prompt once and every choice's tokens.
nlohmann::ordered_json CompletionJson(const OpenAiRequest& r, std::span<const Accumulated> choices);
inline nlohmann::ordered_json CompletionJson(const OpenAiRequest& r, const Accumulated& a) {
  return CompletionJson(r, std::span<const Accumulated>(&a, 1));
}

// Server-sent events for one choice of a streaming response, each returned string a whole
// number of `data: ...\n\n` events.
class SseEncoder {
 public:
  explicit SseEncoder(const OpenAiRequest& r, int32_t index = 0) : r_(r), index_(index) {}
  // Chat: the assistant-role chunk; completions: the echoed prompt, or "".
  std::string Open();
  // The message's text and, when asked for, its tokens' log-probabilities; "" while the text
  // is empty (held back for a possible stop string), the log-probabilities then waiting for
  // the next chunk.
  std::string Delta(const v1::GenerateResponse& m);
  // This choice's finish chunk (with log-probabilities still waiting).
  std::string Finish(const Accumulated& a);
  // The end of the whole response: the usage chunk when include_usage, then [DONE].
  std::string Done(std::span<const Accumulated> choices);
  // An error after the stream started (the status line is long gone), then [DONE].
  std::string Error(const HttpError& e);

 private:
  nlohmann::ordered_json Chunk() const;
  std::string Event(const nlohmann::ordered_json& j) const;
  // Sets choice["logprobs"] from the waiting tokens (when asked for), and empties them.
  void TakeLogprobs(nlohmann::ordered_json& choice);
  const OpenAiRequest& r_;
  const int32_t index_;
  // Chat with tools: text held back while it may be (or is) a tool call, and the content sent.
  std::string held_;
  std::string sent_;
  std::vector<int32_t> ids_;  // tokens whose log-probabilities are not sent yet
  std::vector<v1::TokenLogprobs> logprobs_;
  int64_t text_offset_ = 0;  // completions: where the next token's text starts
};

// JSON text as responses carry it (invalid UTF-8 replaced, never thrown on).
std::string DumpJson(const nlohmann::ordered_json& j);

// GET /v1/models and /v1/models/{id}.
nlohmann::ordered_json ModelsJson(const RouterModel& model, int64_t created);
nlohmann::ordered_json ModelJson(const RouterModel& model, int64_t created);

// POST /tokenize: {"prompt": str, "add_special_tokens": bool = true} or {"messages": [...],
// "add_generation_prompt": bool = true} -> {"tokens", "count", "max_model_len"}.
std::optional<HttpError> Tokenize(std::string_view body, const RouterModel& model,
                                  const ChatTemplate& chat, nlohmann::ordered_json* out);
// POST /detokenize: {"tokens": [...]} -> {"prompt": str}; special tokens are rendered.
std::optional<HttpError> Detokenize(std::string_view body, const RouterModel& model,
                                    nlohmann::ordered_json* out);

}  // namespace tandem::router
