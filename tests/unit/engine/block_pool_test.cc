#include "engine/kv/block_pool.h"

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
  pool.Ref(b);
  EXPECT_EQ(pool.refcount(b), 2);
  pool.Unref(b);
  EXPECT_EQ(pool.num_free(), 1);
  pool.Unref(b);
  EXPECT_EQ(pool.num_free(), 2);
}

TEST(BlockPoolTest, AllocateNIsAllOrNothing) {
  BlockPool pool(4);
  auto three = pool.AllocateN(3);
  ASSERT_TRUE(three.ok());
  EXPECT_FALSE(pool.AllocateN(2).ok());
  EXPECT_EQ(pool.num_free(), 1);
  pool.UnrefAll(*three);
  EXPECT_EQ(pool.num_free(), 4);
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
