// Statistics of a `tandem bench` run: per-request latencies in, the vLLM-style summary out.
//
// Definitions (as vLLM's benchmark_serving uses them):
//   TTFT  = time from sending the request to the first token;
//   E2E   = time from sending the request to the end of its stream;
//   TPOT  = (E2E - TTFT) / (output_tokens - 1), per request with more than one output token;
//   ITL   = every gap between consecutive token-carrying stream messages, pooled over requests;
//   goodput = successful requests that meet every SLO given, per second of the run (a request
//             with one output token has TPOT 0 for this purpose);
//   percentiles interpolate linearly between closest ranks (numpy's default).
// Latencies go in seconds and come out in milliseconds.
//
// Threading: pure functions. Errors: ParseSlo returns INVALID_ARGUMENT naming the bad part.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::tools::bench {

struct RequestResult {
  bool ok = false;
  std::string error;   // when !ok
  int status_code = 0;  // the gRPC status code (8: RESOURCE_EXHAUSTED, a refusal)
  double start_s = 0;  // when it was sent, from the start of the run
  double ttft_s = 0;   // 0 when no token arrived
  double e2e_s = 0;
  int prompt_tokens = 0;
  int output_tokens = 0;
  std::vector<double> itl_s;  // gaps between token-carrying messages
  // The router's TTFT breakdown from the final message (seconds), when it sent one.
  double server_queue_s = 0, server_prefill_s = 0, server_kv_transfer_s = 0,
         server_onboarding_s = 0, server_first_decode_s = 0;
  // Speculative decoding, from the final message's usage: verify steps, draft tokens checked
  // and those kept (all 0 for a request that did not speculate).
  int spec_verify_steps = 0, spec_draft_tokens = 0, spec_accepted_tokens = 0;
  // Multi-turn: the conversation and turn (-1 otherwise); from the final message's usage, the
  // prompt KV bytes prefill sent and the prompt tokens decode already held.
  int session = -1, turn = 0;
  uint64_t kv_transfer_bytes = 0;
  int decode_held_tokens = 0;
  std::vector<int32_t> output_ids;  // the reply (not reported: the next turn's history)
};

// SLO targets in milliseconds; 0 means no target for that metric.
struct Slo {
  double ttft_ms = 0;
  double tpot_ms = 0;
  double e2e_ms = 0;
  bool any() const { return ttft_ms > 0 || tpot_ms > 0 || e2e_ms > 0; }
};

// "ttft:500,tpot:50" (keys ttft, tpot, e2e or e2el; values in ms, > 0). Empty: no SLO.
absl::StatusOr<Slo> ParseSlo(const std::string& spec);

struct Summary {
  size_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, min = 0, max = 0;
};

// Linear-interpolation percentile, q in [0, 100], of unsorted values; 0 for none.
double PercentileLinear(std::vector<double> values, double q);
Summary Summarize(const std::vector<double>& values);

// TPOT of one request in seconds; < 0 when it has fewer than two output tokens.
double Tpot(const RequestResult& r);
bool MeetsSlo(const RequestResult& r, const Slo& slo);

struct BenchStats {
  size_t completed = 0;
  size_t failed = 0;
  double duration_s = 0;
  int64_t total_input_tokens = 0;
  int64_t total_output_tokens = 0;
  double request_throughput = 0;       // completed requests / s
  double output_token_throughput = 0;  // output tokens / s
  double total_token_throughput = 0;   // (input + output) tokens / s
  double goodput = 0;                  // requests / s meeting every SLO (= throughput w/o SLO)
  size_t good_requests = 0;
  Summary ttft_ms, tpot_ms, itl_ms, e2e_ms;
  // Speculative decoding over the successful requests: verify steps, draft tokens checked and
  // kept; acceptance_rate = accepted / drafted, and mean_accept_length = tokens per verify step
  // (the target's own token included), 0 without speculation.
  int64_t spec_verify_steps = 0, spec_draft_tokens = 0, spec_accepted_tokens = 0;
  double spec_acceptance_rate = 0, spec_mean_accept_length = 0;
  std::vector<double> ttft_values_ms, tpot_values_ms, itl_values_ms, e2e_values_ms;  // sorted
};

// duration_s: wall time of the whole run (first send to last end).
BenchStats ComputeStats(const std::vector<RequestResult>& results, double duration_s,
                        const Slo& slo);

nlohmann::json SummaryJson(const Summary& s);
// The aggregate fields (not the per-value arrays).
nlohmann::json StatsJson(const BenchStats& s);

}  // namespace tandem::tools::bench
