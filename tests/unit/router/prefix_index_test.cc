// The router's prefix index and the KV-aware prefill choice built on it.
#include "services/router/prefix_index.h"

#include <random>

#include "engine/kv/block_pool.h"
#include "gtest/gtest.h"
#include "services/router/auth.h"
#include "services/router/worker_registry.h"

namespace tandem::router {
namespace {

std::vector<uint64_t> Hashes(int blocks, uint32_t seed, uint64_t salt) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(16 * blocks);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 32000);
  return engine::ComputeBlockHashes(tokens, 16, salt);
}

TEST(PrefixIndexTest, OverlapIsTheLeadingRunAWorkerHolds) {
  PrefixIndex idx;
  const std::vector<uint64_t> h = Hashes(8, 1, 0);
  idx.RecordWorker("p0", std::span(h).first(5));
  idx.RecordWorker("p1", std::span(h).first(2));
  EXPECT_EQ(idx.WorkerOverlap("p0", h), 5);
  EXPECT_EQ(idx.WorkerOverlap("p1", h), 2);
  EXPECT_EQ(idx.WorkerOverlap("p2", h), 0);
  // A gap ends the run: block 0 unknown means nothing is reusable.
  const std::vector<uint64_t> gap = {h[0] ^ 1, h[1], h[2]};
  EXPECT_EQ(idx.WorkerOverlap("p0", gap), 0);
  // Another tenant's hashes of the same tokens are other blocks.
  EXPECT_EQ(idx.WorkerOverlap("p0", Hashes(8, 1, TenantSalt("", "other"))), 0);
  idx.ForgetWorker("p0");
  EXPECT_EQ(idx.WorkerOverlap("p0", h), 0);
  EXPECT_EQ(idx.WorkerOverlap("p1", h), 2);
  EXPECT_EQ(idx.size(), 2u);
}

TEST(PrefixIndexTest, ChooseTradesOverlapAgainstLoad) {
  PrefixIndexOptions o;
  o.overlap_weight = 1.0;
  o.store_weight = 0.5;
  PrefixIndex idx(o);
  const std::vector<uint64_t> h = Hashes(10, 2, 0);
  idx.RecordWorker("p1", std::span(h).first(6));
  std::vector<PrefixCandidate> c = {{"p0", 0}, {"p1", 0}};
  EXPECT_EQ(idx.Choose(c, h), 1);
  EXPECT_DOUBLE_EQ(idx.Score(c[1], h), 6.0);
  // Loaded enough, the cache no longer pays for the wait.
  c[1].load = 7;
  EXPECT_EQ(idx.Choose(c, h), 0);
  c[1].load = 5;
  EXPECT_EQ(idx.Choose(c, h), 1);
  // Store-held blocks count for everyone, at their weight, after a worker's own run.
  idx.RecordStore(std::span(h).first(8));
  EXPECT_DOUBLE_EQ(idx.Score({"p0", 0}, h), 4.0);        // 8 store blocks * 0.5
  EXPECT_DOUBLE_EQ(idx.Score({"p1", 0}, h), 6.0 + 1.0);  // 6 own + 2 store * 0.5
  EXPECT_EQ(idx.Choose({}, h), -1);
}

TEST(PrefixIndexTest, ForgetsTheLeastRecentlyRecordedPastItsCapacity) {
  PrefixIndexOptions o;
  o.max_blocks = 4;
  PrefixIndex idx(o);
  const std::vector<uint64_t> a = Hashes(3, 3, 0), b = Hashes(3, 4, 0);
  idx.RecordWorker("p0", a);
  idx.RecordWorker("p0", b);
  EXPECT_EQ(idx.size(), 4u);
  EXPECT_EQ(idx.WorkerOverlap("p0", a), 0);  // a[0], a[1] were dropped
  EXPECT_EQ(idx.WorkerOverlap("p0", b), 3);
}

