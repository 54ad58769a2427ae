// Top-k / top-p sampling (see tandem/cuda/sampling.h).
#include "cuda_util.cuh"
#include "tandem/cuda/sampling.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 1024;

// Order-preserving map of a float to uint32: a > b  <=>  Key(a) > Key(b) (finite inputs).
__device__ __forceinline__ uint32_t Key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint32_t BlockSumU(uint32_t v, uint32_t* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < (kThreads >> 5) ? scratch[lane] : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ int BlockMinI(int v, int* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < (kThreads >> 5) ? scratch[lane] : INT_MAX;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__global__ void __launch_bounds__(kThreads) SampleKernel(SampleParams p, int64_t stride) {
  __shared__ float fscratch[32];
  __shared__ uint32_t uscratch[32];
  __shared__ int iscratch[32];
  __shared__ float warp_tot[32];
  const int row = blockIdx.x;
  const float* l = p.logits + row * stride;
  const int n = p.vocab;
  const float temp = p.temperature[row];

  float lmax = -INFINITY;
  for (int i = threadIdx.x; i < n; i += kThreads) lmax = fmaxf(lmax, l[i]);
  lmax = internal::BlockMax(lmax, fscratch);

  if (temp <= 0.f) {  // greedy: lowest id holding the max
    int best = INT_MAX;
    for (int i = threadIdx.x; i < n; i += kThreads) {
      if (l[i] == lmax) {
        best = i;
        break;
      }
    }
    best = BlockMinI(best, iscratch);
    if (threadIdx.x == 0) p.out[row] = best;
    return;
  }

  // Top-k: the largest key K with count(key >= K) >= k is the k-th largest logit's key.
  uint32_t cut = 0;
  const int k = p.top_k[row];
  if (k > 0 && k < n) {
    uint32_t ans = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = ans | (1u << bit);
      uint32_t cnt = 0;
      for (int i = threadIdx.x; i < n; i += kThreads) cnt += Key(l[i]) >= cand;
      if (BlockSumU(cnt, uscratch) >= static_cast<uint32_t>(k)) ans = cand;
    }
    cut = ans;
  }
  const float inv_t = 1.f / temp;
  auto weight = [&](float x) { return __expf((x - lmax) * inv_t); };

  // Top-p: the largest key K whose kept mass at or above K reaches top_p of the kept total.
  const float top_p = p.top_p[row];
  if (top_p < 1.f) {
    float tot = 0.f;
    for (int i = threadIdx.x; i < n; i += kThreads) {
      if (Key(l[i]) >= cut) tot += weight(l[i]);
    }
    const float target = top_p * internal::BlockSum(tot, fscratch);
    // mass(K) falls as K grows and mass(cut) is the whole total, so the answer is >= cut.
    uint32_t ans = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = ans | (1u << bit);
      float mass = 0.f;
      for (int i = threadIdx.x; i < n; i += kThreads) {
        const uint32_t key = Key(l[i]);
        if (key >= cand && key >= cut) mass += weight(l[i]);
      }
      if (internal::BlockSum(mass, fscratch) >= target) ans = cand;
    }
    cut = max(cut, ans);
  }

  // Draw: walk ids in order with a block-wide inclusive scan per chunk of kThreads ids.
  float total = 0.f;
  int last = -1;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    if (Key(l[i]) >= cut) {
      total += weight(l[i]);
      last = i;
    }
  }
  total = internal::BlockSum(total, fscratch);
  last = -BlockMinI(-last, iscratch);
  const float target = p.u[row] * total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float base = 0.f;
  int found = INT_MAX;
  for (int c0 = 0; c0 < n && found == INT_MAX; c0 += kThreads) {
    const int i = c0 + threadIdx.x;
    const float w = (i < n && Key(l[i]) >= cut) ? weight(l[i]) : 0.f;
    float incl = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float t = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += t;
    }
    __syncthreads();
    if (lane == 31) warp_tot[warp] = incl;
    __syncthreads();
    float before = base;
    for (int wi = 0; wi < warp; ++wi) before += warp_tot[wi];
    float chunk = 0.f;
    for (int wi = 0; wi < (kThreads >> 5); ++wi) chunk += warp_tot[wi];
    const int cand = (w > 0.f && before + incl > target) ? i : INT_MAX;
    found = BlockMinI(cand, iscratch);
    base += chunk;
  }
  if (threadIdx.x == 0) p.out[row] = found != INT_MAX ? found : last;
}

}  // namespace

absl::Status SampleTopKTopP(const SampleParams& p, Stream stream) {
  if (p.n_rows < 0 || p.vocab <= 0 || (p.stride != 0 && p.stride < p.vocab)) {
    return absl::InvalidArgumentError("SampleTopKTopP: bad shape");
  }
  if (p.n_rows == 0) return absl::OkStatus();
  SampleKernel<<<p.n_rows, kThreads, 0, stream>>>(p, p.stride == 0 ? p.vocab : p.stride);
  return TANDEM_CUDA_LAUNCH_STATUS("SampleTopKTopP launch");
}

}  // namespace tandem::kernels::cuda
