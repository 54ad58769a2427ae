// Block pack/unpack and the KV write (see tandem/cuda/kv_blocks.h).
#include <cuda_fp16.h>

#include "cuda_util.cuh"
#include "tandem/cuda/kv_blocks.h"
#include "tandem/kernels/kv_quant.h"

namespace tandem::kernels::cuda {
namespace {

// One CTA per (block, region); `to_packed` picks the direction.
template <typename V>
__global__ void CopyBlocksKernel(KvPackParams p, const uint8_t* src, uint8_t* dst,
                                 bool to_packed) {
  const int i = blockIdx.x, r = blockIdx.y;
  const size_t cache_off = r * p.region_stride + size_t(p.blocks[i]) * p.block_bytes;
  const size_t packed_off = (size_t(r) * p.n_blocks + i) * p.block_bytes;
  const V* s = reinterpret_cast<const V*>(src + (to_packed ? cache_off : packed_off));
  V* d = reinterpret_cast<V*>(dst + (to_packed ? packed_off : cache_off));
  const size_t n = p.block_bytes / sizeof(V);
  for (size_t j = threadIdx.x; j < n; j += blockDim.x) d[j] = s[j];
}

absl::Status Copy(const KvPackParams& p, const void* src, void* dst, bool to_packed,
                  Stream stream) {
  if (p.n_regions < 0 || p.n_blocks < 0 || p.n_regions > 65535) {
    return absl::InvalidArgumentError("KV block copy: bad shape (at most 65535 regions)");
  }
  if (p.n_regions == 0 || p.n_blocks == 0 || p.block_bytes == 0) return absl::OkStatus();
  const dim3 grid(p.n_blocks, p.n_regions);
  const bool vec = p.block_bytes % 16 == 0 && p.region_stride % 16 == 0 &&
                   internal::Aligned16(src) && internal::Aligned16(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  if (vec) {
    CopyBlocksKernel<uint4><<<grid, 256, 0, stream>>>(p, s, d, to_packed);
  } else {
    CopyBlocksKernel<uint8_t><<<grid, 256, 0, stream>>>(p, s, d, to_packed);
  }
  return TANDEM_CUDA_LAUNCH_STATUS("KV block copy launch");
}

// FP8-e4m3fn encoding of kv_quant.h, step for step (round to nearest even, saturating).
__device__ uint8_t ToFp8(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t abs = u & 0x7fffffff;
  if (abs > 0x7f800000) return sign | kFp8E4M3NaN;
  if (abs >= 0x43e00000) return sign | 0x7e;
  if (abs < 0x3c800000) {
    return sign | static_cast<uint8_t>(rintf(__uint_as_float(abs) * 512.0f));
  }
  const int32_t e = static_cast<int32_t>(abs >> 23) - 127 + 7;
  uint32_t bits = (static_cast<uint32_t>(e) << 23) | (abs & 0x7fffff);
  bits += 0x7ffff + ((bits >> 20) & 1);
  return sign | static_cast<uint8_t>(bits >> 20);
}

// One CTA per (token, kv head, K or V); blockDim.x threads stride over head_dim.
__global__ void WriteKvKernel(KvWriteParams p, int64_t stride, int64_t slot_bytes,
                              int64_t code_bytes) {
  __shared__ float scratch[32];
  __shared__ int s_nan;
  const int tok = blockIdx.x, h = blockIdx.y;
  const bool is_v = blockIdx.z == 1;
  const int64_t slot = p.slot_mapping[tok];
  if (slot < 0) return;  // uniform over the CTA
  const float* x = (is_v ? p.v : p.k) + tok * stride + int64_t{h} * p.head_dim;
  uint8_t* base = static_cast<uint8_t*>(is_v ? p.v_cache : p.k_cache) + slot * slot_bytes;
  const int D = p.head_dim;
  if (p.type == DType::kF32 || p.type == DType::kF16) {
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const int64_t e = int64_t{h} * D + i;
      if (p.type == DType::kF32) {
        reinterpret_cast<float*>(base)[e] = x[i];
      } else {
        reinterpret_cast<__half*>(base)[e] = __float2half_rn(x[i]);
      }
    }
    return;
  }
  if (threadIdx.x == 0) s_nan = 0;
  __syncthreads();
  float amax = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float a = fabsf(x[i]);
    if (a <= 3.402823466e38f && a > amax) amax = a;  // finite only
    if (isnan(x[i])) s_nan = 1;  // benign race: every writer stores 1
  }
  amax = internal::BlockMax(amax, scratch);  // its barriers also publish s_nan
  const bool int8 = p.type == DType::kI8;
  const float scale = __fdiv_rn(amax, int8 ? kInt8KvMax : kFp8E4M3Max);
  uint8_t* codes = base + int64_t{h} * D;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = x[i];
    if (int8) {
      float q;
      if (isnan(v)) {
        q = 0.f;
      } else if (isinf(v)) {
        q = v > 0 ? kInt8KvMax : -kInt8KvMax;
      } else if (scale == 0.f) {
        q = 0.f;
      } else {
        q = fminf(fmaxf(rintf(__fdiv_rn(v, scale)), -kInt8KvMax), kInt8KvMax);
      }
      codes[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
    } else if (scale == 0.f && isfinite(v)) {
      codes[i] = signbit(v) ? 0x80 : 0x00;
    } else if (isnan(v)) {
      // GPU arithmetic returns a canonical NaN, so keep the input's sign by hand.
      codes[i] = (signbit(v) ? 0x80 : 0x00) | kFp8E4M3NaN;
    } else {
      codes[i] = ToFp8(scale == 0.f ? v : __fdiv_rn(v, scale));
    }
  }
  if (threadIdx.x == 0) {
    const float stored = (int8 && s_nan) ? __int_as_float(0x7fc00000) : scale;
    memcpy(base + code_bytes + 4 * h, &stored, 4);
    // The last head zeroes the padding between the codes and the scales.
    if (h == p.n_kv_head - 1) {
      for (int64_t b = int64_t{p.n_kv_head} * D; b < code_bytes; ++b) base[b] = 0;
    }
  }
}

}  // namespace

