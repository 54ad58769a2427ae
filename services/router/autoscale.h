// Replica recommendations for the prefill and decode pools, from what the router observes.
//
// The rule (docs/cluster.md, "Autoscaling signal", has the reasoning): for each role,
//   replicas = clamp(ceil(max(throughput_term, latency_term)), min_replicas, max_replicas)
//   prefill: throughput_term = prompt_tokens_per_s / (prefill_capacity_tps * target_utilization)
//            latency_term    = current_prefill * p90_ttft / slo_ttft
//   decode:  throughput_term = output_tokens_per_s / (decode_capacity_tps * target_utilization)
//            latency_term    = current_decode * p90_itl / slo_itl
// A term whose inputs are unknown (no capacity, no samples, no SLO) is left out; with neither
// term the recommendation is the current count (at least min_replicas). Colocated workers count
// in both pools.
//
// SampleWindow keeps timestamped observations for a sliding time window so the router can feed
// the rule with recent rates and percentiles.
//
// Threading: Recommend and Percentile are pure functions. SampleWindow is not thread-safe; its
// owner locks. Errors: none (bad inputs such as negative rates count as unknown).
#pragma once

#include <cstddef>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace tandem::router {

struct AutoscaleOptions {
  double slo_ttft_s = 0;            // 0: no TTFT target (prefill latency term off)
  double slo_itl_s = 0;             // 0: no ITL target (decode latency term off)
  double prefill_capacity_tps = 0;  // prompt tokens/s one prefill worker sustains; 0: measured
  double decode_capacity_tps = 0;   // output tokens/s one decode worker sustains; 0: unknown
  double target_utilization = 0.8;  // headroom kept by the throughput term, in (0, 1]
  int min_replicas = 1;
  int max_replicas = 64;
  absl::Duration window = absl::Seconds(60);  // how far back observations count
};

struct AutoscaleInputs {
  int current_prefill = 0;
  int current_decode = 0;
  double p90_ttft_s = -1;           // < 0: no samples
  double p90_itl_s = -1;            // < 0: no samples
  double prompt_tokens_per_s = 0;   // arriving load
  double output_tokens_per_s = 0;   // generated load
  double prefill_capacity_tps = 0;  // per worker; <= 0: unknown
  double decode_capacity_tps = 0;   // per worker; <= 0: unknown
};

struct Recommendation {
  int prefill = 0;
  int decode = 0;
  bool planned = false;  // tandem plan's search gave it (router_metrics.h), not the rule above
};

Recommendation Recommend(const AutoscaleInputs& in, const AutoscaleOptions& o);

// The q-quantile (q in [0, 1]) by the nearest-rank method: the smallest value with at least
// q * n values at or below it. -1 for no values. Sorts `v`.
double Percentile(std::vector<double>& v, double q);

// Timestamped values within a sliding window, capped at max_samples (oldest dropped first).
class SampleWindow {
 public:
  explicit SampleWindow(absl::Duration window, size_t max_samples = 20000)
      : window_(window), max_samples_(max_samples) {}
  void Add(absl::Time t, double value);
  // Drops values older than now - window.
  void Expire(absl::Time now);
  // Values still in the window (call Expire first).
  std::vector<double> Values() const;
  double Sum() const;
  size_t size() const { return samples_.size(); }

 private:
  absl::Duration window_;
  size_t max_samples_;
  std::deque<std::pair<absl::Time, double>> samples_;
};

}  // namespace tandem::router
