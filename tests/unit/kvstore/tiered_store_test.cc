// The TieredStore's policy: LRU demotion device -> host -> SSD at the watermarks, the
// frequency filter in front of SSD, promotion on a hit, prefix lookup, restart and integrity.
#include "services/kvstore/tiered_store.h"

#include <map>
#include <random>
#include <set>
#include <thread>

#include "engine/kv/block_pool.h"
#include "gtest/gtest.h"
#include "services/kvstore/memory_tiers.h"
#include "services/kvstore/metrics.h"
#include "tests/unit/kvstore/test_util.h"

namespace tandem::kvstore {
namespace {

using testing::RandomBytes;
using testing::ScratchDir;

constexpr uint64_t kSlot = 1024;
constexpr size_t kPayload = 1000;

// Device: 4 slots. Host: 4 blocks. SSD: plenty. Watermarks at 100% (pure LRU) unless changed.
TieredStoreConfig SmallConfig(const std::string& dir) {
  TieredStoreConfig c;
  c.device_slot_bytes = kSlot;
  c.device = {4 * kSlot, 1.0, 1.0};
  c.host = {4 * kPayload, 1.0, 1.0};
  c.ssd = {1 << 20, 1.0, 1.0};
  c.ssd_dir = dir;
  c.ssd_min_hits = 1;
  return c;
}

class TieredStoreTest : public ::testing::Test {
 protected:
  std::unique_ptr<TieredStore> Make(const TieredStoreConfig& c) {
    auto s = TieredStore::Create(c);
    EXPECT_TRUE(s.ok()) << s.status();
    return std::move(*s);
  }
  // Puts block i (hash 1000 + i) with fresh random bytes and remembers them.
  void PutBlock(TieredStore& s, int i) {
    want_[Hash(i)] = RandomBytes(rng_, kPayload);
    ASSERT_TRUE(s.Put(Hash(i), want_[Hash(i)]).ok());
  }
  static uint64_t Hash(int i) { return 1000 + i; }
  std::optional<TierKind> Where(const TieredStore& s, int i) { return s.Where(Hash(i)); }

  ScratchDir dir_;
  std::mt19937_64 rng_{11};
  std::map<uint64_t, std::vector<uint8_t>> want_;
};

TEST_F(TieredStoreTest, RoundTripLandsOnTheTopTier) {
  auto s = Make(SmallConfig(dir_.path()));
  for (int i = 0; i < 3; ++i) PutBlock(*s, i);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(Where(*s, i), TierKind::kDevice);
    auto got = s->Get(Hash(i));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, want_[Hash(i)]);
  }
  EXPECT_EQ(s->Get(42).status().code(), absl::StatusCode::kNotFound);
  const TieredStoreStats st = s->stats();
  EXPECT_EQ(st.tiers[0].hits, 3);
  EXPECT_EQ(st.tiers[0].misses, 1);
  EXPECT_EQ(st.tiers[2].misses, 1);
  EXPECT_EQ(st.tiers[0].blocks, 3);
  EXPECT_EQ(st.tiers[0].used_bytes, 3 * kSlot);
  EXPECT_NE(st.tiers[0].name.find(DeviceTierLabel()), std::string::npos);
  EXPECT_EQ(st.tiers[0].label, DeviceTierLabel());
  EXPECT_EQ(st.puts, 3);
  EXPECT_EQ(st.gets, 4);
}

