// SLO-aware admission at the router: predicting a request's time to first token (TTFT).
//
// What the router knows, per worker of the pool that prefills (prefill workers, or colocated
// ones): the prefill work it has sent the worker and not yet seen finish (backlog: requests
// and their prompt tokens, WorkerRegistry::Loads), and the worker's step cost, fitted online
// from its own engine steps and sent with its heartbeats (v1::StepCost). A prefill of n tokens
// costs about intercept_s + n * prefill_token_s on a worker; a pool works through its backlog
// in parallel. Waiting in the router's admission queue ahead of a request are the prompts of
// its own and more urgent classes (Admission::tokens_ahead). So
//
//   predicted TTFT = (sum of the workers' backlog cost + cost of the queue ahead) / workers
//                    + cost of the request's own prefill + overhead
//
// where `overhead` (KV transfer, the first decode step, RPCs) is learned from measured TTFTs:
// an exponentially weighted mean of measured minus predicted, never below zero.
//
// The router refuses at once (RESOURCE_EXHAUSTED, with retry-after) a request whose target is
// below its prediction, rather than letting it wait to miss; and with a backlog bound
// (RouterOptions::max_prefill_backlog) it keeps requests in its priority queue while the
// least-loaded worker's backlog is over the bound, so the most urgent class goes first.
// Workers that have not fitted their cost yet (fewer than kMinFittedSteps steps) are left out;
// with none fitted there is no prediction and nothing is refused.
//
// Prefix-cache hits shorten prefills; the prediction does not count them, so it errs long.
//
// Threading: the functions are pure; SloTracker is thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "services/router/worker_registry.h"

namespace tandem::router {

inline constexpr uint64_t kMinFittedSteps = 8;

struct TtftPrediction {
  bool known = false;      // some worker of the pool has a fitted cost
  double seconds = 0;      // predicted TTFT, overhead included
  double backlog_s = 0;    // of that, the workers' backlog and the queue ahead
  double own_s = 0;        // the request's own prefill
};

// `ahead_tokens` prompt tokens of `ahead_requests` requests wait ahead of this one at the router.
TtftPrediction PredictTtft(const std::vector<WorkerRegistry::Load>& pool, int64_t ahead_tokens,
                           int ahead_requests, int64_t tokens, double overhead_s);

// The smallest backlog, in predicted seconds, of the fitted workers of `pool`; 0 when none is
// fitted (nothing to hold requests back for).
double LeastBacklogSeconds(const std::vector<WorkerRegistry::Load>& pool);

// Learns the overhead from each request's predicted and measured TTFT.
class SloTracker {
 public:
  double overhead_s() const;
  // `predicted` without the overhead; `measured` from arrival to the first token.
  void Observe(double predicted_s, double measured_s);

 private:
  static constexpr double kWeight = 0.05;  // of each new observation
  static constexpr double kMaxOverheadS = 1.0;
  mutable absl::Mutex mu_;
  double overhead_s_ ABSL_GUARDED_BY(mu_) = 0;
  bool seen_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tandem::router