TEST(PrefixIndexTest, SetWorkersSizesTheIndexFromTheirKvPoolsAndForgetsTheDeparted) {
  PrefixIndexOptions o;
  o.min_blocks = 8;
  o.max_blocks = 1000;
  o.blocks_per_worker_block = 2.0;
  PrefixIndex idx(o);
  EXPECT_EQ(idx.capacity(), 1000u);  // unsized: max_blocks
  const std::vector<uint64_t> a = Hashes(20, 5, 0), b = Hashes(20, 6, 0);
  idx.RecordWorker("p0", a);
  idx.RecordWorker("p1", b);
  ASSERT_EQ(idx.size(), 40u);

  // p0 has left (not listed): its entries go; p1's 6 blocks size the index to 12 hashes, the
  // most recently recorded ones (b's tail).
  const std::vector<PrefixWorker> w = {{"p1", 6}};
  idx.SetWorkers(w);
  EXPECT_EQ(idx.capacity(), 12u);
  EXPECT_EQ(idx.size(), 12u);
  EXPECT_EQ(idx.WorkerOverlap("p0", a), 0);
  EXPECT_EQ(idx.WorkerOverlap("p1", b), 0);  // b[0..7] were the least recently recorded
  EXPECT_EQ(idx.WorkerOverlap("p1", std::span(b).subspan(8)), 12);

  // A steady stream of new prompts never grows it past the capacity.
  for (uint32_t seed = 100; seed < 300; ++seed) {
    idx.RecordWorker("p1", Hashes(3, seed, 0));
    ASSERT_LE(idx.size(), 12u);
  }
  // Bounds: at least min_blocks, at most max_blocks; negative or no pools count as 0.
  idx.SetWorkers({});
  EXPECT_EQ(idx.capacity(), 8u);
  EXPECT_EQ(idx.size(), 0u);  // p1 gone too, and nothing was store-held
  const std::vector<PrefixWorker> big = {{"p2", 400}, {"p3", 300}, {"p4", -5}};
  idx.SetWorkers(big);
  EXPECT_EQ(idx.capacity(), 1000u);
  // A departed worker's slot is reused by a new one, which starts with nothing.
  idx.RecordWorker("p5", a);
  EXPECT_EQ(idx.WorkerOverlap("p5", a), 20);
  EXPECT_EQ(idx.WorkerOverlap("p0", a), 0);
}

TEST(PrefixIndexTest, StoreHeldBlocksOutliveTheWorkerThatRecordedThem) {
  PrefixIndex idx;
  const std::vector<uint64_t> h = Hashes(6, 7, 0);
  idx.RecordWorker("p0", h);
  idx.RecordStore(std::span(h).first(4));
  idx.SetWorkers({});
  EXPECT_EQ(idx.size(), 4u);
  EXPECT_DOUBLE_EQ(idx.Score({"p9", 0}, h), 4 * 0.5);
}

v1::RegisterRequest Prefill(const std::string& id) {
  v1::RegisterRequest r;
  r.set_worker_id(id);
  r.set_role(v1::WORKER_ROLE_PREFILL);
  r.set_address(id + ":1");
  r.set_kv_blocks_total(100);
  return r;
}

TEST(KvAwarePickTest, RegistryPicksTheWorkerHoldingThePrefix) {
  Policy p;
  ASSERT_TRUE(ParsePolicy("kv-aware", &p).ok());
  EXPECT_EQ(p, Policy::kKvAware);
  EXPECT_STREQ(PolicyName(p), "kv-aware");
  RegistryOptions ro;
  ro.policy = Policy::kKvAware;
  WorkerRegistry reg(ro);
  ASSERT_TRUE(reg.Register(Prefill("p0")).ok());
  ASSERT_TRUE(reg.Register(Prefill("p1")).ok());
  PrefixIndex idx;
  const std::vector<uint64_t> h = Hashes(6, 5, TenantSalt("", "t"));
  idx.RecordWorker("p1", h);
  auto score = [&](const std::string& id, double load) { return idx.Score({id, load}, h); };
  // The same conversation keeps landing where its prefix is, as long as load allows.
  std::vector<Assignment> held;
  for (int i = 0; i < 6; ++i) {
    Assignment a = reg.PickScored(Pool::kPrefill, 0, {}, score);
    ASSERT_TRUE(a);
    EXPECT_EQ(a.worker_id(), "p1") << i;
    held.push_back(std::move(a));
  }
  // Six requests in flight on p1 weigh as much as six cached blocks: the tie goes to the least
  // recently picked, p0.
  held.push_back(reg.PickScored(Pool::kPrefill, 0, {}, score));
  EXPECT_EQ(held.back().worker_id(), "p0");
  // An unrelated prompt spreads by load.
  held.clear();
  const std::vector<uint64_t> other = Hashes(6, 6, TenantSalt("", "t"));
  auto score2 = [&](const std::string& id, double load) { return idx.Score({id, load}, other); };
  Assignment a0 = reg.PickScored(Pool::kPrefill, 0, {}, score2);
  Assignment a1 = reg.PickScored(Pool::kPrefill, 0, {}, score2);
  EXPECT_NE(a0.worker_id(), a1.worker_id());
  // Excluded workers are skipped.
  Assignment x = reg.PickScored(Pool::kPrefill, 0, {"p1"}, score);
  EXPECT_EQ(x.worker_id(), "p0");
}

}  // namespace
}  // namespace tandem::router