TEST_F(TieredStoreTest, DemotesLruDownwardsAndFiltersColdBlocksFromSsd) {
  auto s = Make(SmallConfig(dir_.path()));
  for (int i = 0; i < 4; ++i) PutBlock(*s, i);
  // Touch block 1 twice so it is hot enough for SSD and recent; block 0 is never read.
  ASSERT_TRUE(s->Get(Hash(1)).ok());
  ASSERT_TRUE(s->Get(Hash(1)).ok());
  // Block 4 pushes the least recently used (0) to host.
  PutBlock(*s, 4);
  EXPECT_EQ(Where(*s, 0), TierKind::kHost);
  EXPECT_EQ(Where(*s, 1), TierKind::kDevice);
  // Four more: device keeps the newest four; host takes 2, 3, 1 and 4 in LRU order, so 0
  // (never hit) falls off host and is dropped, not written to SSD.
  for (int i = 5; i < 9; ++i) PutBlock(*s, i);
  for (int i = 5; i < 9; ++i) EXPECT_EQ(Where(*s, i), TierKind::kDevice) << i;
  EXPECT_EQ(Where(*s, 0), std::nullopt);
  EXPECT_EQ(s->stats().dropped_cold, 1);
  // One more: host evicts 2 (cold, dropped) ... then 3 (cold) and 1 (hot) as more arrive.
  for (int i = 9; i < 12; ++i) PutBlock(*s, i);
  EXPECT_EQ(Where(*s, 1), TierKind::kSsd);
  EXPECT_EQ(Where(*s, 2), std::nullopt);
  EXPECT_EQ(Where(*s, 3), std::nullopt);
  const TieredStoreStats st = s->stats();
  EXPECT_EQ(st.dropped_cold, 3);
  EXPECT_EQ(st.tiers[1].demoted_in, 8);
  EXPECT_EQ(st.tiers[2].demoted_in, 1);
  EXPECT_EQ(st.tiers[2].blocks, 1);
  EXPECT_EQ(st.tiers[0].blocks, 4);
  EXPECT_EQ(st.tiers[1].blocks, 4);
  // Every block still stored reads back exactly.
  for (const auto& [h, bytes] : want_) {
    if (!s->Contains(h)) continue;
    auto got = s->Get(h);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, bytes);
  }
}

TEST_F(TieredStoreTest, HitsInLowerTiersPromoteToTheTop) {
  auto s = Make(SmallConfig(dir_.path()));
  PutBlock(*s, 0);
  ASSERT_TRUE(s->Get(Hash(0)).ok());  // hot: may go to SSD
  for (int i = 1; i < 9; ++i) PutBlock(*s, i);
  ASSERT_EQ(Where(*s, 0), TierKind::kSsd);
  ASSERT_EQ(Where(*s, 5), TierKind::kDevice);
  ASSERT_EQ(Where(*s, 2), TierKind::kHost);

  // Host hit: moves up, leaves host.
  auto from_host = s->Get(Hash(2));
  ASSERT_TRUE(from_host.ok());
  EXPECT_EQ(*from_host, want_[Hash(2)]);
  EXPECT_EQ(Where(*s, 2), TierKind::kDevice);
  EXPECT_FALSE(s->tier(TierKind::kHost)->Contains(Hash(2)));
  // SSD hit: moves up and the SSD keeps its durable copy.
  auto from_ssd = s->Get(Hash(0));
  ASSERT_TRUE(from_ssd.ok());
  EXPECT_EQ(*from_ssd, want_[Hash(0)]);
  EXPECT_EQ(Where(*s, 0), TierKind::kDevice);
  EXPECT_TRUE(s->tier(TierKind::kSsd)->Contains(Hash(0)));
  const TieredStoreStats st = s->stats();
  EXPECT_EQ(st.tiers[1].hits, 1);
  EXPECT_EQ(st.tiers[1].promoted_out, 1);
  EXPECT_EQ(st.tiers[2].hits, 1);
  EXPECT_EQ(st.tiers[2].promoted_out, 1);
  EXPECT_EQ(st.tiers[0].misses, 2);
  EXPECT_EQ(st.tiers[1].misses, 1);  // the SSD read looked past host
  EXPECT_EQ(st.tiers[0].blocks, 4);  // promotions demoted others to make room
}

TEST_F(TieredStoreTest, WatermarksDemoteDownToTheLowMark) {
  TieredStoreConfig c = SmallConfig(dir_.path());
  c.device = {4 * kSlot, 0.75, 0.5};
  auto s = Make(c);
  for (int i = 0; i < 3; ++i) PutBlock(*s, i);
  EXPECT_EQ(s->stats().tiers[0].blocks, 3);  // 75% is not above the high mark
  PutBlock(*s, 3);                           // 100%: back down to 50%
  const TieredStoreStats st = s->stats();
  EXPECT_EQ(st.tiers[0].blocks, 2);
  EXPECT_EQ(st.tiers[1].blocks, 2);
  EXPECT_EQ(Where(*s, 0), TierKind::kHost);
  EXPECT_EQ(Where(*s, 1), TierKind::kHost);
  EXPECT_EQ(Where(*s, 3), TierKind::kDevice);
}

