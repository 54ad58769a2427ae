// Paged KV cache memory plus its block pool.
//
// Layout is layer-major: for each layer, a K region then a V region, each holding every block
// as [block][slot][kv_head][head_dim]. A layer's blocks are contiguous, so a transfer can send
// one layer of a request as soon as that layer is computed. The memory is one mapping, so a
// transport can register it once.
// Quantised types (kI8, kFp8E4M3): a slot is its codes [kv_head][head_dim] followed by one f32
// scale per kv head (tandem/kernels/kv_quant.h), so slot_bytes() is not slot_elems() *
// elem_bytes(); use slot_bytes() and block_bytes() for offsets. A slot's bytes depend only on
// that token's K (or V), so every writer produces identical blocks and the scales travel with
// any byte range of whole slots.
//
// Threading: not thread-safe; owned by one engine thread. Writes to distinct slots from
// different threads are fine (the engine's kernels do that).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "engine/kv/block_pool.h"
#include "tandem/kernels/dtype.h"

namespace tandem::engine {

struct KvCacheOptions {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 16;
  int32_t num_blocks = 0;
  kernels::DType type = kernels::DType::kF32;  // kF32, kF16, kI8 or kFp8E4M3
  // Memory to use instead of mapping our own, e.g. a region the KV transport allocated so peers
  // can write into it with one-sided puts. At least RequiredBytes(options) long; the caller
  // keeps it alive and unmaps it after the cache is gone.
  void* external_memory = nullptr;
  uint64_t external_bytes = 0;
  // external_memory is accelerator memory (a CUDA engine's pool): the cache hands out its
  // addresses but never reads or writes the bytes on the host, and Write must not be called.
  // Whoever reads KV bytes on the host (checksums, transfers from host memory) checks
  // on_device() first.
  bool device_memory = false;
};

class KvCache {
 public:
  // INVALID_ARGUMENT for a bad shape or type; RESOURCE_EXHAUSTED when memory cannot be mapped.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheOptions& o);
  // Bytes the cache needs for these options (0 for an invalid shape).
  static uint64_t RequiredBytes(const KvCacheOptions& o);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvCacheOptions& options() const { return o_; }
  int32_t block_size() const { return o_.block_size; }
  BlockPool& pool() { return pool_; }
  const BlockPool& pool() const { return pool_; }

  // Elements per token slot (num_kv_heads * head_dim) and bytes per element (per code for a
  // quantised type, whose slots also hold scales).
  int64_t slot_elems() const { return int64_t{o_.num_kv_heads} * o_.head_dim; }
  size_t elem_bytes() const { return ElemBytes(o_.type); }
  // Bytes of one token slot of one layer's K (or V), scales included.
  size_t slot_bytes() const { return SlotBytes(o_); }
  // Bytes of one block of one layer's K (or V).
  size_t block_bytes() const { return o_.block_size * slot_bytes(); }
  static size_t ElemBytes(kernels::DType t);
  static size_t SlotBytes(const KvCacheOptions& o);

  uint8_t* k_layer(int32_t layer) { return base_ + (2 * size_t(layer)) * layer_bytes(); }
  uint8_t* v_layer(int32_t layer) { return base_ + (2 * size_t(layer) + 1) * layer_bytes(); }
  const uint8_t* k_layer(int32_t layer) const {
    return base_ + (2 * size_t(layer)) * layer_bytes();
  }
  const uint8_t* v_layer(int32_t layer) const {
    return base_ + (2 * size_t(layer) + 1) * layer_bytes();
  }
  size_t layer_bytes() const { return size_t(o_.num_blocks) * block_bytes(); }
  // The whole pool; device memory when on_device() (not addressable on the host).
  std::span<uint8_t> memory() { return {base_, size_}; }
  bool on_device() const { return o_.device_memory; }

  // Stores one token's K and V (slot_elems floats each) of `layer` at position `pos` of the
  // sequence whose block table is `blocks`, converting to (or quantising into) the cache type.
  // Host caches only (see KvCacheOptions::device_memory).
  void Write(int32_t layer, std::span<const int32_t> blocks, int64_t pos, const float* k,
             const float* v);

 private:
  KvCache(const KvCacheOptions& o, uint8_t* base, size_t size, bool owned);
  KvCacheOptions o_;
  uint8_t* base_;
  size_t size_;
  bool owned_;
  BlockPool pool_;
};

}  // namespace tandem::engine
