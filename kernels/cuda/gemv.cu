// Quantised GEMV for decode and the activation converters (see tandem/cuda/matmul.h).
//
// A warp owns one weight row; lane l takes 32-element units l, l + 32, ... (a whole block for
// Q8_0 / Q4_0 / MXFP4, one sub-block of a Q4_K super-block), dequantises it in registers and
// accumulates unit dot products for every activation row, then the warp sums its lanes.
// Block layouts are GGUF's (tandem/kernels/quant.h); blocks of 34, 18 and 17 bytes are read with
// the widest loads their alignment allows.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "cuda_util.cuh"
#include "tandem/cuda/matmul.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kWarpsPerCta = 8;

__device__ __forceinline__ float HalfBits(uint16_t h) { return __half2float(__ushort_as_half(h)); }

// Dequantises unit u of a row into v[32]. Q8_0: block u.
struct Q8_0 {
  static constexpr int kBlockBytes = 34;
  __device__ static void Unit(const uint8_t* row, int64_t u, float* v) {
    const uint16_t* b = reinterpret_cast<const uint16_t*>(row + u * kBlockBytes);
    const float d = HalfBits(__ldg(b));
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint16_t w = __ldg(b + 1 + i);
      v[2 * i] = d * static_cast<int8_t>(w & 0xff);
      v[2 * i + 1] = d * static_cast<int8_t>(w >> 8);
    }
  }
};

struct Q4_0 {
  static constexpr int kBlockBytes = 18;
  __device__ static void Unit(const uint8_t* row, int64_t u, float* v) {
    const uint16_t* b = reinterpret_cast<const uint16_t*>(row + u * kBlockBytes);
    const float d = HalfBits(__ldg(b));
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint16_t w = __ldg(b + 1 + i);
      // Byte j holds element j (low nibble) and j + 16 (high nibble).
      v[2 * i] = d * (static_cast<int>(w & 0xf) - 8);
      v[2 * i + 16] = d * (static_cast<int>((w >> 4) & 0xf) - 8);
      v[2 * i + 1] = d * (static_cast<int>((w >> 8) & 0xf) - 8);
      v[2 * i + 17] = d * (static_cast<int>(w >> 12) - 8);
    }
  }
};

struct Mxfp4 {
  static constexpr int kBlockBytes = 17;
  __device__ static void Unit(const uint8_t* row, int64_t u, float* v) {
    // E2M1 values doubled so they are integers; the E8M0 scale is halved to match.
    constexpr int8_t kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const uint8_t* b = row + u * kBlockBytes;
    const uint8_t e = __ldg(b);
    const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
    const float d = __uint_as_float(bits);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint8_t q = __ldg(b + 1 + j);
      v[j] = d * kValues[q & 0xf];
      v[j + 16] = d * kValues[q >> 4];
    }
  }
};

struct Q4K {
  static constexpr int kBlockBytes = 144;
  __device__ static void Unit(const uint8_t* row, int64_t u, float* v) {
    const uint8_t* b = row + (u / 8) * kBlockBytes;
    const int j = static_cast<int>(u % 8);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(b);
    const float d = HalfBits(__ldg(h)), dmin = HalfBits(__ldg(h + 1));
    const uint8_t* s = b + 4;
    int sc, mn;
    if (j < 4) {
      sc = __ldg(s + j) & 63;
      mn = __ldg(s + j + 4) & 63;
    } else {
      sc = (__ldg(s + j + 4) & 0xf) | ((__ldg(s + j - 4) >> 6) << 4);
      mn = (__ldg(s + j + 4) >> 4) | ((__ldg(s + j) >> 6) << 4);
    }
    const float ds = d * sc, dm = dmin * mn;
    // Sub-blocks 2g and 2g+1 share the 32 bytes qs[32g..]: low and high nibbles. Offset 16 + 32g
    // is 16-byte aligned within the 144-byte block, so 4-byte loads are safe.
    const uint32_t* q = reinterpret_cast<const uint32_t*>(b + 16 + 32 * (j / 2));
    const int shift = (j & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t w = __ldg(q + i) >> shift;
#pragma unroll
      for (int k = 0; k < 4; ++k) v[4 * i + k] = ds * ((w >> (8 * k)) & 0xf) - dm;
    }
  }
};

