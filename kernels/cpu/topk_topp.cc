#include "tandem/kernels/topk_topp.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

namespace tandem::kernels {

int32_t SampleTopKTopPReference(const float* logits, int32_t n, const TopKTopPParams& p,
                                double u) {
  if (p.temperature <= 0.0f) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; ++i) {
      if (logits[i] > logits[best]) best = i;
    }
    return best;
  }
  std::vector<float> sorted(logits, logits + n);
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  const float lmax = sorted[0];
  float threshold = sorted[n - 1];  // keeps everything
  if (p.top_k > 0 && p.top_k < n) threshold = sorted[p.top_k - 1];
  auto weight = [&](float l) { return std::exp((double(l) - lmax) / p.temperature); };
  if (p.top_p < 1.0f) {
    double total = 0;
    for (float l : sorted) {
      if (l >= threshold) total += weight(l);
    }
    // Walk distinct values from the largest; the first at which the mass of everything at or
    // above it reaches top_p * total is the cut.
    const double target = double(p.top_p) * total;
    double mass = 0;
    for (size_t i = 0; i < sorted.size() && sorted[i] >= threshold;) {
      size_t j = i;
      while (j < sorted.size() && sorted[j] == sorted[i]) mass += weight(sorted[j++]);
      if (mass >= target) {
        threshold = sorted[i];
        break;
      }
      i = j;
    }
  }
  double total = 0;
  int32_t last = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (logits[i] >= threshold) {
      total += weight(logits[i]);
      last = i;
    }
  }
  const double target = u * total;
  double run = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (logits[i] < threshold) continue;
    run += weight(logits[i]);
    if (run > target) return i;
  }
  return last;
}

}  // namespace tandem::kernels
