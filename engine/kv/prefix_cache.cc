#include "engine/kv/prefix_cache.h"

#include <cassert>

namespace tandem::engine {

PrefixCache::PrefixCache(BlockPool* pool) : pool_(pool), entries_(pool->num_blocks()) {
  pool_->SetReclaimer(this);
}

PrefixCache::~PrefixCache() {
  pool_->SetReclaimer(nullptr);
  for (int32_t b = 0; b < static_cast<int32_t>(entries_.size()); ++b) {
    if (entries_[b].cached) pool_->Unref(b).IgnoreError();
  }
}

int32_t PrefixCache::Match(std::span<const uint64_t> hashes) const {
  int32_t n = 0;
  for (uint64_t h : hashes) {
    if (!by_hash_.contains(h)) break;
    ++n;
  }
  return n;
}

std::vector<int32_t> PrefixCache::Acquire(std::span<const uint64_t> hashes) {
  std::vector<int32_t> out;
  for (uint64_t h : hashes) {
    auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    const int32_t b = it->second;
    Entry& e = entries_[b];
    if (e.in_lru) {
      lru_.erase(e.lru_it);
      e.in_lru = false;
    }
    pool_->Ref(b).IgnoreError();
    out.push_back(b);
  }
  return out;
}

void PrefixCache::RecordLookup(int64_t queried, int64_t hit) {
  stats_.queries += queried;
  stats_.hits += hit;
}

void PrefixCache::Insert(uint64_t hash, int32_t block) {
  Entry& e = entries_[block];
  if (!e.cached) {
    auto [it, inserted] = by_hash_.try_emplace(hash, block);
    if (inserted) {
      // The caller's reference becomes the cache's.
      e.cached = true;
      e.hash = hash;
      ++stats_.inserts;
      if (pool_->refcount(block) == 1) {
        e.lru_it = lru_.insert(lru_.end(), block);
        e.in_lru = true;
      }
      return;
    }
  }
  // Already cached (this very block, reused from the cache, or a twin computed by another
  // sequence): the caller's reference is surplus.
  Release(block);
}

void PrefixCache::Release(int32_t block) {
  Entry& e = entries_[block];
  assert(!e.in_lru);  // an LRU block has no reference besides the cache's to release
  pool_->Unref(block).IgnoreError();
  if (e.cached && pool_->refcount(block) == 1) {
    e.lru_it = lru_.insert(lru_.end(), block);
    e.in_lru = true;
  }
}

void PrefixCache::Evict(int32_t block) {
  Entry& e = entries_[block];
  assert(e.in_lru && pool_->refcount(block) == 1);
  lru_.erase(e.lru_it);
  by_hash_.erase(e.hash);
  e = Entry{};
  ++stats_.evictions;
  pool_->Unref(block).IgnoreError();
}

bool PrefixCache::ReclaimOne() {
  if (lru_.empty()) return false;
  Evict(lru_.front());
  return true;
}

void PrefixCache::Clear() {
  while (ReclaimOne()) {
  }
}

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s = stats_;
  s.cached_blocks = static_cast<int32_t>(by_hash_.size());
  s.reclaimable_blocks = static_cast<int32_t>(lru_.size());
  return s;
}

}  // namespace tandem::engine
