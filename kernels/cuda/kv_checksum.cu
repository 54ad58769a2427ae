// KV block checksums (tandem/cuda/kv_checksum.h; the algorithm is in tandem/kernels/kv_checksum.h).
#include "cuda_util.cuh"
#include "tandem/cuda/kv_checksum.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint64_t LoadWord(const uint8_t* seg, uint64_t j, uint64_t len,
                                             bool aligned) {
  if (aligned && 8 * j + 8 <= len) return *reinterpret_cast<const uint64_t*>(seg + 8 * j);
  uint64_t w = 0;
  for (uint64_t b = 0; b < 8 && 8 * j + b < len; ++b) w |= uint64_t(seg[8 * j + b]) << (8 * b);
  return w;
}

__global__ void KvChecksumKernel(KvChecksumParams p) {
  const int i = blockIdx.x;
  const uint64_t len = uint64_t(p.num_slots[i]) * p.slot_bytes;
  const uint64_t words = (len + 7) / 8;
  const uint64_t segs = 2 * uint64_t(p.num_layers);
  uint64_t sum = 0;
  for (uint64_t s = 0; s < segs; ++s) {
    const uint8_t* seg = p.pool + (s / 2) * p.layer_stride + (s % 2) * p.kv_stride +
                         uint64_t(p.blocks[i]) * p.block_bytes;
    const bool aligned = (reinterpret_cast<uintptr_t>(seg) & 7) == 0;
    for (uint64_t j = threadIdx.x; j < words; j += blockDim.x) {
      sum += KvChecksumMix(LoadWord(seg, j, len, aligned) ^
                           ((s * words + j) * kKvChecksumKeyMul));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  __shared__ uint64_t warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t total_sum = 0;
    for (int w = 0; w < kThreads / 32; ++w) total_sum += warp_sums[w];
    p.out[i] = KvChecksumMix(total_sum ^ ((segs * len) * kKvChecksumLenMul));
  }
}

}  // namespace

absl::Status KvBlockChecksums(const KvChecksumParams& p, Stream stream) {
  if (p.count < 0 || p.num_layers < 0) {
    return absl::InvalidArgumentError("KvBlockChecksums: negative count or num_layers");
  }
  if (p.count == 0) return absl::OkStatus();
  if (p.pool == nullptr || p.blocks == nullptr || p.num_slots == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("KvBlockChecksums: null pointer");
  }
  KvChecksumKernel<<<p.count, kThreads, 0, stream>>>(p);
  return TANDEM_CUDA_LAUNCH_STATUS("KvChecksumKernel");
}

}  // namespace tandem::kernels::cuda