template <typename F>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    GemvKernel(GemvParams p, int64_t row_bytes, int64_t in_stride, int64_t out_stride) {
  const int lane = threadIdx.x & 31;
  const int64_t r = blockIdx.x * int64_t{kWarpsPerCta} + (threadIdx.x >> 5);
  if (r >= p.rows) return;
  const uint8_t* row = static_cast<const uint8_t*>(p.weight) + r * row_bytes;
  const int64_t units = p.cols / 32;
  float acc[kMaxGemvBatch];
#pragma unroll
  for (int b = 0; b < kMaxGemvBatch; ++b) acc[b] = 0.f;
  for (int64_t u = lane; u < units; u += 32) {
    float v[32];
    F::Unit(row, u, v);
#pragma unroll
    for (int b = 0; b < kMaxGemvBatch; ++b) {
      if (b < p.batch) {
        const float4* x = reinterpret_cast<const float4*>(p.input + b * in_stride + u * 32);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float4 xv = __ldg(x + i);
          s = fmaf(v[4 * i], xv.x, s);
          s = fmaf(v[4 * i + 1], xv.y, s);
          s = fmaf(v[4 * i + 2], xv.z, s);
          s = fmaf(v[4 * i + 3], xv.w, s);
        }
        acc[b] += s;
      }
    }
  }
#pragma unroll
  for (int b = 0; b < kMaxGemvBatch; ++b) {
    if (b < p.batch) {
      const float s = internal::WarpSum(acc[b]);
      if (lane == 0) p.output[b * out_stride + r] = s;
    }
  }
}

__global__ void ToBf16Kernel(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
  }
}

__global__ void ToFp8Kernel(const float* x, uint8_t* out, int64_t n, float inv_scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __nv_cvt_float_to_fp8(x[i] * inv_scale, __NV_SATFINITE, __NV_E4M3);
  }
}

int GridFor(int64_t n) { return static_cast<int>(std::clamp<int64_t>((n + 255) / 256, 1, 8192)); }

}  // namespace

absl::Status QuantGemv(const GemvParams& p, Stream stream) {
  int64_t block = 0;
  switch (p.weight_type) {
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kMXFP4:
      block = 32;
      break;
    case DType::kQ4_K:
      block = 256;
      break;
    default:
      return absl::InvalidArgumentError("QuantGemv: weight type must be q8_0, q4_0, q4_K or mxfp4");
  }
  if (p.rows < 0 || p.cols <= 0 || p.cols % block != 0 || p.batch < 1 ||
      p.batch > kMaxGemvBatch) {
    return absl::InvalidArgumentError("QuantGemv: bad shape");
  }
  const int64_t in_stride = p.input_stride == 0 ? p.cols : p.input_stride;
  const int64_t out_stride = p.output_stride == 0 ? p.rows : p.output_stride;
  if (!internal::Aligned16(p.input) || in_stride % 4 != 0 || in_stride < p.cols ||
      out_stride < p.rows) {
    return absl::InvalidArgumentError(
        "QuantGemv: input must be 16-byte aligned with strides of whole rows");
  }
  if (p.rows == 0) return absl::OkStatus();
  const int64_t row_bytes = static_cast<int64_t>(RowBytes(p.weight_type, p.cols));
  if (reinterpret_cast<uintptr_t>(p.weight) % (p.weight_type == DType::kQ4_K ? 16 : 2) != 0 ||
      (p.weight_type != DType::kMXFP4 && p.weight_type != DType::kQ4_K && row_bytes % 2 != 0)) {
    return absl::InvalidArgumentError("QuantGemv: weight rows are misaligned");
  }
  const unsigned grid = static_cast<unsigned>((p.rows + kWarpsPerCta - 1) / kWarpsPerCta);
  const int threads = kWarpsPerCta * 32;
  switch (p.weight_type) {
    case DType::kQ8_0:
      GemvKernel<Q8_0><<<grid, threads, 0, stream>>>(p, row_bytes, in_stride, out_stride);
      break;
    case DType::kQ4_0:
      GemvKernel<Q4_0><<<grid, threads, 0, stream>>>(p, row_bytes, in_stride, out_stride);
      break;
    case DType::kMXFP4:
      GemvKernel<Mxfp4><<<grid, threads, 0, stream>>>(p, row_bytes, in_stride, out_stride);
      break;
    default:
      GemvKernel<Q4K><<<grid, threads, 0, stream>>>(p, row_bytes, in_stride, out_stride);
      break;
  }
  return TANDEM_CUDA_LAUNCH_STATUS("QuantGemv launch");
}

absl::Status ConvertF32ToBf16(const float* x, uint16_t* out, int64_t n, Stream stream) {
  if (n <= 0) return n == 0 ? absl::OkStatus() : absl::InvalidArgumentError("negative length");
  ToBf16Kernel<<<GridFor(n), 256, 0, stream>>>(x, out, n);
  return TANDEM_CUDA_LAUNCH_STATUS("ConvertF32ToBf16 launch");
}

absl::Status ConvertF32ToFp8E4m3(const float* x, uint8_t* out, int64_t n, float inv_scale,
                                 Stream stream) {
  if (n <= 0) return n == 0 ? absl::OkStatus() : absl::InvalidArgumentError("negative length");
  ToFp8Kernel<<<GridFor(n), 256, 0, stream>>>(x, out, n, inv_scale);
  return TANDEM_CUDA_LAUNCH_STATUS("ConvertF32ToFp8E4m3 launch");
}

}  // namespace tandem::kernels::cuda
