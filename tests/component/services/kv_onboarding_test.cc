// Prefix onboarding through the real services: a prefill worker with a tandem-kvstore (its gRPC
// service and data plane in-process on a loopback port, KV bytes over the in-process transport)
// and a decode worker. Output with prefix hits served from the store's device, host and SSD
// tiers (and from the worker's own cache) must equal a cold single-process run token for token;
// tenants must never share blocks; a store that is down must cost nothing but the hit.
#include <filesystem>
#include <random>

#include "common/transfer/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "services/common/grpc_server.h"
#include "services/kvstore/data_plane.h"
#include "services/kvstore/kvstore_service.h"
#include "services/kvstore/tiered_store.h"
#include "tests/component/services/cluster_fixture.h"

namespace tandem::testing {
namespace {

engine::SamplingParams Seeded(int max_tokens, uint64_t seed) {
  engine::SamplingParams sp = Greedy(max_tokens);
  sp.temperature = 0.8f;
  sp.top_k = 40;
  sp.seed = seed;
  return sp;
}

constexpr uint64_t kSlot = 256 << 10;  // larger than any test model's block

enum class Where { kDevice, kHost, kSsd };

// A kvstore whose blocks end up in one chosen tier: every tier above it holds one slot, so each
// new block pushes the previous one down.
struct Store {
  explicit Store(Where where) {
    dir = std::filesystem::temp_directory_path() /
          ("tandem-kvonboard-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    kvstore::TieredStoreConfig c;
    c.device_slot_bytes = kSlot;
    c.ssd_min_hits = 0;
    c.ssd_dir = dir.string();
    switch (where) {
      case Where::kDevice:
        c.device = {256 * kSlot, 1.0, 1.0};
        c.host = {0, 1.0, 1.0};
        c.ssd = {0, 1.0, 1.0};
        break;
      case Where::kHost:
        c.device = {kSlot, 1.0, 1.0};
        c.host = {256 * kSlot, 1.0, 1.0};
        c.ssd = {0, 1.0, 1.0};
        break;
      case Where::kSsd:
        c.device = {kSlot, 1.0, 1.0};
        c.host = {0, 1.0, 1.0};
        c.ssd = {512 * kSlot, 1.0, 1.0};
        break;
    }
    auto s = kvstore::TieredStore::Create(c);
    EXPECT_TRUE(s.ok()) << s.status();
    store = std::move(*s);
    transport = transfer::CreateInProcessTransport("kvstore");
    kvstore::DataPlaneOptions o;
    o.transport = transport.get();
    o.staging_bytes = 64 * kSlot;
    o.slot_bytes = kSlot;
    auto dp = kvstore::KvDataPlane::Create(o, store.get());
    EXPECT_TRUE(dp.ok()) << dp.status();
    data_plane = std::move(*dp);
    service = std::make_unique<kvstore::KvStoreService>(store.get(), data_plane.get());
    services::GrpcServerOptions so;
    so.services = {service.get()};
    auto srv = services::GrpcServer::Start(so);
    EXPECT_TRUE(srv.ok()) << srv.status();
    server = std::move(*srv);
  }
  ~Store() {
    Stop();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  void Stop() { server.reset(); }
  std::string address() const { return server->address(); }

  static inline int counter = 0;
  std::filesystem::path dir;
  std::unique_ptr<kvstore::TieredStore> store;
  std::unique_ptr<transfer::KvTransport> transport;
  std::unique_ptr<kvstore::KvDataPlane> data_plane;
  std::unique_ptr<kvstore::KvStoreService> service;
  std::unique_ptr<services::GrpcServer> server;
};

class KvOnboardingTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    model_ = LoadTestModel(GetParam());
    if (model_ == nullptr) GTEST_SKIP() << GetParam() << " is not available here";
  }
  std::shared_ptr<const engine::Model> model_;
};

// The store's blocks in one tier; the prefill worker has no cache of its own, so every hit is
// the store's.
void CheckTier(std::shared_ptr<const engine::Model> model, Where where, const char* tier) {
  Store s(where);
  ClusterOptions o;
  o.decode_prefix_cache = false;  // what prefill onboards is sent whole, as the tests compare
  o.prefill_prefix_cache = false;
  o.kvstore_address = s.address();
  TestCluster c(model, o);
  uint32_t seed = 7;
  for (const engine::SamplingParams& sp : {Greedy(12), Seeded(12, 99)}) {
    const std::vector<int32_t> prompt = TestPrompt(83, seed++);  // 5 full blocks + 3 tokens
    const Generated ref = ReferenceRun(model, kernels::DType::kF32, prompt, sp);
    ASSERT_FALSE(ref.tokens.empty());
    const Generated cold = c.Generate("cold", prompt, sp);
    ASSERT_TRUE(cold.status.ok()) << cold.status.error_message();
    EXPECT_EQ(cold.tokens, ref.tokens);
    EXPECT_EQ(cold.prefill.onboarded_tokens(), 0);
    EXPECT_EQ(cold.prefill.published_blocks(), 5);
    ASSERT_TRUE(c.prefill->WaitForPublishing(absl::Seconds(10)));
    const Generated warm = c.Generate("warm", prompt, sp);
    ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();
    EXPECT_EQ(warm.tokens, ref.tokens) << tier;
    EXPECT_EQ(warm.prefill.kvstore_tokens(), 80) << warm.prefill.DebugString();
    EXPECT_EQ(warm.prefill.onboarded_tokens(), 80);
    EXPECT_EQ(warm.prefill.local_cached_tokens(), 0);
    EXPECT_EQ(warm.prefill.onboard_tier(), tier);
    EXPECT_GT(warm.prefill.onboard_seconds(), 0);
    // Decode got the whole prompt's KV, onboarded blocks included.
    EXPECT_EQ(warm.prefill.bytes_transferred(), cold.prefill.bytes_transferred());
    EXPECT_EQ(warm.prefill.block_checksums().size(), cold.prefill.block_checksums().size());
    // The five onboarded blocks carry the store's bytes unchanged. The trailing partial block is
    // recomputed from 3 tokens instead of 83, so the kernels take a different batch shape and its
    // bytes may differ in the last bits; the tokens above already check it.
    ASSERT_EQ(cold.prefill.block_checksums_size(), 6);
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(warm.prefill.block_checksums(i), cold.prefill.block_checksums(i)) << i;
    }
    // A longer prompt sharing the prefix: onboard 5 blocks, compute the rest.
    std::vector<int32_t> longer = prompt;
    for (int i = 0; i < 20; ++i) longer.push_back(5 + i);
    const Generated ref2 = ReferenceRun(model, kernels::DType::kF32, longer, sp);
    const Generated warm2 = c.Generate("warm2", longer, sp);
    ASSERT_TRUE(warm2.status.ok()) << warm2.status.error_message();
    EXPECT_EQ(warm2.tokens, ref2.tokens);
    EXPECT_EQ(warm2.prefill.kvstore_tokens(), 80);
    ASSERT_TRUE(c.prefill->WaitForPublishing(absl::Seconds(10)));
  }
  EXPECT_EQ(s.store->stats().rejected_blocks, 0);
}

TEST_P(KvOnboardingTest, DeviceTierHitsMatchColdRun) { CheckTier(model_, Where::kDevice, "device"); }
TEST_P(KvOnboardingTest, HostTierHitsMatchColdRun) { CheckTier(model_, Where::kHost, "host"); }
TEST_P(KvOnboardingTest, SsdTierHitsMatchColdRun) { CheckTier(model_, Where::kSsd, "ssd"); }

TEST_P(KvOnboardingTest, OwnPrefixCacheHitsMatchColdRun) {
  TestCluster c(model_);
  const std::vector<int32_t> prompt = TestPrompt(70, 3);
  const engine::SamplingParams sp = Seeded(10, 5);
  const Generated ref = ReferenceRun(model_, kernels::DType::kF32, prompt, sp);
  const Generated cold = c.Generate("a", prompt, sp);
  ASSERT_TRUE(cold.status.ok()) << cold.status.error_message();
  EXPECT_EQ(cold.prefill.onboarded_tokens(), 0);
  EXPECT_EQ(cold.tokens, ref.tokens);
  const Generated warm = c.Generate("b", prompt, sp);
  ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();
  EXPECT_EQ(warm.tokens, ref.tokens);
  EXPECT_EQ(warm.prefill.local_cached_tokens(), 64);
  EXPECT_EQ(warm.prefill.onboard_tier(), "local");
  EXPECT_EQ(warm.prefill.cached_block_hashes_size(), 4);
  // Cached blocks nobody uses count as free.
  const v1::WorkerStats ps = c.PrefillStats();
  EXPECT_EQ(ps.kv_blocks_free(), ps.kv_blocks_total());
}

TEST_P(KvOnboardingTest, TenantsNeverShareBlocks) {
  Store s(Where::kDevice);
  ClusterOptions o;
  o.decode_prefix_cache = false;  // what prefill onboards is sent whole, as the tests compare
  o.kvstore_address = s.address();  // own cache on too: neither may leak across tenants
  TestCluster c(model_, o);
  const std::vector<int32_t> prompt = TestPrompt(50, 11);
  const engine::SamplingParams sp = Greedy(6);
  const Generated ref = ReferenceRun(model_, kernels::DType::kF32, prompt, sp);
  const Generated a1 = c.Generate("a1", prompt, sp, /*salt=*/111);
  ASSERT_TRUE(a1.status.ok());
  ASSERT_TRUE(c.prefill->WaitForPublishing(absl::Seconds(10)));
  const Generated b1 = c.Generate("b1", prompt, sp, /*salt=*/222);
  ASSERT_TRUE(b1.status.ok());
  EXPECT_EQ(b1.prefill.onboarded_tokens(), 0) << b1.prefill.DebugString();
  EXPECT_EQ(b1.tokens, ref.tokens);
  ASSERT_TRUE(c.prefill->WaitForPublishing(absl::Seconds(10)));
  const Generated a2 = c.Generate("a2", prompt, sp, /*salt=*/111);
  ASSERT_TRUE(a2.status.ok());
  EXPECT_EQ(a2.prefill.onboarded_tokens(), 48);
  EXPECT_EQ(a2.tokens, ref.tokens);
  // Both tenants' blocks are in the store, under different names.
  EXPECT_EQ(s.store->stats().tiers[0].blocks, 6);
  for (int i = 0; i < 3; ++i) {
    EXPECT_NE(a1.prefill.cached_block_hashes(i), b1.prefill.cached_block_hashes(i));
  }

  // Without the own cache, the same through the store alone.
  ClusterOptions o2 = o;
  o2.prefill_prefix_cache = false;
  TestCluster c2(model_, o2);
  const Generated b2 = c2.Generate("b2", prompt, sp, /*salt=*/333);
  EXPECT_EQ(b2.prefill.onboarded_tokens(), 0);
  const Generated a3 = c2.Generate("a3", prompt, sp, /*salt=*/111);
  EXPECT_EQ(a3.prefill.kvstore_tokens(), 48);
  EXPECT_EQ(a3.tokens, ref.tokens);
}

TEST_P(KvOnboardingTest, StoreDownRunsCold) {
  auto s = std::make_unique<Store>(Where::kHost);
  ClusterOptions o;
  o.decode_prefix_cache = false;  // what prefill onboards is sent whole, as the tests compare
  o.prefill_prefix_cache = false;
  o.kvstore_address = s->address();
  TestCluster c(model_, o);
  const std::vector<int32_t> prompt = TestPrompt(60, 21);
  const engine::SamplingParams sp = Seeded(8, 4);
  const Generated ref = ReferenceRun(model_, kernels::DType::kF32, prompt, sp);
  const Generated first = c.Generate("1", prompt, sp);
  ASSERT_TRUE(first.status.ok());
  ASSERT_TRUE(c.prefill->WaitForPublishing(absl::Seconds(10)));
  s.reset();  // the store dies, with its server and transport
  for (int i = 0; i < 2; ++i) {
    const absl::Time t0 = absl::Now();
    const Generated g = c.Generate("down" + std::to_string(i), prompt, sp);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    EXPECT_EQ(g.tokens, ref.tokens);
    EXPECT_EQ(g.prefill.onboarded_tokens(), 0);
    EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  }
  ASSERT_TRUE(c.prefill->WaitForPublishing(absl::Seconds(10)));
  EXPECT_GT(c.PrefillStats().kvstore_publish_dropped(), 0u);

  // A store that was never there.
  ClusterOptions o2 = o;
  o2.kvstore_address = "127.0.0.1:1";
  TestCluster c2(model_, o2);
  const Generated g = c2.Generate("never", prompt, sp);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.tokens, ref.tokens);
}

INSTANTIATE_TEST_SUITE_P(Models, KvOnboardingTest, ::testing::Values("tiny", "stories260K"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tandem::testing
