// The KV store's data plane over real gRPC on loopback, bytes over the in-process transport:
// Stage, write, Commit (checksums verified before indexing), and Read into a requester's
// registered region laid out like an engine KV pool.
#include "services/kvstore/data_plane.h"

#include <cstring>
#include <random>

#include "common/transfer/inproc/inproc_transport.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "services/common/grpc_server.h"
#include "services/common/kv_layout.h"
#include "services/kvstore/kvstore_service.h"
#include "services/kvstore/metrics.h"
#include "tests/unit/kvstore/test_util.h"

namespace tandem::kvstore {
namespace {

using testing::RandomBytes;

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return c;
}

// A requester's KV pool: layers x {K, V} x blocks x segment bytes, layer-major.
constexpr int kLayers = 3;
constexpr uint64_t kSeg = 512;
constexpr int kPoolBlocks = 8;
constexpr uint64_t kBlock = 2 * kLayers * kSeg;

uint64_t SegOffset(int layer, int kv, int block) {
  return uint64_t(layer) * 2 * kPoolBlocks * kSeg + uint64_t(kv) * kPoolBlocks * kSeg +
         uint64_t(block) * kSeg;
}

class DataPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TieredStoreConfig c;
    c.device_slot_bytes = 4096;
    c.device = {64 * 4096, 1.0, 1.0};
    c.host = {0, 1.0, 1.0};
    auto s = TieredStore::Create(c);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    store_transport_ = transfer::CreateInProcessTransport("kvstore");
    client_transport_ = transfer::CreateInProcessTransport("client");
    DataPlaneOptions o;
    o.transport = store_transport_.get();
    o.staging_bytes = 4 * 4096;
    o.slot_bytes = 4096;
    o.stage_lease = absl::Milliseconds(200);
    auto dp = KvDataPlane::Create(o, store_.get());
    ASSERT_TRUE(dp.ok()) << dp.status();
    data_plane_ = std::move(*dp);
    service_ = std::make_unique<KvStoreService>(store_.get(), data_plane_.get());
    services::GrpcServerOptions so;
    so.services = {service_.get()};
    auto srv = services::GrpcServer::Start(so);
    ASSERT_TRUE(srv.ok()) << srv.status();
    server_ = std::move(*srv);
    stub_ = v1::KvStore::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
    pool_.assign(2 * kLayers * kPoolBlocks * kSeg, 0xEE);  // poison
    auto r = client_transport_->RegisterRegion(pool_.data(), pool_.size());
    ASSERT_TRUE(r.ok()) << r.status();
    region_ = *r;
  }
  void TearDown() override {
    server_.reset();
    if (client_transport_ != nullptr) (void)client_transport_->DeregisterRegion(region_.region_id);
  }

  // Stages, writes and commits `blocks` (each kBlock bytes) under `hashes`.
  v1::KvCommitResponse Publish(const std::vector<std::vector<uint8_t>>& blocks,
                               const std::vector<uint64_t>& hashes, bool corrupt_second = false) {
    v1::KvStageRequest sreq;
    sreq.set_num_blocks(static_cast<int>(blocks.size()));
    sreq.set_block_bytes(kBlock);
    v1::KvStageResponse stage;
    EXPECT_TRUE(stub_->Stage(Ctx().get(), sreq, &stage).ok());
    auto dst = transfer::RegionDescriptor::Parse(std::string_view(stage.region()));
    EXPECT_TRUE(dst.ok());
    std::vector<transfer::WriteOp> ops;
    for (size_t i = 0; i < blocks.size(); ++i) {
      ops.push_back({blocks[i].data(), kBlock, stage.offsets(static_cast<int>(i))});
    }
    EXPECT_TRUE(client_transport_->Write(*dst, ops, std::chrono::seconds(5)).ok());
    v1::KvCommitRequest creq;
    creq.set_stage_id(stage.stage_id());
    for (size_t i = 0; i < blocks.size(); ++i) {
      creq.add_block_hashes(hashes[i]);
      uint64_t sum = services::KvBytesChecksum(blocks[i].data(), kBlock);
      if (corrupt_second && i == 1) sum ^= 1;  // what a torn or stale write looks like
      creq.add_checksums(sum);
    }
    v1::KvCommitResponse commit;
    EXPECT_TRUE(stub_->Commit(Ctx().get(), creq, &commit).ok());
    return commit;
  }

  v1::KvReadRequest ReadRequest(const std::vector<uint64_t>& hashes,
                                const std::vector<int32_t>& ids) {
    v1::KvReadRequest r;
    for (uint64_t h : hashes) r.add_block_hashes(h);
    for (int32_t b : ids) r.add_block_ids(b);
    v1::KvRegionLayout* d = r.mutable_destination();
    d->set_region(region_.Serialize());
    d->set_num_layers(kLayers);
    d->set_layer_stride(2 * kPoolBlocks * kSeg);
    d->set_kv_stride(kPoolBlocks * kSeg);
    d->set_segment_bytes(kSeg);
    return r;
  }

  std::unique_ptr<TieredStore> store_;
  std::unique_ptr<transfer::KvTransport> store_transport_, client_transport_;
  std::unique_ptr<KvDataPlane> data_plane_;
  std::unique_ptr<KvStoreService> service_;
  std::unique_ptr<services::GrpcServer> server_;
  std::unique_ptr<v1::KvStore::Stub> stub_;
  std::vector<uint8_t> pool_;
  transfer::RegionDescriptor region_;
};

