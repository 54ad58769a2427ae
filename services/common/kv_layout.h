// KV handoff facts shared by the decode worker (which publishes where a request's KV must land)
// and the prefill worker (which writes it there and proves what it wrote).
//
// Layout (engine/kv/kv_cache.h): layer-major; per layer a K region then a V region, each holding
// every block as [block][slot][kv_head][head_dim]. A block's slots are contiguous, so the bytes
// of positions [a, b) of one block of one layer's K (or V) are one contiguous range.
//
// Block checksum: the keyed sum of tandem/kernels/kv_checksum.h over the block's K bytes then V
// bytes of layer 0, then layer 1, ..., covering only the first `num_slots` slots (the ones
// holding prompt positions). A request's last block is usually partly filled, and the bytes past
// the prompt are whatever the pool held before on each side, so they are not part of what
// prefill sent. The CUDA kernel (tandem/cuda/kv_checksum.h) computes the same value on the
// device; PoolChecksums picks the one that matches where the pool is.
//
// Pure functions over a KvCache the caller owns; call them on the thread that owns the cache.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/kv/kv_cache.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::services {

// "f32", "f16", "int8" or "fp8", as KvDestination.kv_dtype spells it.
std::string KvDTypeName(const engine::KvCache& kv);

// Fills the layout fields of `dst` (block_size, layers, kv heads, head dim, dtype and the
// strides) from `kv`, whose whole memory() is the registered region.
void FillKvLayout(const engine::KvCache& kv, v1::KvDestination* dst);

// FAILED_PRECONDITION naming the first field where `dst` differs from `kv`'s shape, or where
// its strides cannot describe a pool of that shape.
absl::Status CheckSameKvShape(const v1::KvDestination& dst, const engine::KvCache& kv);

// Number of blocks that hold `num_tokens` positions.
int64_t BlocksFor(int64_t num_tokens, int32_t block_size);

// A host buffer laid out like a pool: layer l's K region at base + l * layer_stride, its V
// region kv_stride after that, block i of a region at i * block_bytes.
struct KvBufferLayout {
  const uint8_t* base = nullptr;
  uint64_t layer_stride = 0;
  uint64_t kv_stride = 0;
  int32_t num_layers = 0;
  uint64_t block_bytes = 0;
  uint64_t slot_bytes = 0;
};
// The production CPU checksum of block `block` of such a buffer (first num_slots slots).
uint64_t RawBlockChecksum(const KvBufferLayout& b, int32_t block, int32_t num_slots);

// The same checksum over n contiguous bytes (one segment): what a full block's checksum is when
// its segments lie end to end, as the kvstore holds blocks and as publishing lays them out.
uint64_t KvBytesChecksum(const uint8_t* p, uint64_t n);

// Host pools only (kv.on_device() false): RawBlockChecksum over the pool.
uint64_t BlockChecksum(const engine::KvCache& kv, int32_t block, int32_t num_slots);
// Checksums of the blocks holding positions [0, num_tokens) of a sequence with block table
// `blocks`, in block order (the last one covers only its filled slots).
// Host pools only.
std::vector<uint64_t> SequenceChecksums(const engine::KvCache& kv, std::span<const int32_t> blocks,
                                        int64_t num_tokens);
// SequenceChecksums for a pool anywhere: computed on the device by the CUDA kernel when
// kv.on_device() (services/common/kv_device.h), on the host otherwise. Errors only from the
// device (INTERNAL with the CUDA error, FAILED_PRECONDITION in a build without CUDA).
absl::StatusOr<std::vector<uint64_t>> PoolChecksums(const engine::KvCache& kv,
                                                    std::span<const int32_t> blocks,
                                                    int64_t num_tokens);

}  // namespace tandem::services
