#include "engine/kv/block_pool.h"

#include <algorithm>
#include <set>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

TEST(BlockPoolTest, AllocatesEveryBlockOnceThenReportsExhaustion) {
  BlockPool pool(5);
  std::set<int32_t> got;
  for (int i = 0; i < 5; ++i) got.insert(*pool.Allocate());
  EXPECT_EQ(got.size(), 5u);
  EXPECT_EQ(*got.begin(), 0);
  EXPECT_EQ(*got.rbegin(), 4);
  auto none = pool.Allocate();
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.num_free(), 0);
}

TEST(BlockPoolTest, SharedBlockFreesOnLastUnref) {
  BlockPool pool(2);
  int32_t b = *pool.Allocate();
  ASSERT_TRUE(pool.Ref(b).ok());
  EXPECT_EQ(pool.refcount(b), 2);
  ASSERT_TRUE(pool.Unref(b).ok());
  EXPECT_EQ(pool.num_free(), 1);
  ASSERT_TRUE(pool.Unref(b).ok());
  EXPECT_EQ(pool.num_free(), 2);
}

TEST(BlockPoolTest, AllocateNIsAllOrNothing) {
  BlockPool pool(4);
  auto three = pool.AllocateN(3);
  ASSERT_TRUE(three.ok());
  EXPECT_FALSE(pool.AllocateN(2).ok());
  EXPECT_EQ(pool.num_free(), 1);
  ASSERT_TRUE(pool.UnrefAll(*three).ok());
  EXPECT_EQ(pool.num_free(), 4);
}

// Broken reference-count invariants are refused in every build (no assert to compile out): the
// pool changes nothing, says which, and counts each.
TEST(BlockPoolTest, DoubleFreeUseAfterFreeAndBadIdsAreRefusedAndCounted) {
  BlockPool pool(4);
  const int32_t a = *pool.Allocate();
  const int32_t b = *pool.Allocate();
  ASSERT_TRUE(pool.Ref(a).ok());
  ASSERT_TRUE(pool.Unref(a).ok());
  ASSERT_TRUE(pool.Unref(a).ok());  // a is free now
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_EQ(pool.violations(), 0u);

  const absl::Status twice = pool.Unref(a);  // double free
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(twice.message().find("double free"), std::string::npos) << twice;
  EXPECT_EQ(pool.num_free(), 3) << "the block is not on the free list twice";
  EXPECT_EQ(pool.Ref(a).code(), absl::StatusCode::kFailedPrecondition);  // use after free
  EXPECT_EQ(pool.refcount(a), 0);
  EXPECT_EQ(pool.Unref(7).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(pool.Ref(-1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(pool.violations(), 4u);
  EXPECT_EQ(pool.last_violation().code(), absl::StatusCode::kOutOfRange);

  // Freed twice in one batch: the first violation comes back, both are counted, and the one
  // good release still happens.
  const int32_t blocks[] = {b, b, a};
  EXPECT_EQ(pool.UnrefAll(blocks).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool.violations(), 6u);
  EXPECT_EQ(pool.num_free(), 4);
  // Every block is handed out once more, and only once.
  std::vector<int32_t> all = *pool.AllocateN(4);
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_FALSE(pool.Allocate().ok());
}

// A block that must have one holder (decode's quarantine) found with another reference is a
// quarantined block in use: refused, counted, and nothing changes.
TEST(BlockPoolTest, ASoleHolderCheckCountsSharedFreeAndBadBlocks) {
  BlockPool pool(4);
  const std::vector<int32_t> held = *pool.AllocateN(3);
  EXPECT_TRUE(pool.CheckSoleHolder(held, "a quarantine").ok());
  ASSERT_TRUE(pool.Ref(held[1]).ok());  // someone else takes a reference
  const absl::Status shared = pool.CheckSoleHolder(held, "a quarantine");
  EXPECT_EQ(shared.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(shared.message().find("1 other reference"), std::string::npos) << shared;
  EXPECT_NE(shared.message().find("a quarantine"), std::string::npos) << shared;
  EXPECT_EQ(pool.violations(), 1u);
  EXPECT_EQ(pool.refcount(held[1]), 2) << "the check changes nothing";
  const int32_t odd[] = {held[0], 3, 9};  // 3 is free, 9 is outside the pool
  EXPECT_EQ(pool.CheckSoleHolder(odd, "a quarantine").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool.violations(), 3u);
  EXPECT_EQ(pool.last_violation().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(pool.num_free(), 1);
}

TEST(BlockHashTest, ChainsOverPrefixAndSalt) {
  std::vector<int32_t> a(40), b(40);
  for (int i = 0; i < 40; ++i) a[i] = b[i] = i * 7 + 1;
  b[20] = 999;  // differs in the second block
  auto ha = ComputeBlockHashes(a, 16, 0);
  auto hb = ComputeBlockHashes(b, 16, 0);
  ASSERT_EQ(ha.size(), 2u);  // the partial third block has no hash
  EXPECT_EQ(ha[0], hb[0]);
  EXPECT_NE(ha[1], hb[1]);
  auto salted = ComputeBlockHashes(a, 16, 42);
  EXPECT_NE(salted[0], ha[0]);
  EXPECT_NE(salted[1], ha[1]);
  // Chaining: the second block's hash depends on the first block's tokens.
  std::vector<int32_t> c = a;
  c[0] = 5;
  auto hc = ComputeBlockHashes(c, 16, 0);
  EXPECT_NE(hc[1], ha[1]);
}

}  // namespace
}  // namespace tandem::engine
