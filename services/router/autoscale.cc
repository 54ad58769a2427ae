#include "services/router/autoscale.h"

#include <algorithm>
#include <cmath>

namespace tandem::router {
namespace {

// ceil that forgives floating-point dust: 2.0000000001 replicas is 2, not 3.
int CeilReplicas(double x) { return static_cast<int>(std::ceil(x - 1e-9)); }

int OneRole(int current, double load, double capacity, double p90, double slo,
            const AutoscaleOptions& o) {
  double need = -1;
  const double util =
      o.target_utilization > 0 && o.target_utilization <= 1 ? o.target_utilization : 1.0;
  if (capacity > 0 && load >= 0) need = std::max(need, load / (capacity * util));
  if (slo > 0 && p90 >= 0 && current > 0) need = std::max(need, current * p90 / slo);
  const int n = need < 0 ? current : CeilReplicas(need);
  return std::clamp(n, o.min_replicas, std::max(o.min_replicas, o.max_replicas));
}

}  // namespace

Recommendation Recommend(const AutoscaleInputs& in, const AutoscaleOptions& o) {
  Recommendation r;
  r.prefill = OneRole(in.current_prefill, in.prompt_tokens_per_s, in.prefill_capacity_tps,
                      in.p90_ttft_s, o.slo_ttft_s, o);
  r.decode = OneRole(in.current_decode, in.output_tokens_per_s, in.decode_capacity_tps,
                     in.p90_itl_s, o.slo_itl_s, o);
  return r;
}

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  q = std::clamp(q, 0.0, 1.0);
  const double rank = std::ceil(q * static_cast<double>(v.size()) - 1e-9);
  const size_t i = rank < 1 ? 0 : static_cast<size_t>(rank) - 1;
  return v[std::min(i, v.size() - 1)];
}

void SampleWindow::Add(absl::Time t, double value) {
  samples_.emplace_back(t, value);
  while (samples_.size() > max_samples_) samples_.pop_front();
}

void SampleWindow::Expire(absl::Time now) {
  const absl::Time cutoff = now - window_;
  while (!samples_.empty() && samples_.front().first < cutoff) samples_.pop_front();
}

std::vector<double> SampleWindow::Values() const {
  std::vector<double> out;
  out.reserve(samples_.size());
  for (const auto& s : samples_) out.push_back(s.second);
  return out;
}

double SampleWindow::Sum() const {
  double s = 0;
  for (const auto& x : samples_) s += x.second;
  return s;
}

}  // namespace tandem::router