TEST_F(DataPlaneTest, PublishThenReadIntoAPoolLayout) {
  std::mt19937_64 rng(7);
  std::vector<std::vector<uint8_t>> blocks;
  for (int i = 0; i < 3; ++i) blocks.push_back(RandomBytes(rng, kBlock));
  const std::vector<uint64_t> hashes = {11, 22, 33};
  const v1::KvCommitResponse c = Publish(blocks, hashes);
  EXPECT_EQ(c.stored(), 3);
  EXPECT_EQ(c.integrity_failures(), 0);
  EXPECT_EQ(data_plane_->free_slots(), data_plane_->num_slots());

  // Ask for 4; the store holds the first 3 and stops there.
  const std::vector<int32_t> ids = {5, 0, 2, 7};
  v1::KvReadResponse resp;
  ASSERT_TRUE(stub_->Read(Ctx().get(), ReadRequest({11, 22, 33, 44}, ids), &resp).ok());
  ASSERT_EQ(resp.read(), 3);
  EXPECT_EQ(resp.bytes(), 3 * kBlock);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(resp.tiers(i), v1::KV_TIER_DEVICE);
    EXPECT_EQ(resp.checksums(i), services::KvBytesChecksum(blocks[i].data(), kBlock));
    for (int l = 0; l < kLayers; ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        const uint8_t* got = pool_.data() + SegOffset(l, kv, ids[i]);
        const uint8_t* want = blocks[i].data() + (2 * l + kv) * kSeg;
        EXPECT_EQ(std::memcmp(got, want, kSeg), 0) << "block " << i << " layer " << l;
      }
    }
  }
  // Block 7 (the 4th, missing) was not written.
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(pool_[SegOffset(l, 0, 7)], 0xEE);
}

TEST_F(DataPlaneTest, CommitRefusesBlocksWhoseBytesDoNotMatch) {
  std::mt19937_64 rng(8);
  std::vector<std::vector<uint8_t>> blocks;
  for (int i = 0; i < 3; ++i) blocks.push_back(RandomBytes(rng, kBlock));
  const v1::KvCommitResponse c = Publish(blocks, {1, 2, 3}, /*corrupt_second=*/true);
  EXPECT_EQ(c.stored(), 2);
  EXPECT_EQ(c.integrity_failures(), 1);
  EXPECT_TRUE(store_->Contains(1));
  EXPECT_FALSE(store_->Contains(2));
  EXPECT_TRUE(store_->Contains(3));
  EXPECT_EQ(store_->stats().rejected_blocks, 1);
  const std::string text = PrometheusText(store_->stats(), "m");
  EXPECT_NE(text.find("tandem_kv_integrity_failures_total{model_name=\"m\",role=\"kvstore\"} 1"),
            std::string::npos)
      << text;
  // A commit of the same stage again is unknown.
  v1::KvCommitRequest again;
  again.set_stage_id(12345);
  v1::KvCommitResponse r;
  EXPECT_EQ(stub_->Commit(Ctx().get(), again, &r).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(DataPlaneTest, StagingIsBoundedAndLeased) {
  v1::KvStageRequest sreq;
  sreq.set_num_blocks(3);
  sreq.set_block_bytes(kBlock);
  v1::KvStageResponse s1, s2;
  ASSERT_TRUE(stub_->Stage(Ctx().get(), sreq, &s1).ok());
  EXPECT_EQ(s1.offsets_size(), 3);
  // 4 slots in all: a second stage of 3 does not fit; the publisher drops, never waits.
  EXPECT_EQ(stub_->Stage(Ctx().get(), sreq, &s2).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  sreq.set_block_bytes(4097);
  EXPECT_EQ(stub_->Stage(Ctx().get(), sreq, &s2).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Never committed: after its lease and one more of quarantine the slots are free again.
  absl::SleepFor(absl::Milliseconds(450));
  sreq.set_block_bytes(kBlock);
  v1::KvStageResponse s3;
  ASSERT_TRUE(stub_->Stage(Ctx().get(), sreq, &s3).ok());
  v1::KvCommitRequest late;
  late.set_stage_id(s1.stage_id());
  late.add_block_hashes(1);
  late.add_block_hashes(2);
  late.add_block_hashes(3);
  late.add_checksums(0);
  late.add_checksums(0);
  late.add_checksums(0);
  v1::KvCommitResponse r;
  EXPECT_EQ(stub_->Commit(Ctx().get(), late, &r).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(DataPlaneTest, ReadStopsAtABlockOfAnotherShape) {
  std::mt19937_64 rng(9);
  const std::vector<uint8_t> good = RandomBytes(rng, kBlock);
  const std::vector<uint8_t> odd = RandomBytes(rng, kBlock / 2);
  ASSERT_TRUE(store_->Put(1, good).ok());
  ASSERT_TRUE(store_->Put(2, odd).ok());
  ASSERT_TRUE(store_->Put(3, good).ok());
  v1::KvReadResponse resp;
  ASSERT_TRUE(stub_->Read(Ctx().get(), ReadRequest({1, 2, 3}, {0, 1, 2}), &resp).ok());
  EXPECT_EQ(resp.read(), 1);
  // A destination outside the requester's region is the transport's INVALID_ARGUMENT.
  v1::KvReadRequest bad = ReadRequest({1}, {kPoolBlocks + 100});
  EXPECT_EQ(stub_->Read(Ctx().get(), bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(DataPlaneNoTransportTest, DataPlaneCallsNeedATransport) {
  TieredStoreConfig c;
  auto store = TieredStore::Create(c);
  ASSERT_TRUE(store.ok());
  KvStoreService service(store->get());
  v1::KvStageRequest sreq;
  v1::KvStageResponse s;
  EXPECT_EQ(service.Stage(nullptr, &sreq, &s).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  DataPlaneOptions o;
  EXPECT_FALSE(KvDataPlane::Create(o, store->get()).ok());
}

}  // namespace
}  // namespace tandem::kvstore
