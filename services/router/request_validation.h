// Validation of a tandem.v1.GenerateRequest at the router: the one place that says what a
// request may hold. Both front doors go through it (HTTP requests become Generate calls), and
// every refusal is INVALID_ARGUMENT (HTTP 400) with a message that starts with the field's
// path, e.g. "sampling.top_p must be in (0, 1], got 1.5". NOT_FOUND is the one exception: a
// model field naming another model.
//
// The table (vLLM's SamplingParams rules where vLLM has one):
//
//   field                        accepted                          else
//   model                        "", the served id, path or file   NOT_FOUND
//   prompt                       text or token_ids, not empty      "prompt ..."
//   prompt.text                  <= max_prompt_text_bytes bytes     "prompt.text ..."
//   prompt.token_ids[i]          in [0, vocab)                     "prompt.token_ids[i] ..."
//   request_id                   <= max_request_id_bytes bytes     "request_id ..."
//   sampling.temperature         >= 0 (NaN refused)                "sampling.temperature ..."
//   sampling.top_p               in (0, 1]                         "sampling.top_p ..."
//   sampling.top_k               -1 or 0 (off) or >= 1             "sampling.top_k ..."
//   sampling.min_p               in [0, 1]                         "sampling.min_p ..."
//   sampling.presence_penalty    in [-2, 2]                        "sampling.presence_penalty ..."
//   sampling.frequency_penalty   in [-2, 2]                        "sampling.frequency_penalty ..."
//   sampling.repetition_penalty  > 0 and finite                    "sampling.repetition_penalty
//   ..." sampling.penalty_last_n      >= -1                             "sampling.penalty_last_n
//   ..." sampling.max_tokens          >= 1, prompt + it <= context      "sampling.max_tokens ..."
//   sampling.stop                <= max_stop_strings entries, each non-empty and
//                                <= max_stop_string_bytes bytes     "sampling.stop ..."
//   sampling.stop_token_ids      <= max_stop_token_ids, in vocab   "sampling.stop_token_ids ..."
//   the prompt's tokens          < context size                    "prompt has N tokens ..."
//
// Sizes beyond these never reach here: the router's gRPC server refuses messages over
// RouterOptions::max_message_bytes (RESOURCE_EXHAUSTED) and its HTTP server bodies over
// HttpServerOptions' limit (413).
//
// Threading: pure functions, thread-safe. Errors: as above.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/sampling/sampler.h"
#include "services/router/router_model.h"
#include "tandem/v1/inference.pb.h"

namespace tandem::router {

struct RequestLimits {
  int max_stop_strings = 16;        // vLLM has no cap; OpenAI allows 4
  int max_stop_string_bytes = 256;  // a stop string is held back while it may still match
  int max_stop_token_ids = 256;
  int max_request_id_bytes = 256;  // ids go into logs, metrics and worker tables
  int64_t max_prompt_text_bytes = 8 << 20;
};

// Checks `req` against `model` and the table above; on success fills the prompt's token ids
// (text tokenised with add_special and parse_special, as `tandem generate` does) and the engine
// sampling parameters (unset fields at their defaults).
absl::Status ValidateGenerateRequest(const v1::GenerateRequest& req, const RouterModel& model,
                                     const RequestLimits& limits, std::vector<int32_t>* prompt,
                                     engine::SamplingParams* sampling);

}  // namespace tandem::router
