// RMSNorm: out[i] = x[i] / sqrt(mean(x^2) + eps) * weight[i]. The mean of squares is summed
// in double, as ggml does, so results agree with llama.cpp bit for bit on the same inputs.
// out may alias x. Pure, thread-safe.
#pragma once

#include <cstdint>

namespace tandem::kernels {

void RmsNorm(const float* x, const float* weight, float* out, int64_t n, float eps);
void RmsNormReference(const float* x, const float* weight, float* out, int64_t n, float eps);

}  // namespace tandem::kernels
