// Paged decode attention (see tandem/cuda/attention.h).
//
// Work split: a CTA of 4 warps serves one (sequence, KV head, head group of <= 8 query heads,
// split). A key row of head_dim elements is read by lanes_per_key lanes, each loading one 16-byte
// vector (4 bytes for the INT8/FP8 caches, whose slots are only 4-byte aligned), so a warp reads
// 32 / lanes_per_key rows per step and the 4 warps stream disjoint keys.
// Each lane keeps, per query head, an online-softmax state (running max, sum of weights, and its
// slice of the weighted V sum); the states of all key streams are merged in shared memory at
// the end. Every K/V byte is loaded once per CTA and used by all query heads of the group,
// which is what keeps the kernel on the memory roofline for GQA models.
#include <cuda_fp8.h>

#include <algorithm>

#include "cuda_util.cuh"
#include "tandem/cuda/attention.h"
#include "tandem/kernels/kv_quant.h"

namespace tandem::kernels::cuda {
namespace {

using internal::CeilDiv;
using internal::Vec16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxGroup = 8;  // query heads per CTA

// Where a (slot, kv head) row lives, for every cache type: slot s of the layer region starts at
// s * slot_bytes, kv head h's row at h * row_bytes within it; quantised slots keep their f32
// scales at code_bytes + 4 * h (tandem/kernels/kv_quant.h).
struct Geometry {
  int64_t slot_bytes = 0;
  int64_t code_bytes = 0;
  int64_t row_bytes = 0;
};

// Cache element types: what one lane loads (Raw, kN elements) and how it becomes floats.
struct KvF32 {
  using Raw = uint4;
  static constexpr int kN = 4;
  static constexpr bool kScaled = false;
  __device__ static void Unpack(const Raw& r, float, float* out) { Vec16<float>::Unpack(r, out); }
};
struct KvF16 {
  using Raw = uint4;
  static constexpr int kN = 8;
  static constexpr bool kScaled = false;
  __device__ static void Unpack(const Raw& r, float, float* out) { Vec16<__half>::Unpack(r, out); }
};
// Quantised rows are only 4-byte aligned (a slot is codes plus scales), hence 4-byte loads.
struct KvI8 {
  using Raw = uint32_t;
  static constexpr int kN = 4;
  static constexpr bool kScaled = true;
  __device__ static void Unpack(const Raw& r, float scale, float* out) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = static_cast<float>(static_cast<int8_t>(r >> (8 * i))) * scale;
  }
};
struct KvFp8 {
  using Raw = uint32_t;
  static constexpr int kN = 4;
  static constexpr bool kScaled = true;
  __device__ static void Unpack(const Raw& r, float scale, float* out) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const __half2 h(__nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(r >> (16 * i)), __NV_E4M3));
      const float2 f = __half22float2(h);
      out[2 * i] = f.x * scale;
      out[2 * i + 1] = f.y * scale;
    }
  }
};

template <typename K>
__device__ __forceinline__ typename K::Raw LoadRow(const uint8_t* cache, int64_t slot, int kvh,
                                                   int c, const Geometry& g) {
  const uint8_t* row = cache + slot * g.slot_bytes + kvh * g.row_bytes;
  return __ldg(reinterpret_cast<const typename K::Raw*>(row) + c);
}

template <typename K>
__device__ __forceinline__ float LoadScale(const uint8_t* cache, int64_t slot, int kvh,
                                           const Geometry& g) {
  if constexpr (!K::kScaled) {
    return 1.0f;
  } else {
    return __ldg(reinterpret_cast<const float*>(cache + slot * g.slot_bytes + g.code_bytes) + kvh);
  }
}

struct Plan {
  int head_groups = 1;  // CTAs per KV head along the query heads
  int heads_per_cta = 1;
  int splits = 1;
  int keys_per_split = 0;
};