TEST_F(TieredStoreTest, LookupPrefixReportsTheLeadingRunAndItsTiers) {
  auto s = Make(SmallConfig(dir_.path()));
  // Real chained hashes of a token sequence: 6 blocks.
  std::vector<int32_t> tokens(96);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(rng_() % 32000);
  const std::vector<uint64_t> h = engine::ComputeBlockHashes(tokens, 16, /*salt=*/5);
  ASSERT_EQ(h.size(), 6u);
  for (int i = 0; i < 5; ++i) {
    const auto bytes = RandomBytes(rng_, kPayload);
    ASSERT_TRUE(s->Put(h[i], bytes).ok());
  }
  // 5 blocks in a 4-slot device: h[0] went to host.
  PrefixMatch m = s->LookupPrefix(h);
  EXPECT_EQ(m.matched, 5);
  ASSERT_EQ(m.tiers.size(), 5u);
  EXPECT_EQ(m.tiers[0], TierKind::kHost);
  for (int i = 1; i < 5; ++i) EXPECT_EQ(m.tiers[i], TierKind::kDevice);
  ASSERT_TRUE(s->Erase(h[2]).ok());
  m = s->LookupPrefix(h);
  EXPECT_EQ(m.matched, 2);  // the run stops at the first gap
  EXPECT_EQ(s->LookupPrefix(std::vector<uint64_t>{h[5], h[0]}).matched, 0);
  // Another salt gives other hashes: nothing matches.
  EXPECT_EQ(s->LookupPrefix(engine::ComputeBlockHashes(tokens, 16, 6)).matched, 0);
}

TEST_F(TieredStoreTest, SsdBlocksSurviveARestart) {
  TieredStoreConfig c = SmallConfig(dir_.path());
  c.ssd_min_hits = 0;  // everything demoted from host goes to SSD
  {
    auto s = Make(c);
    for (int i = 0; i < 12; ++i) PutBlock(*s, i);
    EXPECT_EQ(s->stats().tiers[2].blocks, 4);  // 0..3 went all the way down
  }
  auto s = Make(c);
  const TieredStoreStats st = s->stats();
  EXPECT_EQ(st.tiers[2].blocks, 4);
  EXPECT_EQ(st.tiers[0].blocks, 0);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(Where(*s, i), TierKind::kSsd) << i;
    auto got = s->Get(Hash(i));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, want_[Hash(i)]);
  }
  EXPECT_EQ(Where(*s, 5), std::nullopt);  // memory tiers do not survive, by design
}

TEST_F(TieredStoreTest, CorruptSsdBlockIsAMissAndCounted) {
  TieredStoreConfig c = SmallConfig(dir_.path());
  c.ssd_min_hits = 0;
  auto s = Make(c);
  for (int i = 0; i < 9; ++i) PutBlock(*s, i);
  ASSERT_EQ(Where(*s, 0), TierKind::kSsd);
  const auto* ssd = static_cast<const SsdTier*>(s->tier(TierKind::kSsd));
  ASSERT_TRUE(testing::FlipPayloadByte(ssd->PathFor(Hash(0)), 500));
  auto got = s->Get(Hash(0));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  EXPECT_FALSE(s->Contains(Hash(0)));
  EXPECT_EQ(s->Get(Hash(0)).status().code(), absl::StatusCode::kNotFound);
  const TieredStoreStats st = s->stats();
  EXPECT_EQ(st.tiers[2].integrity_failures, 1);
  EXPECT_EQ(st.tiers[0].integrity_failures, 0);
  EXPECT_EQ(*s->Get(Hash(8)), want_[Hash(8)]);
}

