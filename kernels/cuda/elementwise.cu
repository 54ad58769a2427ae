// RMSNorm, RoPE and SwiGLU (see tandem/cuda/elementwise.h).
#include <algorithm>

#include "cuda_util.cuh"
#include "tandem/cuda/elementwise.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kNormThreads = 256;

// One CTA per row.
__global__ void __launch_bounds__(kNormThreads)
    RmsNormKernel(const float* x, const float* w, float* out, int64_t n, int64_t stride,
                  float eps) {
  __shared__ float scratch[32];
  const float* xr = x + blockIdx.x * stride;
  float* orow = out + blockIdx.x * stride;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  ss = internal::BlockSum(ss, scratch);
  const float scale = rsqrtf(ss / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = xr[i] * scale * w[i];
}

// One thread per rotated pair of one head of one token: grid.y = token.
__global__ void RopeKernel(RopeParams p, float* x, int64_t stride, int64_t n_heads,
                           const int32_t* pos) {
  const int64_t pairs = p.n_rot / 2;
  const int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (idx >= n_heads * pairs) return;
  const int64_t h = idx / pairs, i = idx % pairs;
  // ggml multiplies theta by base^(-2/n_rot) once per pair; a power gives the same angle to a
  // few ulp.
  const float theta_scale = powf(p.freq_base, -2.0f / static_cast<float>(p.n_rot));
  float theta = static_cast<float>(pos[blockIdx.y]) * powf(theta_scale, static_cast<float>(i));
  if (p.freq_factors != nullptr) theta /= p.freq_factors[i];
  float s, c;
  sincosf(p.freq_scale * theta, &s, &c);
  float* head = x + blockIdx.y * stride + h * p.head_dim;
  const int64_t i0 = p.mode == RopeMode::kNormal ? 2 * i : i;
  const int64_t i1 = p.mode == RopeMode::kNormal ? 2 * i + 1 : i + p.n_rot / 2;
  const float x0 = head[i0], x1 = head[i1];
  head[i0] = x0 * c - x1 * s;
  head[i1] = x0 * s + x1 * c;
}

__global__ void SwiGluKernel(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] += y[i];
  }
}

// grid.y = row (at most 65535 per launch; the host loops over larger row counts).
__global__ void AddBiasKernel(float* x, const float* bias, int64_t n, int64_t stride) {
  float* row = x + blockIdx.y * stride;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    row[i] += bias[i];
  }
}

}  // namespace

absl::Status RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t n,
                     int64_t stride, float eps, Stream stream) {
  if (rows < 0 || n <= 0 || (stride != 0 && stride < n) || rows > 0x7fffffff) {
    return absl::InvalidArgumentError("cuda::RmsNorm: bad shape");
  }
  if (rows == 0) return absl::OkStatus();
  RmsNormKernel<<<static_cast<unsigned>(rows), kNormThreads, 0, stream>>>(
      x, weight, out, n, stride == 0 ? n : stride, eps);
  return TANDEM_CUDA_LAUNCH_STATUS("cuda::RmsNorm launch");
}

absl::Status Rope(const RopeParams& p, float* x, int64_t n_tokens, int64_t stride,
                  int64_t n_heads, const int32_t* pos, Stream stream) {
  if (n_tokens < 0 || n_tokens > 65535 || n_heads <= 0 || p.n_rot <= 0 || p.n_rot % 2 != 0 ||
      p.n_rot > p.head_dim) {
    return absl::InvalidArgumentError("cuda::Rope: bad shape (n_tokens at most 65535 per call)");
  }
  if (n_tokens == 0) return absl::OkStatus();
  const int64_t work = n_heads * (p.n_rot / 2);
  const dim3 grid(internal::CeilDiv(work, 128), static_cast<unsigned>(n_tokens));
  RopeKernel<<<grid, 128, 0, stream>>>(p, x, stride == 0 ? n_heads * p.head_dim : stride,
                                       n_heads, pos);
  return TANDEM_CUDA_LAUNCH_STATUS("cuda::Rope launch");
}

absl::Status SwiGlu(const float* gate, const float* up, float* out, int64_t n, Stream stream) {
  if (n < 0) return absl::InvalidArgumentError("cuda::SwiGlu: negative length");
  if (n == 0) return absl::OkStatus();
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  SwiGluKernel<<<blocks, 256, 0, stream>>>(gate, up, out, n);
  return TANDEM_CUDA_LAUNCH_STATUS("cuda::SwiGlu launch");
}

absl::Status AddInPlace(float* x, const float* y, int64_t n, Stream stream) {
  if (n < 0) return absl::InvalidArgumentError("cuda::AddInPlace: negative length");
  if (n == 0) return absl::OkStatus();
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  AddKernel<<<blocks, 256, 0, stream>>>(x, y, n);
  return TANDEM_CUDA_LAUNCH_STATUS("cuda::AddInPlace launch");
}

absl::Status AddBias(float* x, const float* bias, int64_t rows, int64_t n, int64_t stride,
                     Stream stream) {
  if (rows < 0 || n <= 0 || (stride != 0 && stride < n)) {
    return absl::InvalidArgumentError("cuda::AddBias: bad shape");
  }
  if (stride == 0) stride = n;
  const unsigned blocks_x = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 64));
  for (int64_t r0 = 0; r0 < rows; r0 += 65535) {
    const unsigned nr = static_cast<unsigned>(std::min<int64_t>(rows - r0, 65535));
    AddBiasKernel<<<dim3(blocks_x, nr), 256, 0, stream>>>(x + r0 * stride, bias, n, stride);
    if (absl::Status st = TANDEM_CUDA_LAUNCH_STATUS("cuda::AddBias launch"); !st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