// Output of one CTA when the sequence is split: the merged state, not normalised.
// ws_acc: [seq][head][split][head_dim], ws_ml: [seq][head][split][2] (max, weight sum).
template <typename K, int kG>
__global__ void __launch_bounds__(kThreads)
    DecodeKernel(DecodeAttentionParams p, Geometry geo, int head_groups, int heads_per_cta,
                 int splits, int keys_per_split, float* ws_acc, float* ws_ml) {
  constexpr int kVec = K::kN;
  extern __shared__ float smem[];
  const int lanes_per_key = p.head_dim / kVec;  // power of two <= 32, checked on the host
  const int keys_per_warp = 32 / lanes_per_key;
  const int streams = kWarps * keys_per_warp;

  const int seq = blockIdx.y;
  const int kvh = blockIdx.x / head_groups;
  const int hg = blockIdx.x % head_groups;
  const int split = blockIdx.z;
  const int group = p.n_head / p.n_kv_head;
  const int head0 = kvh * group + hg * heads_per_cta;
  const int nh = min(heads_per_cta, group - hg * heads_per_cta);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int sub = lane / lanes_per_key;  // which key of the warp's step
  const int c = lane % lanes_per_key;    // which 16-byte slice of the row
  const int stream = warp * keys_per_warp + sub;

  const int len = p.seq_lens[seq];
  const int begin = split * keys_per_split;
  const int end = min(len, begin + keys_per_split);

  float q[kG][kVec];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      q[g][i] = g < nh ? p.q[seq * p.q_stride + (head0 + g) * p.head_dim + c * kVec + i] : 0.f;
    }
  }
  float m[kG], l[kG], acc[kG][kVec];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[g][i] = 0.f;
  }

  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const uint8_t* kc = static_cast<const uint8_t*>(p.k_cache);
  const uint8_t* vc = static_cast<const uint8_t*>(p.v_cache);
  // Each warp takes kUnroll key rows per lane per iteration and issues all their loads before
  // any math, so enough bytes are in flight to cover memory latency.
  constexpr int kUnroll = kG >= 8 ? 2 : 4;
  const int chunk = keys_per_warp * kUnroll;
  const int step = kWarps * chunk;
  // The loop bound is warp-uniform so every lane takes part in the shuffles.
  for (int base = begin + warp * chunk; base < end; base += step) {
    typename K::Raw kraw[kUnroll], vraw[kUnroll];
    float kscale[kUnroll], vscale[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = base + u * keys_per_warp + sub;
      kraw[u] = vraw[u] = typename K::Raw{};
      kscale[u] = vscale[u] = 0.f;
      if (t < end) {
        const int64_t slot = int64_t{table[t / p.block_size]} * p.block_size + t % p.block_size;
        kraw[u] = LoadRow<K>(kc, slot, kvh, c, geo);
        vraw[u] = LoadRow<K>(vc, slot, kvh, c, geo);
        kscale[u] = LoadScale<K>(kc, slot, kvh, geo);
        vscale[u] = LoadScale<K>(vc, slot, kvh, geo);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool valid = base + u * keys_per_warp + sub < end;
      float kf[kVec], vf[kVec];
      K::Unpack(kraw[u], kscale[u], kf);
      K::Unpack(vraw[u], vscale[u], vf);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < kVec; ++i) s = fmaf(q[g][i], kf[i], s);
        for (int o = lanes_per_key >> 1; o > 0; o >>= 1) {
          s += __shfl_xor_sync(0xffffffffu, s, o);
        }
        if (valid) {
          s *= p.scale;
          const float m_new = fmaxf(m[g], s);
          const float corr = __expf(m[g] - m_new);  // 0 on the first key (m = -inf)
          const float w = __expf(s - m_new);
          l[g] = l[g] * corr + w;
#pragma unroll
          for (int i = 0; i < kVec; ++i) acc[g][i] = fmaf(w, vf[i], acc[g][i] * corr);
          m[g] = m_new;
        }
      }
    }
  }

  // Merge the key streams: sm_ml[stream][g][2], sm_acc[stream][g][head_dim].
  float* sm_ml = smem;
  float* sm_acc = smem + streams * kG * 2;
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    if (c == 0) {
      sm_ml[(stream * kG + g) * 2] = m[g];
      sm_ml[(stream * kG + g) * 2 + 1] = l[g];
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      sm_acc[(stream * kG + g) * p.head_dim + c * kVec + i] = acc[g][i];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < nh * p.head_dim; idx += kThreads) {
    const int g = idx / p.head_dim, d = idx % p.head_dim;
    float mx = -INFINITY;
    for (int s = 0; s < streams; ++s) mx = fmaxf(mx, sm_ml[(s * kG + g) * 2]);
    float sum = 0.f, o = 0.f;
    if (mx != -INFINITY) {
      for (int s = 0; s < streams; ++s) {
        const float ms = sm_ml[(s * kG + g) * 2];
        if (ms == -INFINITY) continue;
        const float f = __expf(ms - mx);
        sum += sm_ml[(s * kG + g) * 2 + 1] * f;
        o += sm_acc[(s * kG + g) * p.head_dim + d] * f;
      }
    }
    const int h = head0 + g;
    if (splits == 1) {
      p.out[seq * p.out_stride + h * p.head_dim + d] = o / sum;
    } else {
      const int64_t slot = (static_cast<int64_t>(seq) * p.n_head + h) * splits + split;
      ws_acc[slot * p.head_dim + d] = o;
      if (d == 0) {
        ws_ml[slot * 2] = mx;
        ws_ml[slot * 2 + 1] = sum;
      }
    }
  }
}

