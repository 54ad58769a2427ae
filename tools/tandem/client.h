// `tandem client`: one streaming Generate against a router, printed like `tandem generate`.
//
// Plain output: the prompt, then the completion as its text arrives, then a newline on stdout;
// a one-line summary (tokens, TTFT, inter-token latency, workers) on stderr. With --json, one
// object with generate's fields (prompt, prompt_tokens, tokens, text, finish_reason, timings)
// plus what only a cluster knows (request id, workers, the server's TTFT breakdown).
//
// Threading: single-threaded. Errors: the router's gRPC status, converted (INVALID_ARGUMENT for
// a bad request, UNAVAILABLE when the router or its workers cannot be reached).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "engine/sampling/sampler.h"

namespace tandem::tools {

struct ClientOptions {
  std::string router;  // host:port
  std::string prompt;
  std::string model;                // empty: the cluster's model
  std::string request_id;           // empty: the router makes one
  std::string priority;             // interactive, standard or batch; empty: unset (standard)
  std::string session;              // conversation id (GenerateRequest.session_id); empty: none
  uint32_t ttft_target_ms = 0;      // the request's SLO targets (0: none)
  uint32_t tpot_target_ms = 0;
  engine::SamplingParams sampling;  // every field is sent, so defaults match generate's
  int64_t timeout_ms = 600000;      // the call's deadline; 0: none
  bool json = false;
  std::string api_key;  // sent as `authorization: Bearer KEY` when not empty
};

absl::Status RunClient(const ClientOptions& o);

}  // namespace tandem::tools