TEST_F(TieredStoreTest, GetPrefixIsTheSameAsGetsOneByOne) {
  TieredStoreConfig c = SmallConfig(dir_.path());
  c.ssd_min_hits = 0;
  auto s = Make(c);
  ScratchDir twin_dir;  // a second store with the same blocks, read with Where + Get
  TieredStoreConfig tc = c;
  tc.ssd_dir = twin_dir.path() + "/twin";
  auto twin = Make(tc);
  for (int i = 0; i < 12; ++i) {
    PutBlock(*s, i);
    ASSERT_TRUE(twin->Put(Hash(i), want_[Hash(i)]).ok());
  }
  // 0-3 on SSD, 4-7 in host, 8-11 on the device; reads in this order promote some and push
  // others down on the way, so later blocks are found where the earlier reads left them.
  ASSERT_EQ(Where(*s, 0), TierKind::kSsd);
  ASSERT_EQ(Where(*s, 5), TierKind::kHost);
  ASSERT_EQ(Where(*s, 9), TierKind::kDevice);
  std::vector<uint64_t> ask;
  for (int i : {9, 0, 5, 1, 2, 3, 6, 99, 10}) ask.push_back(Hash(i));  // 99: absent
  absl::Status stop;
  const std::vector<TieredStore::Found> found = s->GetPrefix(ask, &stop);
  EXPECT_EQ(stop.code(), absl::StatusCode::kNotFound) << stop;
  ASSERT_EQ(found.size(), 7u);
  std::set<TierKind> seen;
  for (size_t i = 0; i < found.size(); ++i) {
    const std::optional<TierKind> where = twin->Where(ask[i]);
    absl::StatusOr<std::vector<uint8_t>> one = twin->Get(ask[i]);
    ASSERT_TRUE(one.ok()) << one.status();
    EXPECT_EQ(found[i].data, *one) << i;
    EXPECT_EQ(found[i].data, want_[ask[i]]) << i;
    EXPECT_EQ(found[i].tier, *where) << i;
    seen.insert(found[i].tier);
  }
  EXPECT_EQ(seen.size(), 3u) << "the run should be served from all three tiers";
  EXPECT_EQ(twin->Get(Hash(99)).status().code(), absl::StatusCode::kNotFound);
  // The same counts and the same placement afterwards; the block after the absent one unread.
  const TieredStoreStats a = s->stats(), b = twin->stats();
  EXPECT_EQ(a.gets, 8);
  EXPECT_EQ(a.gets, b.gets);
  for (int t = 0; t < kNumTiers; ++t) {
    EXPECT_EQ(a.tiers[t].hits, b.tiers[t].hits) << t;
    EXPECT_EQ(a.tiers[t].misses, b.tiers[t].misses) << t;
    EXPECT_EQ(a.tiers[t].promoted_out, b.tiers[t].promoted_out) << t;
    EXPECT_EQ(a.tiers[t].blocks, b.tiers[t].blocks) << t;
  }
  for (int i = 0; i < 12; ++i) EXPECT_EQ(Where(*s, i), twin->Where(Hash(i))) << i;
  // A run read in full says OK.
  const std::vector<uint64_t> two = {Hash(6), Hash(3)};
  ASSERT_EQ(s->GetPrefix(two, &stop).size(), 2u);
  EXPECT_TRUE(stop.ok()) << stop;
}

TEST_F(TieredStoreTest, GetPrefixStopsAtACorruptSsdBlock) {
  TieredStoreConfig c = SmallConfig(dir_.path());
  c.ssd_min_hits = 0;
  auto s = Make(c);
  for (int i = 0; i < 12; ++i) PutBlock(*s, i);
  const auto* ssd = static_cast<const SsdTier*>(s->tier(TierKind::kSsd));
  ASSERT_TRUE(testing::FlipPayloadByte(ssd->PathFor(Hash(2)), 10));
  const std::vector<uint64_t> ask = {Hash(0), Hash(1), Hash(2), Hash(3)};
  absl::Status stop;
  const std::vector<TieredStore::Found> found = s->GetPrefix(ask, &stop);
  EXPECT_EQ(stop.code(), absl::StatusCode::kDataLoss) << stop;
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[1].data, want_[Hash(1)]);
  EXPECT_FALSE(s->Contains(Hash(2)));
  EXPECT_EQ(s->stats().tiers[2].integrity_failures, 1);
  EXPECT_EQ(*s->Get(Hash(3)), want_[Hash(3)]);  // read in the batch, still served after
}

