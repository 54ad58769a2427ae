// Gathers a request's KV blocks out of the paged cache into one contiguous buffer, and scatters
// such a buffer back: what a transfer sends instead of one message per block.
//
// The cache (engine/kv/kv_cache.h) is a run of regions, K of layer 0, V of layer 0, K of layer
// 1, ..., each `region_stride` bytes apart and holding blocks of `block_bytes`. A request owns
// blocks[0..n_blocks) in every region. The packed layout is [region][i][block_bytes]: region r's
// copy of blocks[i] at (r * n_blocks + i) * block_bytes, so one layer's K and V are contiguous
// and can be sent as soon as that layer is done. Any block_bytes works (f32/f16 or quantised
// slots); the CUDA version (tandem/cuda/kv_blocks.h) produces the same bytes.
// Pure functions on caller-owned memory; thread-safe. Block ids are trusted (callers validate
// them against the cache size).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tandem::kernels {

struct KvPackParams {
  size_t region_stride = 0;  // bytes from one region's start to the next (a layer's K or V)
  int32_t n_regions = 0;     // 2 * layers for a whole request
  size_t block_bytes = 0;
  const int32_t* blocks = nullptr;  // n_blocks block ids (device memory for the CUDA version)
  int32_t n_blocks = 0;
};

inline size_t KvPackedBytes(const KvPackParams& p) {
  return size_t(p.n_regions) * size_t(p.n_blocks) * p.block_bytes;
}

// cache: the first region's start. packed: KvPackedBytes(p) bytes.
void PackKvBlocks(const KvPackParams& p, const void* cache, void* packed);
void UnpackKvBlocks(const KvPackParams& p, const void* packed, void* cache);

}  // namespace tandem::kernels
