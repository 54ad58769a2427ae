// Paged KV cache bookkeeping: a pool of fixed-size blocks with reference counts.
//
// A block holds `block_size` token slots of every layer's K and V. Sequences own block tables
// (lists of block ids); shared prefixes hold the same block in several tables, each holding a
// reference. A block returns to the free list when its last reference drops.
//
// Threading: not thread-safe; the engine's scheduler thread owns it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::engine {

// Something holding blocks it can hand back on demand (the prefix cache's unreferenced cached
// blocks). The pool asks it only when its free list is empty, so cached blocks live as long as
// nothing else needs the memory.
class BlockReclaimer {
 public:
  virtual ~BlockReclaimer() = default;
  // Blocks ReclaimOne could free right now.
  virtual int32_t NumReclaimable() const = 0;
  // Drops the reclaimer's reference on one block so it returns to the pool's free list; false
  // when it holds none it can give up.
  virtual bool ReclaimOne() = 0;
};

class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(refs_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_blocks() - num_free(); }

  // One block with refcount 1; RESOURCE_EXHAUSTED when none is free.
  absl::StatusOr<int32_t> Allocate();
  // n blocks, all or nothing.
  absl::StatusOr<std::vector<int32_t>> AllocateN(int32_t n);
  void Ref(int32_t block);
  // Drops one reference; the block is free again at zero.
  void Unref(int32_t block);
  void UnrefAll(std::span<const int32_t> blocks);
  int32_t refcount(int32_t block) const { return refs_[block]; }

  // Optional: Allocate/AllocateN reclaim from `r` when the free list is empty. Not owned; the
  // reclaimer must outlive the registration (it unregisters itself with nullptr).
  void SetReclaimer(BlockReclaimer* r) { reclaimer_ = r; }
  // Free blocks plus blocks a reclaimer would give back: what AllocateN can hand out.
  int32_t num_available() const {
    return num_free() + (reclaimer_ != nullptr ? reclaimer_->NumReclaimable() : 0);
  }

 private:
  BlockReclaimer* reclaimer_ = nullptr;
  std::vector<int32_t> refs_;
  std::vector<int32_t> free_;  // a stack: recently freed blocks are reused first (warm cache)
};

// Chained block hashes: hash[i] = H(hash[i-1], tokens of block i, salt), for full blocks only.
// Two sequences share a block hash exactly when they share every token up to the block's end
// and the salt (tenant), which is what prefix reuse needs.
std::vector<uint64_t> ComputeBlockHashes(std::span<const int32_t> tokens, int32_t block_size,
                                         uint64_t salt, uint64_t parent = 0);

}  // namespace tandem::engine
