// The P:D planner: how many prefill and decode workers (or colocated ones) a workload needs to
// meet its SLOs, found by running the cluster simulator (services/router/sim.h) on candidate
// clusters, from the fewest workers the step costs allow upwards.
//
// A candidate meets the SLOs when at least `attainment` of its requests finish with TTFT and
// TPOT within their targets (no failures count as met). The smallest total that meets them is
// found by steps of 1, 2, 4, ... from the lower bound and then bisection (more workers are
// assumed never to do worse); at each total the splits within 2 of the lower bounds' own split
// are simulated, and the one with the most requests within their targets wins (then the lower
// p99 TTFT). The colocated answer is the smallest count that meets them, found the same way. The
// lower bound comes from the costs: a prefill worker computes at most max_batch_tokens prompt
// tokens per step of that many, a decode worker at most max_seqs tokens per step of max_seqs
// sequences, and a colocated worker shares one step between both.
//
// Threading: pure (deterministic for a seed); call from any thread. Errors: INVALID_ARGUMENT for
// a bad workload or SLO, FAILED_PRECONDITION when nothing up to max_workers meets the SLOs
// (the message names the best candidate tried and its attainment).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "services/router/sim.h"
#include "services/router/worker_registry.h"

namespace tandem::router::plan {

// Lengths drawn in proportion to their weights.
struct Histogram {
  std::vector<std::pair<int32_t, double>> bins;  // (length, weight)
};
// "512" or "128:3,1024:1"; INVALID_ARGUMENT otherwise.
absl::StatusOr<Histogram> ParseHistogram(const std::string& spec);

struct Workload {
  double rate = 0;  // requests/s, Poisson
  Histogram input, output;
  double prefix_hit = 0;  // fraction of prompt tokens found in the prefix cache, [0, 1)
};

struct Slo {
  double ttft_s = 0;  // 0: no target
  double tpot_s = 0;
};

struct Options {
  sim::Costs costs;
  sim::Topology shape;  // per-worker settings; the counts are the planner's to choose
  sim::RouterConfig router;
  int max_workers = 64;
  double attainment = 0.99;  // fraction of requests within both targets
  int sim_requests = 2000;   // per candidate: 30 s of arrivals, within [this, 4 * this]
  uint64_t seed = 1;
  bool colocated = true;  // also plan the colocated alternative
};

struct Prediction {
  int prefill = 0, decode = 0, colocated = 0;
  bool meets = false;
  double attained = 0;  // fraction of requests within both targets
  double goodput = 0;   // requests/s within both targets
  double ttft_p50_s = 0, ttft_p99_s = 0, tpot_p50_s = 0, tpot_p99_s = 0;
  int workers() const { return prefill + decode + colocated; }
};

struct Answer {
  Prediction disaggregated;  // workers() == 0 when none met the SLOs
  Prediction colocated;
  bool prefer_colocated = false;  // met with no more workers (and more goodput on a tie)
  int simulations = 0;
};

// The predicted latencies and goodput of one cluster under the workload.
absl::StatusOr<Prediction> Evaluate(const Workload& w, const Slo& slo, const Options& o,
                                    int prefill, int decode, int colocated);

absl::StatusOr<Answer> Plan(const Workload& w, const Slo& slo, const Options& o);

// The workload a router observed: each finished request's prompt and output length, over
// `span_s` seconds of arrivals (Poisson at their mean rate; each length histogram kept to at most
// 32 bins of equal weight, at evenly spaced ranks). INVALID_ARGUMENT for no requests, lengths of
// different counts or span_s <= 0.
absl::StatusOr<Workload> ObservedWorkload(std::vector<double> prompt_tokens,
                                          std::vector<double> output_tokens, double span_s);

// The mean step cost of a pool's workers that have fitted one (heartbeats' v1::StepCost, at
// least kMinFittedSteps steps), a negative intercept counted as 0; nullopt while none has. A
// prefill worker's fit must price prompt tokens, a decode worker's its sequences or their KV.
std::optional<sim::StepCoefficients> MeanFittedCost(const std::vector<WorkerRegistry::Load>& pool,
                                                    bool prefill);

}  // namespace tandem::router::plan
