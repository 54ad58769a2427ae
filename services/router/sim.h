// A discrete-event simulation of a tandem cluster: the router's real worker selection
// (WorkerRegistry, fed by simulated heartbeats on a simulated clock) in front of simulated
// prefill, decode and colocated workers whose engine steps take what a fitted step cost model
// (v1::StepCost, engine/runtime/step_cost.h) says. One thread, no thread per worker: a heap of
// timed events (arrivals, step ends, KV arrivals, heartbeats).
//
// What each simulated worker does is what the real one does, step by step:
// - prefill (services/prefill/prefill_worker.h): requests queue in arrival order; up to
//   max_seqs are admitted; every step packs chunks of the admitted prompts in order into
//   max_batch_tokens; a prompt whose last chunk ran is done, its KV reaches the decode worker
//   after the part of the transfer compute did not hide (transfer_s_per_token per prompt token);
// - decode (services/decode/decode_worker.h over engine::Scheduler): the router reserves the
//   sequence's blocks (prompt + output) before the prefill; a worker without the blocks refuses
//   and the router tries the next, as the real one does; an arrived sequence is taken in
//   between steps (the engine thread's inbox), reports its first token then, joins the batch
//   when fewer than max_seqs run, and every step decodes one token of each running sequence;
// - colocated (engine::Scheduler): admission when max_seqs and the blocks allow, then each step
//   packs one decode token per decoding sequence first and fills the budget with prefill chunks.
// A step of p prefill tokens, d decode sequences attending to k positions in all takes
// intercept + p * prefill_token + d * decode_seq + k * decode_kv_token seconds.
// The router admits up to max_inflight requests and queues up to max_queue more, most urgent
// class first (as Admission does; a full queue displaces its newest less urgent waiter), and
// each admitted request waits dispatch_s (its RPCs) before reaching the worker's queue.
//
// Prefix caching is what each request says it hits (Request::cached_tokens, never the last
// prompt token): those tokens are not computed. Not simulated: speculative decoding,
// migrations and faults, SLO admission (targets are not acted on), and step-time noise.
//
// Threading: Simulate is a pure function of its arguments (deterministic); call it from any
// thread. Errors: INVALID_ARGUMENT for a configuration the real cluster would refuse.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "services/router/worker_registry.h"

namespace tandem::router::sim {

// A worker's step cost: seconds = intercept + prefill_token * p + decode_seq * d +
// decode_kv_token * k (the coefficients of v1::StepCost).
struct StepCoefficients {
  double intercept_s = 0;
  double prefill_token_s = 0;
  double decode_seq_s = 0;
  double decode_kv_token_s = 0;
  double Seconds(int64_t prefill_tokens, int64_t decode_seqs, int64_t decode_kv_tokens) const;
};

struct Costs {
  StepCoefficients prefill, decode, colocated;
  double dispatch_s = 0;            // router to worker queue (RPCs), per request
  double transfer_s_per_token = 0;  // KV transfer after the prefill's last step, per prompt token
  // A prefill worker's engine thread per finished prompt, outside its steps (checksumming the
  // prompt's KV, posting its last writes, answering): the next step waits for it.
  double prefill_request_s = 0;
};

struct Topology {
  int prefill = 0;
  int decode = 0;
  int colocated = 0;  // used only when prefill or decode is 0, as the router does
  int max_batch_tokens = 512;
  int max_seqs = 8;
  int block_size = 16;
  int ctx_size = 4096;
  int64_t kv_blocks = 0;  // per worker; 0: enough for max_seqs full contexts
};

struct RouterConfig {
  Policy policy = Policy::kLeastLoad;
  int max_inflight = 256;
  int max_queue = 1024;
  double heartbeat_s = 1.0;
};

struct Request {
  double arrival_s = 0;
  int32_t prompt_tokens = 0;
  int32_t output_tokens = 0;  // >= 1; the first comes from the prefill
  int priority = 1;           // 0 interactive, 1 standard, 2 batch
  int32_t cached_tokens = 0;  // prompt tokens found in a prefix cache: not computed
};

struct Result {
  bool ok = false;
  int status_code = 0;  // gRPC code when !ok (8: RESOURCE_EXHAUSTED)
  std::string error;
  double ttft_s = 0;  // from arrival
  double e2e_s = 0;
  std::vector<double> itl_s;  // gaps between tokens, when Options::keep_itl
};

struct Options {
  Topology topology;
  Costs costs;
  RouterConfig router;
  bool keep_itl = true;  // off for very large runs: they keep TTFT and E2E only
};

struct Stats {
  int64_t events = 0;
  int64_t steps = 0;
  double end_s = 0;  // simulated time of the last event
};

absl::StatusOr<std::vector<Result>> Simulate(const Options& o, std::span<const Request> requests,
                                             Stats* stats = nullptr);

}  // namespace tandem::router::sim
