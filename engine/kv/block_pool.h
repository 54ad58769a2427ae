// Paged KV cache bookkeeping: a pool of fixed-size blocks with reference counts.
//
// A block holds `block_size` token slots of every layer's K and V. Sequences own block tables
// (lists of block ids); shared prefixes hold the same block in several tables, each holding a
// reference. A block returns to the free list when its last reference drops.
//
// Invariants are checked in every build, not by asserts that release builds compile out: a
// reference taken or dropped on a free block (a use after free, or a double free) or on an id
// outside the pool, and a block that must have one holder (a quarantined one) found with more,
// changes nothing and returns a Status saying which; each one is counted
// (violations(), exported by the workers as tandem_kv_invariant_violations_total) and the last
// kept (last_violation()). Such a call is a caller's bug; the pool stays consistent instead of
// handing one block to two sequences.
// Callers on release paths, which have nothing better to do with the Status, drop it
// (IgnoreError): the violation is already counted, and the worker logs it.
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
  // Ref and Unref: FAILED_PRECONDITION for a free block, OUT_OF_RANGE for an id outside the
  // pool, each counted, and then nothing changes.
  absl::Status Ref(int32_t block);
  // Drops one reference; the block is free again at zero.
  absl::Status Unref(int32_t block);
  // Drops one reference of each; the first violation, if any (every one is counted).
  absl::Status UnrefAll(std::span<const int32_t> blocks);
  // For blocks one holder must own alone (decode's quarantine, where no sequence may read or
  // write them): FAILED_PRECONDITION for each block someone else references too (a quarantined
  // block in use), or that is free or outside the pool, each counted; the first comes back.
  // Changes nothing.
  absl::Status CheckSoleHolder(std::span<const int32_t> blocks, const char* holder);
  int32_t refcount(int32_t block) const {
    return block >= 0 && block < num_blocks() ? refs_[block] : 0;
  }
  uint64_t violations() const { return violations_; }
  const absl::Status& last_violation() const { return last_violation_; }

  // Optional: Allocate/AllocateN reclaim from `r` when the free list is empty. Not owned; the
  // reclaimer must outlive the registration (it unregisters itself with nullptr).
  void SetReclaimer(BlockReclaimer* r) { reclaimer_ = r; }
  // Free blocks plus blocks a reclaimer would give back: what AllocateN can hand out.
  int32_t num_available() const {
    return num_free() + (reclaimer_ != nullptr ? reclaimer_->NumReclaimable() : 0);
  }

 private:
  // OK for a held block in the pool; otherwise the violation, counted and kept.
  absl::Status CheckHeld(int32_t block, const char* verb, const char* bug);
  absl::Status Violation(absl::Status st);

  BlockReclaimer* reclaimer_ = nullptr;
  uint64_t violations_ = 0;
  absl::Status last_violation_;
  std::vector<int32_t> refs_;
  std::vector<int32_t> free_;  // a stack: recently freed blocks are reused first (warm cache)
};

// Chained block hashes: hash[i] = H(hash[i-1], tokens of block i, salt), for full blocks only.
// Two sequences share a block hash exactly when they share every token up to the block's end
// and the salt (tenant), which is what prefix reuse needs.
std::vector<uint64_t> ComputeBlockHashes(std::span<const int32_t> tokens, int32_t block_size,
                                         uint64_t salt, uint64_t parent = 0);

}  // namespace tandem::engine
