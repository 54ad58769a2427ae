// RMSNorm in ggml's arithmetic: squares rounded to float, summed in double, the mean narrowed to
// float, scale = 1/sqrtf(mean + eps), then (x * scale) * weight in float.
#include "tandem/kernels/norm.h"

#include <cmath>

namespace tandem::kernels {
namespace {

float InvRms(double sum_sq, int64_t n, float eps) {
  const float mean = static_cast<float>(sum_sq / static_cast<double>(n));
  return 1.0f / std::sqrt(mean + eps);
}

}  // namespace

void RmsNorm(const float* x, const float* weight, float* out, int64_t n, float eps) {
  // Four double partial sums: the order differs from the sequential sum by far less than a
  // float ulp of the mean, and the loop no longer waits on one add chain.
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += static_cast<double>(x[i] * x[i]);
    s1 += static_cast<double>(x[i + 1] * x[i + 1]);
    s2 += static_cast<double>(x[i + 2] * x[i + 2]);
    s3 += static_cast<double>(x[i + 3] * x[i + 3]);
  }
  for (; i < n; ++i) s0 += static_cast<double>(x[i] * x[i]);
  const float scale = InvRms((s0 + s1) + (s2 + s3), n, eps);
  for (int64_t j = 0; j < n; ++j) out[j] = x[j] * scale * weight[j];
}

void RmsNormReference(const float* x, const float* weight, float* out, int64_t n, float eps) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i] * x[i]);
  const float scale = InvRms(sum, n, eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

}  // namespace tandem::kernels