// Combines the splits of one (sequence, head): blockDim.x = head_dim.
__global__ void CombineSplitsKernel(DecodeAttentionParams p, int splits, const float* ws_acc,
                                    const float* ws_ml) {
  const int seq = blockIdx.y, h = blockIdx.x, d = threadIdx.x;
  const int64_t base = (static_cast<int64_t>(seq) * p.n_head + h) * splits;
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, ws_ml[(base + s) * 2]);
  float sum = 0.f, o = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float ms = ws_ml[(base + s) * 2];
    if (ms == -INFINITY) continue;  // a split past this sequence's end
    const float f = __expf(ms - mx);
    sum += ws_ml[(base + s) * 2 + 1] * f;
    o += ws_acc[(base + s) * p.head_dim + d] * f;
  }
  p.out[seq * p.out_stride + h * p.head_dim + d] = o / sum;
}

absl::Status Validate(const DecodeAttentionParams& p) {
  if (p.kv_type != DType::kF16 && p.kv_type != DType::kF32 && !IsQuantizedKvType(p.kv_type)) {
    return absl::InvalidArgumentError("PagedDecodeAttention: kv_type must be f16, f32, i8 or fp8");
  }
  if (p.n_seqs < 0 || p.n_head <= 0 || p.n_kv_head <= 0 || p.n_head % p.n_kv_head != 0 ||
      p.block_size <= 0 || p.max_seq_len <= 0 || p.max_blocks_per_seq <= 0) {
    return absl::InvalidArgumentError("PagedDecodeAttention: bad shape");
  }
  const int elem = IsQuantizedKvType(p.kv_type) ? 1 : (p.kv_type == DType::kF16 ? 2 : 4);
  const int load = IsQuantizedKvType(p.kv_type) ? 4 : 16;  // bytes per lane load
  const int vecs = p.head_dim * elem / load;
  if (p.head_dim <= 0 || p.head_dim * elem % load != 0 || vecs > 32 || (vecs & (vecs - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PagedDecodeAttention: unsupported head_dim ", p.head_dim, " for this kv_type"));
  }
  if (!internal::Aligned16(p.k_cache) || !internal::Aligned16(p.v_cache)) {
    return absl::InvalidArgumentError("PagedDecodeAttention: K/V caches must be 16-byte aligned");
  }
  return absl::OkStatus();
}

absl::StatusOr<Plan> MakePlan(const DecodeAttentionParams& p) {
  if (absl::Status st = Validate(p); !st.ok()) return st;
  Plan plan;
  const int group = p.n_head / p.n_kv_head;
  plan.head_groups = CeilDiv(group, kMaxGroup);
  plan.heads_per_cta = CeilDiv(group, plan.head_groups);
  int kps = p.keys_per_split;
  if (kps <= 0) {
    int sms = 132;
    int dev = 0;
    if (cudaGetDevice(&dev) == cudaSuccess) {
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    }
    const int64_t ctas = int64_t{std::max(p.n_seqs, 1)} * p.n_kv_head * plan.head_groups;
    const int64_t want = std::max<int64_t>(1, (2 * sms + ctas - 1) / ctas);
    // Below ~256 keys a split costs more in the merge than it gains in parallelism.
    const int64_t max_splits = std::max<int64_t>(1, p.max_seq_len / 256);
    const int64_t splits = std::min(want, max_splits);
    kps = CeilDiv(p.max_seq_len, splits);
    kps = (kps + 63) / 64 * 64;
  }
  plan.keys_per_split = kps;
  plan.splits = CeilDiv(p.max_seq_len, kps);
  return plan;
}

size_t WorkspaceBytes(const DecodeAttentionParams& p, const Plan& plan) {
  if (plan.splits <= 1) return 0;
  const size_t slots = size_t(p.n_seqs) * p.n_head * plan.splits;
  return slots * (p.head_dim + 2) * sizeof(float);
}

Geometry MakeGeometry(const DecodeAttentionParams& p) {
  Geometry g;
  if (IsQuantizedKvType(p.kv_type)) {
    g.slot_bytes = KvQuantSlotBytes(p.n_kv_head, p.head_dim);
    g.code_bytes = KvQuantCodeBytes(p.n_kv_head, p.head_dim);
    g.row_bytes = p.head_dim;
  } else {
    g.row_bytes = int64_t{p.head_dim} * (p.kv_type == DType::kF16 ? 2 : 4);
    g.slot_bytes = g.row_bytes * p.n_kv_head;
  }
  return g;
}

template <typename K, int kG>
cudaError_t Launch(const DecodeAttentionParams& p, const Plan& plan, Stream stream) {
  constexpr int kVec = K::kN;
  const int streams = kWarps * (32 / (p.head_dim / kVec));
  const size_t smem = size_t(streams) * kG * (p.head_dim + 2) * sizeof(float);
  auto kernel = DecodeKernel<K, kG>;
  if (smem > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  }
  float* ws_acc = static_cast<float*>(p.workspace);
  const size_t slots = size_t(p.n_seqs) * p.n_head * plan.splits;
  float* ws_ml = plan.splits > 1 ? ws_acc + slots * p.head_dim : nullptr;
  dim3 grid(p.n_kv_head * plan.head_groups, p.n_seqs, plan.splits);
  kernel<<<grid, kThreads, smem, stream>>>(p, MakeGeometry(p), plan.head_groups, plan.heads_per_cta, plan.splits,
                                           plan.keys_per_split, ws_acc, ws_ml);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || plan.splits == 1) return e;
  CombineSplitsKernel<<<dim3(p.n_head, p.n_seqs), p.head_dim, 0, stream>>>(p, plan.splits, ws_acc,
                                                                          ws_ml);
  return cudaGetLastError();
}

template <typename K>
cudaError_t LaunchForGroup(const DecodeAttentionParams& p, const Plan& plan, Stream stream) {
  if (plan.heads_per_cta == 1) return Launch<K, 1>(p, plan, stream);
  if (plan.heads_per_cta == 2) return Launch<K, 2>(p, plan, stream);
  if (plan.heads_per_cta <= 4) return Launch<K, 4>(p, plan, stream);
  return Launch<K, 8>(p, plan, stream);
}

}  // namespace

