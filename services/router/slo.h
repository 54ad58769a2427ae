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
//                    + cost of the request's own prefill + correction
//
// never less than the request's own prefill. The correction is learned per priority class from
// measured TTFTs: an online estimate of the kCorrectionQuantile (0.9) quantile of measured minus
// predicted, of either sign, so that about 9 in 10 admitted requests come in under their
// prediction and a class's p90 TTFT stays within its target. It takes in what the cost model
// leaves out (KV transfer, the first decode step, RPCs: a positive part), how much a worker's
// batching beats one prefill after another (negative) and the spread of step times.
// Per class, because a class is overtaken by more urgent arrivals it could not have counted:
// batch requests' long waits must not make interactive predictions pessimistic.
//
// The router refuses at once (RESOURCE_EXHAUSTED, with retry-after) a request whose target is
// below its prediction, rather than letting it wait to miss; and with a backlog bound
// (RouterOptions::max_prefill_backlog) it keeps requests in its priority queue while every
// worker's backlog is over the bound, so the most urgent class goes first; a queued request
// leaves once it can no longer make its target.
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
inline constexpr double kCorrectionQuantile = 0.9;

// Whether a worker's fitted step cost (kMinFittedSteps steps or more) prices what its role does:
// prompt tokens for prefill, sequences or their KV for decode.
bool FittedForPrefill(const v1::StepCost& c);
bool FittedForDecode(const v1::StepCost& c);
// The fitted intercept, never below 0 (a least-squares fit can put it there).
double FittedIntercept(const v1::StepCost& c);

struct TtftPrediction {
  bool known = false;      // some worker of the pool has a fitted cost
  double seconds = 0;      // predicted TTFT, correction included
  double backlog_s = 0;    // of that, the workers' backlog and the queue ahead
  double own_s = 0;        // the request's own prefill
};

// `ahead_tokens` prompt tokens of `ahead_requests` requests wait ahead of this one at the router.
TtftPrediction PredictTtft(const std::vector<WorkerRegistry::Load>& pool, int64_t ahead_tokens,
                           int ahead_requests, int64_t tokens, double correction_s);

// A worker's backlog in predicted seconds; 0 when its cost is not fitted (nothing to hold
// requests back for).
double BacklogSeconds(const WorkerRegistry::Load& worker);

// Learns the correction from each request's predicted and measured TTFT: the stochastic
// quantile estimate q += step * (tau - [residual <= q]), its step a tenth of the recent mean
// distance of residuals from q (so it settles at any time scale, GPU or CPU), at least 0.1 ms,
// and larger over the first observations (2/n of it), so it settles within tens of requests.
class SloTracker {
 public:
  double correction_s() const;
  // `predicted` without the correction; `measured` from arrival to the first token.
  void Observe(double predicted_s, double measured_s);

 private:
  static constexpr double kWeight = 0.05;  // of each new observation, in the spread
  static constexpr double kMaxCorrectionS = 1.0;  // either way
  mutable absl::Mutex mu_;
  double correction_s_ ABSL_GUARDED_BY(mu_) = 0;
  double spread_s_ ABSL_GUARDED_BY(mu_) = 0;  // mean |residual - correction|
  uint64_t seen_ ABSL_GUARDED_BY(mu_) = 0;  // observations
};

}  // namespace tandem::router
