// Prefix cache over the paged KV pool: full blocks stay in memory after their sequence ends,
// keyed by their chained block hash (ComputeBlockHashes: parent hash, tokens, tenant salt), so
// a later request that starts with the same tokens under the same salt reuses their K/V.
//
// Ownership: the cache holds one pool reference on every block it caches. A cached block that
// no sequence uses (refcount 1, the cache's own) sits in an LRU list and is evicted (its last
// reference dropped, so it returns to the free list) only when a pool allocation finds no free
// block: the cache registers itself as the pool's BlockReclaimer. Sequences that reuse a cached
// block take their own reference; it is shared, never written (a sequence only writes past its
// matched prefix, which ends on a block boundary).
//
// Eviction order: callers hand blocks back tail first (Insert/Release in reverse block order),
// so the LRU evicts a chain's last blocks before its first ones and a surviving prefix stays
// matchable.
//
// Threading: not thread-safe; the scheduler thread that owns the pool owns the cache.
// Errors: none; misuse (releasing a block the caller holds no reference on) is a programmer
// error caught by the pool's asserts.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "engine/kv/block_pool.h"

namespace tandem::engine {

struct PrefixCacheStats {
  int64_t queries = 0;             // blocks looked up on admission
  int64_t hits = 0;                // blocks reused instead of recomputed
  int64_t inserts = 0;             // blocks that entered the cache
  int64_t evictions = 0;           // cached blocks given back to the pool under pressure
  int32_t cached_blocks = 0;       // blocks the cache indexes now (in use or not)
  int32_t reclaimable_blocks = 0;  // of those, unreferenced by any sequence (in the LRU)
};

class PrefixCache : public BlockReclaimer {
 public:
  // Registers as `pool`'s reclaimer; `pool` must outlive the cache.
  explicit PrefixCache(BlockPool* pool);
  // Drops every cached block's reference and unregisters from the pool.
  ~PrefixCache() override;
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // Number of leading `hashes` cached, without taking references or counting a query.
  int32_t Match(std::span<const uint64_t> hashes) const;
  // Finds the longest cached run of leading `hashes` and takes one reference on each of its
  // blocks for the caller, in order. Counts nothing: call RecordLookup once the caller commits
  // (admission can still fail and hand the blocks back with Release).
  std::vector<int32_t> Acquire(std::span<const uint64_t> hashes);
  void RecordLookup(int64_t queried, int64_t hit);

  // Hands the caller's reference on `block`, which holds the full block whose chained hash is
  // `hash`, to the cache. If the hash is already cached in another block (two sequences computed
  // the same prefix), the caller's block is simply released.
  void Insert(uint64_t hash, int32_t block);
  // Drops the caller's reference on `block`, cached or not; a cached block left with only the
  // cache's reference becomes evictable (most recently used).
  void Release(int32_t block);
  // Evicts every unreferenced cached block.
  void Clear();

  bool IsCached(int32_t block) const { return entries_[block].cached; }
  PrefixCacheStats stats() const;

  // BlockReclaimer.
  int32_t NumReclaimable() const override { return static_cast<int32_t>(lru_.size()); }
  bool ReclaimOne() override;

 private:
  struct Entry {
    bool cached = false;
    bool in_lru = false;
    uint64_t hash = 0;
    std::list<int32_t>::iterator lru_it;
  };
  void Evict(int32_t block);

  BlockPool* pool_;
  std::vector<Entry> entries_;  // by block id
  absl::flat_hash_map<uint64_t, int32_t> by_hash_;
  std::list<int32_t> lru_;  // front: least recently used
  PrefixCacheStats stats_;
};

}  // namespace tandem::engine
