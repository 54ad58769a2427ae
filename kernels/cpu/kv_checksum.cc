// Plain reference of the KV block checksum (tandem/kernels/kv_checksum.h): written for
// obviousness, not speed; the production CPU version and the CUDA kernel are checked against it.
#include "tandem/kernels/kv_checksum.h"

namespace tandem::kernels {
void KvBlockChecksumsReference(const KvChecksumParams& p) {
  for (int32_t i = 0; i < p.count; ++i) {
    const uint64_t len = uint64_t(p.num_slots[i]) * p.slot_bytes;
    const uint64_t words_per_segment = (len + 7) / 8;
    uint64_t sum = 0;
    for (uint64_t s = 0; s < 2 * uint64_t(p.num_layers); ++s) {
      const uint8_t* seg = p.pool + (s / 2) * p.layer_stride + (s % 2) * p.kv_stride +
                           uint64_t(p.blocks[i]) * p.block_bytes;
      for (uint64_t j = 0; 8 * j < len; ++j) {
        uint64_t w = 0;
        for (uint64_t b = 0; b < 8 && 8 * j + b < len; ++b) {
          w |= uint64_t(seg[8 * j + b]) << (8 * b);
        }
        const uint64_t g = s * words_per_segment + j;
        sum += KvChecksumMix(w ^ (g * kKvChecksumKeyMul));
      }
    }
    const uint64_t total = 2 * uint64_t(p.num_layers) * len;
    p.out[i] = KvChecksumMix(sum ^ (total * kKvChecksumLenMul));
  }
}

}  // namespace tandem::kernels
