// Paged prefill attention (see tandem/cuda/attention.h), flash-style on CUDA cores.
//
// A CTA of 128 threads takes a tile of 16 query rows of one head; 8 threads share a row. It
// walks the sequence's keys in tiles of 32 (K and V staged in shared memory as floats, read
// through the block table), computes the 16x32 scores, and folds them into each row's online
// softmax state: running max, weight sum, and the row's output slice (head_dim / 8 columns per
// thread). Keys past a row's own position are masked, so a cached prefix and the new tokens are
// handled alike.
#include <cuda_fp8.h>

#include <algorithm>

#include "cuda_util.cuh"
#include "tandem/cuda/attention.h"
#include "tandem/kernels/kv_quant.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kRows = 16;
constexpr int kKeys = 32;
constexpr int kThreads = 128;
constexpr int kThreadsPerRow = kThreads / kRows;  // 8
constexpr int kMaxHeadDim = 256;
constexpr int kMaxCols = kMaxHeadDim / kThreadsPerRow;

// Element d of kv head `kvh` at cache slot `slot`, as float. Plain caches are
// [slot][kv_head][head_dim]; quantised ones (kv_quant.h) are codes then per-head f32 scales.
struct PlainSlot {
  int64_t slot_bytes, code_bytes;
};
template <typename T>
struct PlainKv {
  __device__ static float Load(const uint8_t* c, int64_t slot, int kvh, int D, int d,
                               const PlainSlot& g) {
    return internal::ToFloat(reinterpret_cast<const T*>(c + slot * g.slot_bytes)[kvh * D + d]);
  }
};
struct I8Kv {
  __device__ static float Load(const uint8_t* c, int64_t slot, int kvh, int D, int d,
                               const PlainSlot& g) {
    const uint8_t* s = c + slot * g.slot_bytes;
    const float scale = *reinterpret_cast<const float*>(s + g.code_bytes + 4 * kvh);
    return static_cast<float>(static_cast<int8_t>(s[kvh * D + d])) * scale;
  }
};
struct Fp8Kv {
  __device__ static float Load(const uint8_t* c, int64_t slot, int kvh, int D, int d,
                               const PlainSlot& g) {
    const uint8_t* s = c + slot * g.slot_bytes;
    const float scale = *reinterpret_cast<const float*>(s + g.code_bytes + 4 * kvh);
    const __half h(__nv_cvt_fp8_to_halfraw(s[kvh * D + d], __NV_E4M3));
    return __half2float(h) * scale;
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) PrefillKernel(PrefillAttentionParams p, PlainSlot geo) {
  extern __shared__ float smem[];
  const int D = p.head_dim, ld = D + 1;
  float* qs = smem;                  // [kRows][D]
  float* ks = qs + kRows * D;        // [kKeys][ld]
  float* vs = ks + kKeys * ld;       // [kKeys][ld]
  float* ps = vs + kKeys * ld;       // [kRows][kKeys]
  __shared__ int s_pos[kRows];
  __shared__ int s_key_end;

  const int h = blockIdx.y;
  const int kvh = h / (p.n_head / p.n_kv_head);
  const int q0 = blockIdx.x * kRows;
  const int r = threadIdx.x / kThreadsPerRow, c = threadIdx.x % kThreadsPerRow;

  if (threadIdx.x < kRows) {
    const int qi = q0 + threadIdx.x;
    s_pos[threadIdx.x] = qi < p.n_q ? p.q_pos[qi] : -1;
  }
  for (int idx = threadIdx.x; idx < kRows * D; idx += kThreads) {
    const int rr = idx / D, d = idx % D, qi = q0 + rr;
    qs[idx] = qi < p.n_q ? p.q[qi * p.q_stride + int64_t{h} * D + d] : 0.f;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int mx = -1;
    for (int i = 0; i < kRows; ++i) mx = max(mx, s_pos[i]);
    s_key_end = mx + 1;
  }
  __syncthreads();
  const int my_pos = s_pos[r];
  const int key_end = s_key_end;
  const uint8_t* kc = static_cast<const uint8_t*>(p.k_cache);
  const uint8_t* vc = static_cast<const uint8_t*>(p.v_cache);

  float m = -INFINITY, l = 0.f;
  float acc[kMaxCols];
#pragma unroll
  for (int i = 0; i < kMaxCols; ++i) acc[i] = 0.f;

  for (int t0 = 0; t0 < key_end; t0 += kKeys) {
    for (int idx = threadIdx.x; idx < kKeys * D; idx += kThreads) {
      const int j = idx / D, d = idx % D, t = t0 + j;
      float kv = 0.f, vv = 0.f;
      if (t < key_end) {
        const int64_t slot = int64_t{p.block_table[t / p.block_size]} * p.block_size +
                             t % p.block_size;
        kv = T::Load(kc, slot, kvh, D, d, geo);
        vv = T::Load(vc, slot, kvh, D, d, geo);
      }
      ks[j * ld + d] = kv;
      vs[j * ld + d] = vv;
    }
    __syncthreads();
    float s[kKeys / kThreadsPerRow];
    float tile_max = -INFINITY;
#pragma unroll
    for (int k = 0; k < kKeys / kThreadsPerRow; ++k) {
      const int j = c + k * kThreadsPerRow;
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot = fmaf(qs[r * D + d], ks[j * ld + d], dot);
      s[k] = (t0 + j <= my_pos) ? dot * p.scale : -INFINITY;
      tile_max = fmaxf(tile_max, s[k]);
    }
    for (int o = kThreadsPerRow / 2; o > 0; o >>= 1) {
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
    }
    const float m_new = fmaxf(m, tile_max);
    float corr = 1.f, psum = 0.f;
    if (m_new != -INFINITY) {
      corr = __expf(m - m_new);
#pragma unroll
      for (int k = 0; k < kKeys / kThreadsPerRow; ++k) {
        const float w = __expf(s[k] - m_new);
        ps[r * kKeys + c + k * kThreadsPerRow] = w;
        psum += w;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kKeys / kThreadsPerRow; ++k) ps[r * kKeys + c + k * kThreadsPerRow] = 0.f;
    }
    for (int o = kThreadsPerRow / 2; o > 0; o >>= 1) {
      psum += __shfl_xor_sync(0xffffffffu, psum, o);
    }
    l = l * corr + psum;
    m = m_new;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kMaxCols; ++i) {
      const int d = c + i * kThreadsPerRow;
      if (d < D) {
        float a = acc[i] * corr;
        for (int j = 0; j < kKeys; ++j) a = fmaf(ps[r * kKeys + j], vs[j * ld + d], a);
        acc[i] = a;
      }
    }
    __syncthreads();  // before the next tile overwrites ks/vs/ps
  }
  const int qi = q0 + r;
  if (qi >= p.n_q) return;
  const float inv = 1.f / l;
#pragma unroll
  for (int i = 0; i < kMaxCols; ++i) {
    const int d = c + i * kThreadsPerRow;
    if (d < D) p.out[qi * p.out_stride + int64_t{h} * D + d] = acc[i] * inv;
  }
}

}  // namespace

