#include "services/common/kv_layout.h"

#include <xxhash.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
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

uint64_t BlockChecksum(const engine::KvCache& kv, int32_t block, int32_t num_slots) {
  const size_t offset = size_t(block) * kv.block_bytes();
  const size_t len = size_t(num_slots) * kv.slot_bytes();  // quantised slots carry their scales
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (int32_t l = 0; l < kv.options().num_layers; ++l) {
    XXH3_64bits_update(state, kv.k_layer(l) + offset, len);
    XXH3_64bits_update(state, kv.v_layer(l) + offset, len);
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
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

}  // namespace tandem::services
