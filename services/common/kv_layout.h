// KV handoff facts shared by the decode worker (which publishes where a request's KV must land)
// and the prefill worker (which writes it there and proves what it wrote).
//
// Layout (engine/kv/kv_cache.h): layer-major; per layer a K region then a V region, each holding
// every block as [block][slot][kv_head][head_dim]. A block's slots are contiguous, so the bytes
// of positions [a, b) of one block of one layer's K (or V) are one contiguous range.
//
// Block checksum: xxh3-64 over the block's K bytes then V bytes of layer 0, then layer 1, ...,
// covering only the first `num_slots` slots (the ones holding prompt positions). A request's last
// block is usually partly filled, and the bytes past the prompt are whatever the pool held
// before on each side, so they are not part of what prefill sent.
//
// Pure functions over a KvCache the caller owns; call them on the thread that owns the cache.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
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

uint64_t BlockChecksum(const engine::KvCache& kv, int32_t block, int32_t num_slots);
// Checksums of the blocks holding positions [0, num_tokens) of a sequence with block table
// `blocks`, in block order (the last one covers only its filled slots).
std::vector<uint64_t> SequenceChecksums(const engine::KvCache& kv, std::span<const int32_t> blocks,
                                        int64_t num_tokens);

}  // namespace tandem::services
