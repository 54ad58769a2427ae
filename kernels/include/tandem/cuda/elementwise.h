// Row-wise and elementwise ops of a transformer layer on the GPU, matching the CPU references
// in tandem/kernels/{norm,rope,activation}.h (the *Reference functions) up to float rounding
// (the additions exactly):
// sums are taken in float with tree reductions, exponentials and angles by the CUDA math
// library. All pointers are device memory owned by the caller; see cuda_common.h for threading
// and errors.
#pragma once

#include <cstdint>

#include "tandem/cuda/cuda_common.h"
#include "tandem/kernels/rope.h"

namespace tandem::kernels::cuda {

// out[r][i] = x[r][i] / sqrt(mean_i(x[r]^2) + eps) * weight[i] for r < rows; rows are n floats
// long and `stride` floats apart in both x and out (0: n). out may alias x.
absl::Status RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t n,
                     int64_t stride, float eps, Stream stream);

// RoPE in place on n_tokens rows of n_heads * head_dim floats (rows `stride` floats apart, 0:
// packed), token i at position pos[i] (device). freq_factors in `p` must be a device pointer
// (or null).
absl::Status Rope(const RopeParams& p, float* x, int64_t n_tokens, int64_t stride,
                  int64_t n_heads, const int32_t* pos, Stream stream);

// out[i] = silu(gate[i]) * up[i]; out may alias gate.
absl::Status SwiGlu(const float* gate, const float* up, float* out, int64_t n, Stream stream);

// x[i] += y[i] for i < n (the residual connection; kernels::AddInPlace on the CPU).
absl::Status AddInPlace(float* x, const float* y, int64_t n, Stream stream);

// x[r][i] += bias[i] for r < rows, i < n; rows `stride` floats apart (0: n). Projection biases.
absl::Status AddBias(float* x, const float* bias, int64_t rows, int64_t n, int64_t stride,
                     Stream stream);

}  // namespace tandem::kernels::cuda