absl::Status PackKvBlocks(const KvPackParams& p, const void* cache, void* packed, Stream stream) {
  return Copy(p, cache, packed, true, stream);
}

absl::Status UnpackKvBlocks(const KvPackParams& p, const void* packed, void* cache,
                            Stream stream) {
  return Copy(p, packed, cache, false, stream);
}

absl::Status WriteKv(const KvWriteParams& p, Stream stream) {
  if (p.type != DType::kF32 && p.type != DType::kF16 && !IsQuantizedKvType(p.type)) {
    return absl::InvalidArgumentError("WriteKv: type must be f32, f16, int8 or fp8");
  }
  if (p.n_tokens < 0 || p.n_kv_head <= 0 || p.n_kv_head > 65535 || p.head_dim <= 0) {
    return absl::InvalidArgumentError("WriteKv: bad shape");
  }
  if (p.n_tokens == 0) return absl::OkStatus();
  const int64_t row = int64_t{p.n_kv_head} * p.head_dim;
  const int64_t stride = p.stride == 0 ? row : p.stride;
  int64_t slot_bytes = 0, code_bytes = 0;
  if (IsQuantizedKvType(p.type)) {
    code_bytes = KvQuantCodeBytes(p.n_kv_head, p.head_dim);
    slot_bytes = KvQuantSlotBytes(p.n_kv_head, p.head_dim);
  } else {
    slot_bytes = row * (p.type == DType::kF16 ? 2 : 4);
  }
  const int threads = p.head_dim >= 128 ? 128 : (p.head_dim >= 64 ? 64 : 32);
  WriteKvKernel<<<dim3(p.n_tokens, p.n_kv_head, 2), threads, 0, stream>>>(p, stride, slot_bytes,
                                                                         code_bytes);
  return TANDEM_CUDA_LAUNCH_STATUS("WriteKv launch");
}

}  // namespace tandem::kernels::cuda