TEST_F(TieredStoreTest, ADemotionDownToTheLowMarkWritesItsSsdBlocksTogether) {
  TieredStoreConfig c = SmallConfig(dir_.path());
  c.ssd_min_hits = 0;
  c.device = {0, 1.0, 1.0};                 // puts land in host
  c.host = {20 * kPayload, 0.95, 0.40};      // crossing 95% moves 12 blocks down at once
  auto s = Make(c);
  for (int i = 0; i < 19; ++i) PutBlock(*s, i);
  ASSERT_EQ(s->stats().tiers[2].blocks, 0);
  PutBlock(*s, 19);
  const TieredStoreStats st = s->stats();
  EXPECT_EQ(st.tiers[2].demoted_in, 12);
  EXPECT_EQ(st.tiers[2].blocks, 12);
  EXPECT_EQ(st.tiers[1].blocks, 8);
  const auto* ssd = static_cast<const SsdTier*>(s->tier(TierKind::kSsd));
  if (ssd->using_io_uring()) {
    EXPECT_EQ(ssd->max_in_flight(), 8);  // not one file at a time
  }
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(Where(*s, i), i < 12 ? TierKind::kSsd : TierKind::kHost) << i;
  }
  for (int i = 0; i < 20; ++i) EXPECT_EQ(*s->Get(Hash(i)), want_[Hash(i)]) << i;
}

TEST_F(TieredStoreTest, WithoutHostDeviceDemotesStraightToSsd) {
  TieredStoreConfig c = SmallConfig(dir_.path());
  c.host.capacity_bytes = 0;
  c.ssd_min_hits = 0;
  auto s = Make(c);
  for (int i = 0; i < 6; ++i) PutBlock(*s, i);
  EXPECT_EQ(s->tier(TierKind::kHost), nullptr);
  EXPECT_EQ(Where(*s, 0), TierKind::kSsd);
  EXPECT_EQ(Where(*s, 1), TierKind::kSsd);
  EXPECT_EQ(*s->Get(Hash(1)), want_[Hash(1)]);
}