absl::Status PagedPrefillAttention(const PrefillAttentionParams& p, Stream stream) {
  if (p.kv_type != DType::kF16 && p.kv_type != DType::kF32 && !IsQuantizedKvType(p.kv_type)) {
    return absl::InvalidArgumentError("PagedPrefillAttention: kv_type must be f16, f32, i8 or fp8");
  }
  if (p.n_q < 0 || p.n_head <= 0 || p.n_kv_head <= 0 || p.n_head % p.n_kv_head != 0 ||
      p.block_size <= 0 || p.head_dim <= 0 || p.head_dim > kMaxHeadDim ||
      p.head_dim % kThreadsPerRow != 0) {
    return absl::InvalidArgumentError("PagedPrefillAttention: bad shape");
  }
  if (p.n_q == 0) return absl::OkStatus();
  const int D = p.head_dim;
  const size_t smem = (size_t(kRows) * D + 2 * size_t(kKeys) * (D + 1) + kRows * kKeys) * 4;
  PlainSlot geo{0, 0};
  auto kernel = PrefillKernel<PlainKv<float>>;
  switch (p.kv_type) {
    case DType::kF16:
      kernel = PrefillKernel<PlainKv<__half>>;
      geo.slot_bytes = int64_t{p.n_kv_head} * D * 2;
      break;
    case DType::kF32:
      geo.slot_bytes = int64_t{p.n_kv_head} * D * 4;
      break;
    case DType::kI8:
      kernel = PrefillKernel<I8Kv>;
      break;
    default:
      kernel = PrefillKernel<Fp8Kv>;
      break;
  }
  if (IsQuantizedKvType(p.kv_type)) {
    geo.slot_bytes = KvQuantSlotBytes(p.n_kv_head, D);
    geo.code_bytes = KvQuantCodeBytes(p.n_kv_head, D);
  }
  if (smem > 48 * 1024) {
    TANDEM_RETURN_IF_CUDA(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  const dim3 grid(internal::CeilDiv(p.n_q, kRows), p.n_head);
  kernel<<<grid, kThreads, smem, stream>>>(p, geo);
  return TANDEM_CUDA_LAUNCH_STATUS("PagedPrefillAttention launch");
}

}  // namespace tandem::kernels::cuda
