// The KV block checksum: what prefill sends with a handoff, decode verifies, and the kvstore
// stores per block. One algorithm with three implementations that agree bit for bit: this plain
// reference, the production CPU version (services/common/kv_layout.cc) and the CUDA kernel
// (tandem/cuda/kv_checksum.h), so bytes checksummed on a GPU and on a CPU compare equal.
//
// Algorithm (a keyed sum, chosen because every word is independent, so a GPU sums a block with
// all its threads in any order and still gets the same integer):
//   A block's bytes are 2 * num_layers segments in a fixed order: segment 2l is layer l's K,
//   segment 2l+1 layer l's V, each the first num_slots * slot_bytes bytes of the block there.
//   Each segment is zero-padded to whole little-endian 64-bit words (W = ceil(len / 8) words)
//   and the segments are numbered into one word stream: word j of segment s is word g = s*W + j.
//   term(g) = Mix(w[g] ^ g * kKvChecksumKeyMul); sum = the sum of every term mod 2^64;
//   checksum = Mix(sum ^ (total_bytes * kKvChecksumLenMul)), total_bytes = 2 * num_layers * len.
// A full block (len a multiple of 8, as block_size * slot_bytes is for block_size 16) is thus
// the checksum of its segments laid end to end, which is how the kvstore holds a block: it
// checks stored blocks with the same function over the contiguous bytes (services/common/
// kv_layout.h, KvBytesChecksum).
// Mix is a bijection of 64-bit words (murmur3's finaliser), so changing any one word (a single
// bit flip, say) changes exactly one term by a non-zero amount, and the checksum: single-word
// errors are always detected; other errors escape with probability about 2^-64.
// Pure functions; thread-safe. Block ids and sizes are trusted (callers validate them).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tandem::kernels {

inline constexpr uint64_t kKvChecksumKeyMul = 0x9E3779B97F4A7C15ull;
inline constexpr uint64_t kKvChecksumLenMul = 0xC2B2AE3D27D4EB4Full;

#if defined(__CUDACC__)
#define TANDEM_KV_CHECKSUM_FN __host__ __device__ __forceinline__
#else
#define TANDEM_KV_CHECKSUM_FN inline
#endif
// The mixing bijection (murmur3's 64-bit finaliser), one definition for all three versions.
TANDEM_KV_CHECKSUM_FN constexpr uint64_t KvChecksumMix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  x ^= x >> 33;
  return x;
}
#undef TANDEM_KV_CHECKSUM_FN

// Where a pool's blocks are: layer l's K region starts at pool + l * layer_stride, its V region
// kv_stride after that, and block b of a region at b * block_bytes from the region's start.
struct KvChecksumParams {
  const uint8_t* pool = nullptr;  // device memory for the CUDA version
  uint64_t layer_stride = 0;
  uint64_t kv_stride = 0;
  int32_t num_layers = 0;
  uint64_t block_bytes = 0;
  uint64_t slot_bytes = 0;             // bytes of one slot (quantised slots carry their scales)
  const int32_t* blocks = nullptr;     // count block ids (device arrays for the CUDA version)
  const int32_t* num_slots = nullptr;  // count slot counts, each in [0, block_bytes/slot_bytes]
  int32_t count = 0;
  uint64_t* out = nullptr;  // count checksums
};

// The plain reference: one word at a time, bytes assembled one by one.
void KvBlockChecksumsReference(const KvChecksumParams& p);

}  // namespace tandem::kernels