TEST_F(TieredStoreTest, WithoutDeviceBlocksLandInHostAndDemoteToSsd) {
  TieredStoreConfig c = SmallConfig(dir_.path());
  c.device.capacity_bytes = 0;  // --device-mb=0: a CPU-only pod
  c.ssd_min_hits = 0;
  auto s = Make(c);
  EXPECT_EQ(s->tier(TierKind::kDevice), nullptr);
  ASSERT_NE(s->tier(TierKind::kHost), nullptr);
  for (int i = 0; i < 3; ++i) PutBlock(*s, i);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Where(*s, i), TierKind::kHost) << i;
  // Host holds 4 blocks: two more push the two least recently used down to SSD.
  for (int i = 3; i < 6; ++i) PutBlock(*s, i);
  EXPECT_EQ(Where(*s, 0), TierKind::kSsd);
  EXPECT_EQ(Where(*s, 1), TierKind::kSsd);
  EXPECT_EQ(Where(*s, 5), TierKind::kHost);
  // A hit in SSD promotes to host, the top tier here.
  EXPECT_EQ(*s->Get(Hash(0)), want_[Hash(0)]);
  EXPECT_EQ(Where(*s, 0), TierKind::kHost);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(*s->Get(Hash(i)), want_[Hash(i)]) << i;
  const TieredStoreStats st = s->stats();
  EXPECT_EQ(st.tiers[0].name, "");
  EXPECT_EQ(st.tiers[0].hits, 0);
  EXPECT_EQ(st.tiers[0].capacity_bytes, 0u);
  EXPECT_GT(st.tiers[1].hits, 0);
  EXPECT_GE(st.tiers[2].promoted_out, 1);
  EXPECT_EQ(st.puts, 6);
  // Re-putting a block held in host replaces it there.
  want_[Hash(5)] = RandomBytes(rng_, kPayload);
  ASSERT_TRUE(s->Put(Hash(5), want_[Hash(5)]).ok());
  EXPECT_EQ(*s->Get(Hash(5)), want_[Hash(5)]);
  // The largest block is still --block-kb's.
  EXPECT_EQ(s->Put(1, std::vector<uint8_t>(kSlot + 1, 3)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(TieredStoreTest, RejectsBadConfigsAndBlocks) {
  TieredStoreConfig c = SmallConfig(dir_.path());
  c.device.low_watermark = 0.9;
  c.device.high_watermark = 0.5;
  EXPECT_EQ(TieredStore::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = SmallConfig("");
  EXPECT_EQ(TieredStore::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = SmallConfig(dir_.path());
  c.device.capacity_bytes = 0;
  c.host.capacity_bytes = 0;
  c.ssd.capacity_bytes = 0;  // no tier at all
  EXPECT_EQ(TieredStore::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
  auto s = Make(SmallConfig(dir_.path()));
  EXPECT_EQ(s->Put(1, std::vector<uint8_t>(kSlot + 1, 3)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Put(1, {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Erase(99).code(), absl::StatusCode::kNotFound);
}

TEST_F(TieredStoreTest, ConcurrentCallersSeeConsistentBlocks) {
  TieredStoreConfig c = SmallConfig(dir_.path());
  c.ssd_min_hits = 0;
  auto s = Make(c);
  // Each thread owns its hashes; blocks churn through every tier while the others run.
  auto work = [&](int id, int* errors) {
    std::mt19937_64 rng(100 + id);
    std::map<uint64_t, std::vector<uint8_t>> mine;
    for (int i = 0; i < 60; ++i) {
      const uint64_t h = (uint64_t(id) << 32) | (rng() % 12);
      if (rng() % 2 == 0 || !mine.contains(h)) {
        mine[h] = RandomBytes(rng, 200 + rng() % 800);
        if (!s->Put(h, mine[h]).ok()) ++*errors;
      } else {
        auto got = s->Get(h);
        // A block may have fallen off the bottom; one that is served must be exact.
        if (got.ok() && *got != mine[h]) ++*errors;
        if (!got.ok() && !absl::IsNotFound(got.status())) ++*errors;
      }
    }
  };
  std::vector<int> errors(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(work, t, &errors[t]);
  for (auto& t : threads) t.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(errors[t], 0) << "thread " << t;
  const TieredStoreStats st = s->stats();
  EXPECT_LE(st.tiers[0].used_bytes, st.tiers[0].capacity_bytes);
  EXPECT_LE(st.tiers[1].used_bytes, st.tiers[1].capacity_bytes);
  EXPECT_GT(st.tiers[2].demoted_in, 0);
}

TEST_F(TieredStoreTest, MetricsTextCarriesTheDesignNames) {
  TieredStoreConfig c = SmallConfig(dir_.path());
  c.host.capacity_bytes = 0;  // a disabled tier has no series
  auto s = Make(c);
  for (int i = 0; i < 3; ++i) PutBlock(*s, i);
  const std::string text = PrometheusText(s->stats(), "stories\"260K");
  EXPECT_NE(text.find("# TYPE tandem_kvstore_tier_bytes gauge"), std::string::npos) << text;
  EXPECT_NE(text.find("tandem_kvstore_tier_bytes{model_name=\"stories\\\"260K\",role=\"kvstore\","
                      "tier=\"" +
                      DeviceTierLabel() + "\"} 3072\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("tier=\"ssd\"} 0\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("tier=\"host\""), std::string::npos) << text;
  EXPECT_NE(text.find("tandem_kv_integrity_failures_total{model_name=\"stories\\\"260K\","
                      "role=\"kvstore\"} 0\n"),
            std::string::npos)
      << text;
}

}  // namespace
}  // namespace tandem::kvstore
