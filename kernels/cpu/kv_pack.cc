#include "tandem/kernels/kv_pack.h"

#include <cstring>

namespace tandem::kernels {

void PackKvBlocks(const KvPackParams& p, const void* cache, void* packed) {
  const auto* src = static_cast<const uint8_t*>(cache);
  auto* dst = static_cast<uint8_t*>(packed);
  for (int32_t r = 0; r < p.n_regions; ++r) {
    for (int32_t i = 0; i < p.n_blocks; ++i) {
      std::memcpy(dst + (size_t(r) * p.n_blocks + i) * p.block_bytes,
                  src + r * p.region_stride + size_t(p.blocks[i]) * p.block_bytes, p.block_bytes);
    }
  }
}

void UnpackKvBlocks(const KvPackParams& p, const void* packed, void* cache) {
  const auto* src = static_cast<const uint8_t*>(packed);
  auto* dst = static_cast<uint8_t*>(cache);
  for (int32_t r = 0; r < p.n_regions; ++r) {
    for (int32_t i = 0; i < p.n_blocks; ++i) {
      std::memcpy(dst + r * p.region_stride + size_t(p.blocks[i]) * p.block_bytes,
                  src + (size_t(r) * p.n_blocks + i) * p.block_bytes, p.block_bytes);
    }
  }
}

}  // namespace tandem::kernels
