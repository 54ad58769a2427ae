#include "services/common/kv_layout.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "services/common/kv_device.h"
#include "tandem/kernels/kv_checksum.h"
#include "tandem/kernels/kv_quant.h"

namespace tandem::services {

std::string KvDTypeName(const engine::KvCache& kv) {
  return std::string(kernels::KvTypeName(kv.options().type));
}

void FillKvLayout(const engine::KvCache& kv, v1::KvDestination* dst) {
  const engine::KvCacheOptions& o = kv.options();
  dst->set_block_size(o.block_size);
  dst->set_num_layers(o.num_layers);
  dst->set_num_kv_heads(o.num_kv_heads);
  dst->set_head_dim(o.head_dim);
  dst->set_kv_dtype(KvDTypeName(kv));
  dst->set_layer_stride(2 * kv.layer_bytes());
  dst->set_kv_stride(kv.layer_bytes());
  dst->set_block_bytes(kv.block_bytes());
}

absl::Status CheckSameKvShape(const v1::KvDestination& dst, const engine::KvCache& kv) {
  const engine::KvCacheOptions& o = kv.options();
  auto mismatch = [](const char* field, auto theirs, auto ours) {
    return absl::FailedPreconditionError(
        absl::StrCat("KV destination ", field, " is ", theirs, " but this worker's is ", ours,
                     ": prefill and decode must serve the same model with the same KV layout"));
  };
  if (dst.block_size() != o.block_size)
    return mismatch("block_size", dst.block_size(), o.block_size);
  if (dst.num_layers() != o.num_layers)
    return mismatch("num_layers", dst.num_layers(), o.num_layers);
  if (dst.num_kv_heads() != o.num_kv_heads) {
    return mismatch("num_kv_heads", dst.num_kv_heads(), o.num_kv_heads);
  }
  if (dst.head_dim() != o.head_dim) return mismatch("head_dim", dst.head_dim(), o.head_dim);
  if (dst.kv_dtype() != KvDTypeName(kv)) {
    return mismatch("kv_dtype", std::string(dst.kv_dtype()), KvDTypeName(kv));
  }
  if (dst.block_bytes() != kv.block_bytes()) {
    return mismatch("block_bytes", dst.block_bytes(), kv.block_bytes());
  }
  // The remote pool may hold a different number of blocks, so only the strides' consistency
  // can be checked: V follows K within a layer and layers do not overlap.
  if (dst.kv_stride() < dst.block_bytes() || dst.layer_stride() < 2 * dst.kv_stride()) {
    return absl::FailedPreconditionError(
        absl::StrCat("KV destination strides are inconsistent: kv_stride ", dst.kv_stride(),
                     ", layer_stride ", dst.layer_stride(), ", block_bytes ", dst.block_bytes()));
  }
  return absl::OkStatus();
}

int64_t BlocksFor(int64_t num_tokens, int32_t block_size) {
  return (num_tokens + block_size - 1) / block_size;
}

namespace {

// One segment's share of the keyed sum (tandem/kernels/kv_checksum.h), its first word being word
// `g` of the block's stream: whole words loaded unaligned, four independent sums so the
// multiplies overlap, the key advanced by addition (g * M + M == (g + 1) * M).
uint64_t SegmentSum(const uint8_t* p, uint64_t len, uint64_t g) {
  constexpr uint64_t M = kernels::kKvChecksumKeyMul;
  const uint64_t words = len / 8;
  uint64_t key = g * M;
  uint64_t a = 0, b = 0, c = 0, d = 0;
  uint64_t j = 0;
  for (; j + 4 <= words; j += 4, key += 4 * M) {
    uint64_t w[4];
    std::memcpy(w, p + 8 * j, sizeof(w));
    a += kernels::KvChecksumMix(w[0] ^ key);
    b += kernels::KvChecksumMix(w[1] ^ (key + M));
    c += kernels::KvChecksumMix(w[2] ^ (key + 2 * M));
    d += kernels::KvChecksumMix(w[3] ^ (key + 3 * M));
  }
  for (; j < words; ++j, key += M) {
    uint64_t w;
    std::memcpy(&w, p + 8 * j, sizeof(w));
    a += kernels::KvChecksumMix(w ^ key);
  }
  if (const uint64_t tail = len % 8; tail != 0) {
    uint64_t w = 0;  // little-endian, zero-padded (x86-64 and aarch64 are little-endian)
    std::memcpy(&w, p + 8 * words, tail);
    a += kernels::KvChecksumMix(w ^ key);
  }
  return a + b + c + d;
}

}  // namespace

uint64_t RawBlockChecksum(const KvBufferLayout& b, int32_t block, int32_t num_slots) {
  const uint64_t offset = uint64_t(block) * b.block_bytes;
  const uint64_t len = uint64_t(num_slots) * b.slot_bytes;  // quantised slots carry their scales
  const uint64_t w = (len + 7) / 8;                         // words per segment
  uint64_t sum = 0;
  for (uint64_t l = 0; l < uint64_t(b.num_layers); ++l) {
    const uint8_t* k = b.base + l * b.layer_stride + offset;
    sum += SegmentSum(k, len, 2 * l * w);
    sum += SegmentSum(k + b.kv_stride, len, (2 * l + 1) * w);
  }
  return kernels::KvChecksumMix(sum ^
                                ((2 * uint64_t(b.num_layers) * len) * kernels::kKvChecksumLenMul));
}

uint64_t KvBytesChecksum(const uint8_t* p, uint64_t n) {
  return kernels::KvChecksumMix(SegmentSum(p, n, 0) ^ (n * kernels::kKvChecksumLenMul));
}

uint64_t BlockChecksum(const engine::KvCache& kv, int32_t block, int32_t num_slots) {
  KvBufferLayout b;
  b.base = kv.k_layer(0);
  b.layer_stride = 2 * kv.layer_bytes();
  b.kv_stride = kv.layer_bytes();
  b.num_layers = kv.options().num_layers;
  b.block_bytes = kv.block_bytes();
  b.slot_bytes = kv.slot_bytes();
  return RawBlockChecksum(b, block, num_slots);
}

std::vector<uint64_t> SequenceChecksums(const engine::KvCache& kv, std::span<const int32_t> blocks,
                                        int64_t num_tokens) {
  const int32_t bs = kv.block_size();
  const int64_t n = BlocksFor(num_tokens, bs);
  std::vector<uint64_t> out;
  out.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slots = std::min<int64_t>(bs, num_tokens - i * bs);
    out.push_back(BlockChecksum(kv, blocks[i], static_cast<int32_t>(slots)));
  }
  return out;
}

absl::StatusOr<std::vector<uint64_t>> PoolChecksums(const engine::KvCache& kv,
                                                    std::span<const int32_t> blocks,
                                                    int64_t num_tokens) {
  if (kv.on_device()) return DeviceSequenceChecksums(kv, blocks, num_tokens);
  return SequenceChecksums(kv, blocks, num_tokens);
}

}  // namespace tandem::services
