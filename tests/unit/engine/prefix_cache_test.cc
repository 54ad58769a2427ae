// PrefixCache bookkeeping on a bare BlockPool: sharing by reference, LRU eviction only when an
// allocation runs dry, tail-first eviction of a chain, and the counters.
#include "engine/kv/prefix_cache.h"

#include <vector>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

TEST(PrefixCacheTest, InsertedBlocksAreMatchedAndShared) {
  BlockPool pool(8);
  PrefixCache cache(&pool);
  auto blocks = *pool.AllocateN(3);
  const std::vector<uint64_t> hashes = {11, 22, 33};
  for (int i = 2; i >= 0; --i) cache.Insert(hashes[i], blocks[i]);
  // The cache holds them; nobody else does, so all three are evictable but not free.
  EXPECT_EQ(pool.num_free(), 5);
  EXPECT_EQ(pool.num_available(), 8);
  EXPECT_EQ(cache.stats().cached_blocks, 3);
  EXPECT_EQ(cache.stats().reclaimable_blocks, 3);

  EXPECT_EQ(cache.Match(std::vector<uint64_t>{11, 22, 99}), 2);
  EXPECT_EQ(cache.Match(std::vector<uint64_t>{99, 11}), 0);  // the run stops at the first miss
  auto got = cache.Acquire(std::vector<uint64_t>{11, 22, 44});
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], blocks[0]);
  EXPECT_EQ(got[1], blocks[1]);
  EXPECT_EQ(pool.refcount(blocks[0]), 2);
  EXPECT_EQ(cache.stats().reclaimable_blocks, 1);
  cache.RecordLookup(3, 2);
  EXPECT_EQ(cache.stats().queries, 3);
  EXPECT_EQ(cache.stats().hits, 2);

  // Handing back a reused block through Insert drops only the caller's reference.
  cache.Insert(22, got[1]);
  cache.Release(got[0]);
  EXPECT_EQ(pool.refcount(blocks[0]), 1);
  EXPECT_EQ(pool.refcount(blocks[1]), 1);
  EXPECT_EQ(cache.stats().reclaimable_blocks, 3);
  EXPECT_EQ(cache.stats().inserts, 3);
}

TEST(PrefixCacheTest, DuplicateHashFreesTheSecondBlock) {
  BlockPool pool(4);
  PrefixCache cache(&pool);
  const int32_t a = *pool.Allocate();
  const int32_t b = *pool.Allocate();
  cache.Insert(7, a);
  cache.Insert(7, b);  // same content computed twice: keep one copy
  EXPECT_TRUE(cache.IsCached(a));
  EXPECT_FALSE(cache.IsCached(b));
  EXPECT_EQ(pool.refcount(b), 0);
  EXPECT_EQ(pool.num_free(), 3);
}

TEST(PrefixCacheTest, EvictsOnlyWhenTheFreeListIsEmptyTailFirst) {
  BlockPool pool(4);
  PrefixCache cache(&pool);
  auto chain = *pool.AllocateN(3);
  for (int i = 2; i >= 0; --i) cache.Insert(100 + i, chain[i]);
  // One free block: used without touching the cache.
  const int32_t x = *pool.Allocate();
  EXPECT_EQ(cache.stats().evictions, 0);
  EXPECT_EQ(cache.Match(std::vector<uint64_t>{100, 101, 102}), 3);
  // The next allocation must evict, and it takes the chain's last block first.
  const int32_t y = *pool.Allocate();
  EXPECT_EQ(y, chain[2]);
  EXPECT_EQ(cache.stats().evictions, 1);
  EXPECT_EQ(cache.Match(std::vector<uint64_t>{100, 101, 102}), 2);
  // A referenced cached block is never evicted: take block 0, then allocation can only get 1.
  auto held = cache.Acquire(std::vector<uint64_t>{100});
  ASSERT_EQ(held.size(), 1u);
  auto two = pool.AllocateN(2);
  EXPECT_FALSE(two.ok());  // all-or-nothing: only chain[1] is reclaimable
  EXPECT_EQ(cache.stats().evictions, 1);
  const int32_t z = *pool.Allocate();
  EXPECT_EQ(z, chain[1]);
  EXPECT_FALSE(pool.Allocate().ok());
  EXPECT_EQ(cache.Match(std::vector<uint64_t>{100}), 1);
  // Release puts it back on the LRU; now it can go too.
  cache.Release(held[0]);
  EXPECT_EQ(*pool.Allocate(), chain[0]);
  EXPECT_EQ(cache.stats().cached_blocks, 0);
  ASSERT_TRUE(pool.UnrefAll(std::vector<int32_t>{x, y, z, chain[0]}).ok());
  EXPECT_EQ(pool.num_free(), 4);
}

TEST(PrefixCacheTest, LeastRecentlyReleasedGoesFirst) {
  BlockPool pool(2);
  PrefixCache cache(&pool);
  const int32_t a = *pool.Allocate();
  const int32_t b = *pool.Allocate();
  cache.Insert(1, a);
  cache.Insert(2, b);
  // Touch a: it becomes the most recently used.
  auto got = cache.Acquire(std::vector<uint64_t>{1});
  cache.Release(got[0]);
  EXPECT_EQ(*pool.Allocate(), b);
  EXPECT_TRUE(cache.IsCached(a));
}

TEST(PrefixCacheTest, DestructionAndClearReturnEveryBlock) {
  BlockPool pool(6);
  {
    PrefixCache cache(&pool);
    auto blocks = *pool.AllocateN(4);
    for (int i = 0; i < 4; ++i) cache.Insert(50 + i, blocks[i]);
    cache.Clear();
    EXPECT_EQ(pool.num_free(), 6);
    EXPECT_EQ(cache.stats().evictions, 4);
    auto again = *pool.AllocateN(2);
    for (int i = 0; i < 2; ++i) cache.Insert(60 + i, again[i]);
    EXPECT_EQ(pool.num_free(), 4);
  }
  EXPECT_EQ(pool.num_free(), 6);
  EXPECT_EQ(pool.num_available(), 6);  // unregistered: no dangling reclaimer
}

}  // namespace
}  // namespace tandem::engine