absl::StatusOr<size_t> DecodeAttentionWorkspaceBytes(const DecodeAttentionParams& p) {
  auto plan = MakePlan(p);
  if (!plan.ok()) return plan.status();
  return WorkspaceBytes(p, *plan);
}

absl::Status PagedDecodeAttention(const DecodeAttentionParams& p, Stream stream) {
  auto plan = MakePlan(p);
  if (!plan.ok()) return plan.status();
  if (p.n_seqs == 0) return absl::OkStatus();
  const size_t need = WorkspaceBytes(p, *plan);
  if (need > 0 && (p.workspace == nullptr || p.workspace_bytes < need)) {
    return absl::InvalidArgumentError(absl::StrCat("PagedDecodeAttention: needs ", need,
                                                   " bytes of workspace, got ",
                                                   p.workspace_bytes));
  }
  cudaError_t e;
  switch (p.kv_type) {
    case DType::kF16:
      e = LaunchForGroup<KvF16>(p, *plan, stream);
      break;
    case DType::kF32:
      e = LaunchForGroup<KvF32>(p, *plan, stream);
      break;
    case DType::kI8:
      e = LaunchForGroup<KvI8>(p, *plan, stream);
      break;
    default:
      e = LaunchForGroup<KvFp8>(p, *plan, stream);
      break;
  }
  return internal::FromCudaError(e, "PagedDecodeAttention launch", __FILE__, __LINE__);
}

}  // namespace tandem::kernels::cuda
