// tandem.v1.KvStore over real gRPC: in-process on a loopback port, then the tandem-kvstore
// binary itself, restarted on the same SSD directory.
#include "services/kvstore/kvstore_service.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "absl/time/clock.h"
#include "engine/kv/block_pool.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "services/common/grpc_server.h"
#include "services/kvstore/memory_tiers.h"
#include "tests/fakes/child_process.h"
#include "tests/unit/kvstore/test_util.h"

namespace tandem::kvstore {
namespace {

using testing::RandomBytes;
using testing::ScratchDir;

std::unique_ptr<v1::KvStore::Stub> Dial(int port) {
  return v1::KvStore::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
}

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return c;
}

// Block hashes of a token sequence, as the engine computes them.
std::vector<uint64_t> Hashes(int blocks, uint32_t seed, uint64_t salt) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(16 * blocks);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 32000);
  return engine::ComputeBlockHashes(tokens, 16, salt);
}

TEST(KvStoreServiceTest, LookupPutGetStatsOverGrpc) {
  ScratchDir dir;
  TieredStoreConfig c;
  c.device_slot_bytes = 4096;
  c.device = {4 * 4096, 1.0, 1.0};
  c.host = {4 * 4000, 1.0, 1.0};
  c.ssd = {1 << 20, 1.0, 1.0};
  c.ssd_dir = dir.path();
  c.ssd_min_hits = 0;
  auto store = TieredStore::Create(c);
  ASSERT_TRUE(store.ok()) << store.status();
  KvStoreService service(store->get());
  services::GrpcServerOptions so;
  so.services = {&service};
  auto server = services::GrpcServer::Start(so);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Dial((*server)->port());

  std::mt19937_64 rng(1);
  const std::vector<uint64_t> h = Hashes(10, 3, /*salt=*/0);
  std::map<uint64_t, std::string> want;
  v1::KvPutRequest put;
  for (int i = 0; i < 9; ++i) {  // the last block is never stored
    const auto bytes = RandomBytes(rng, 4000);
    want[h[i]] = std::string(bytes.begin(), bytes.end());
    v1::KvBlock* b = put.add_blocks();
    b->set_hash(h[i]);
    b->set_data(want[h[i]]);
  }
  v1::KvPutResponse put_resp;
  ASSERT_TRUE(stub->Put(Ctx().get(), put, &put_resp).ok());
  EXPECT_EQ(put_resp.stored(), 9);

  // 9 blocks in 4 device slots and 4 host blocks: the oldest one is on SSD.
  v1::KvLookupRequest lookup;
  for (uint64_t x : h) lookup.add_block_hashes(x);
  v1::KvLookupResponse lr;
  ASSERT_TRUE(stub->Lookup(Ctx().get(), lookup, &lr).ok());
  EXPECT_EQ(lr.matched(), 9);
  ASSERT_EQ(lr.tiers_size(), 9);
  EXPECT_EQ(lr.tiers(0), v1::KV_TIER_SSD);
  for (int i = 1; i < 5; ++i) EXPECT_EQ(lr.tiers(i), v1::KV_TIER_HOST) << i;
  for (int i = 5; i < 9; ++i) EXPECT_EQ(lr.tiers(i), v1::KV_TIER_DEVICE) << i;
  // Another tenant's hashes of the same tokens match nothing.
  v1::KvLookupRequest other;
  for (uint64_t x : Hashes(10, 3, /*salt=*/9)) other.add_block_hashes(x);
  ASSERT_TRUE(stub->Lookup(Ctx().get(), other, &lr).ok());
  EXPECT_EQ(lr.matched(), 0);

  // Get the first three, bytes exact; each moves up to the device tier. Promoting block 0
  // pushes the device's LRU block to host and host's LRU block (1) to SSD, so 1 also comes
  // from SSD, and its promotion pushes 2 down the same way.
  v1::KvGetRequest get;
  for (int i = 0; i < 3; ++i) get.add_block_hashes(h[i]);
  v1::KvGetResponse gr;
  ASSERT_TRUE(stub->Get(Ctx().get(), get, &gr).ok());
  ASSERT_EQ(gr.blocks_size(), 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(gr.blocks(i).tier(), v1::KV_TIER_SSD) << i;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(gr.blocks(i).hash(), h[i]);
    EXPECT_EQ(gr.blocks(i).data(), want[h[i]]);
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(store->get()->Where(h[i]), TierKind::kDevice) << i;
  // A Get past the stored run stops there.
  v1::KvGetRequest tail;
  for (int i = 7; i < 10; ++i) tail.add_block_hashes(h[i]);
  ASSERT_TRUE(stub->Get(Ctx().get(), tail, &gr).ok());
  EXPECT_EQ(gr.blocks_size(), 2);

  // A corrupt SSD copy: the reply ends there and counts it.
  const uint64_t victim = h[3];
  ASSERT_EQ(store->get()->Where(victim), TierKind::kSsd);
  {
    const auto* ssd = static_cast<const SsdTier*>(store->get()->tier(TierKind::kSsd));
    const int fd = open(ssd->PathFor(victim).c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const uint8_t x = 0x5A;
    uint8_t b = 0;
    ASSERT_EQ(pread(fd, &b, 1, SsdTier::kHeaderBytes + 17), 1);
    b ^= x;
    ASSERT_EQ(pwrite(fd, &b, 1, SsdTier::kHeaderBytes + 17), 1);
    close(fd);
  }
  v1::KvGetRequest bad;
  bad.add_block_hashes(victim);
  bad.add_block_hashes(h[8]);
  ASSERT_TRUE(stub->Get(Ctx().get(), bad, &gr).ok());
  EXPECT_EQ(gr.blocks_size(), 0);
  EXPECT_EQ(gr.integrity_failures(), 1);

  v1::KvStatsResponse sr;
  ASSERT_TRUE(stub->Stats(Ctx().get(), v1::KvStatsRequest(), &sr).ok());
  ASSERT_EQ(sr.tiers_size(), 3);
  // "device-emulated" on a machine without a GPU, in the label as in the backend's name.
  EXPECT_EQ(sr.tiers(0).tier(), DeviceTierLabel());
  EXPECT_NE(sr.tiers(0).backend().find(DeviceTierLabel()), std::string::npos);
  EXPECT_EQ(sr.tiers(0).blocks(), 4);
  EXPECT_EQ(sr.tiers(0).used_bytes(), 4u * 4096);
  EXPECT_EQ(sr.tiers(2).tier(), "ssd");
  EXPECT_EQ(sr.tiers(2).integrity_failures(), 1);
  EXPECT_GE(sr.tiers(2).hits(), 1);
  EXPECT_EQ(sr.puts(), 9);

  // Oversized blocks are refused with the store's code.
  v1::KvPutRequest huge;
  v1::KvBlock* hb = huge.add_blocks();
  hb->set_hash(1);
  hb->set_data(std::string(5000, 'x'));
  EXPECT_EQ(stub->Put(Ctx().get(), huge, &put_resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  (*server)->Shutdown(absl::Seconds(1));
}

int WaitForPort(const std::string& file) {
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (absl::Now() < end) {
    std::ifstream f(file);
    int port = 0;
    if (f >> port && port > 0) return port;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

TEST(KvStoreBinaryTest, ServesAndKeepsSsdBlocksAcrossARestart) {
  ScratchDir scratch;
  const std::string ssd = scratch.path() + "/ssd";
  // 1 MiB device of 64 KiB slots (16 blocks), 1 MiB host; every demoted block goes to SSD.
  const std::vector<std::string> flags = {
      "--port",   "0",  "--dir",      ssd,  "--device-mb",    "1", "--host-mb",  "1",
      "--ssd-mb", "64", "--block-kb", "64", "--ssd-min-hits", "0", "--port-file"};
  std::mt19937_64 rng(21);
  const std::vector<uint64_t> h = Hashes(48, 8, 0);
  std::map<uint64_t, std::string> want;
  {
    auto args = flags;
    args.push_back(scratch.path() + "/a.port");
    tandem::testing::ChildProcess p("tandem-kvstore", args, scratch.path() + "/a.log");
    const int port = WaitForPort(scratch.path() + "/a.port");
    ASSERT_GT(port, 0) << p.Log();
    auto stub = Dial(port);
    for (int i = 0; i < 48; ++i) {
      v1::KvPutRequest put;
      v1::KvBlock* b = put.add_blocks();
      const auto bytes = RandomBytes(rng, 60000);
      want[h[i]] = std::string(bytes.begin(), bytes.end());
      b->set_hash(h[i]);
      b->set_data(want[h[i]]);
      v1::KvPutResponse resp;
      grpc::Status st = stub->Put(Ctx().get(), put, &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
    }
    v1::KvStatsResponse sr;
    ASSERT_TRUE(stub->Stats(Ctx().get(), v1::KvStatsRequest(), &sr).ok());
    ASSERT_EQ(sr.tiers_size(), 3);
    EXPECT_GT(sr.tiers(2).blocks(), 0);
    EXPECT_EQ(sr.tiers(0).blocks() + sr.tiers(1).blocks() + sr.tiers(2).blocks(), 48);
    EXPECT_EQ(p.Stop(), 0) << p.Log();
    EXPECT_NE(p.Log().find("tier " + DeviceTierLabel() + ": "), std::string::npos) << p.Log();
  }
  auto args = flags;
  args.push_back(scratch.path() + "/b.port");
  tandem::testing::ChildProcess p("tandem-kvstore", args, scratch.path() + "/b.log");
  const int port = WaitForPort(scratch.path() + "/b.port");
  ASSERT_GT(port, 0) << p.Log();
  auto stub = Dial(port);
  v1::KvLookupRequest lookup;
  for (uint64_t x : h) lookup.add_block_hashes(x);
  v1::KvLookupResponse lr;
  ASSERT_TRUE(stub->Lookup(Ctx().get(), lookup, &lr).ok());
  // The oldest blocks were demoted all the way down; they come back from disk.
  ASSERT_GT(lr.matched(), 0);
  for (int i = 0; i < lr.matched(); ++i) EXPECT_EQ(lr.tiers(i), v1::KV_TIER_SSD);
  v1::KvGetRequest get;
  for (int i = 0; i < lr.matched(); ++i) get.add_block_hashes(h[i]);
  v1::KvGetResponse gr;
  ASSERT_TRUE(stub->Get(Ctx().get(), get, &gr).ok());
  ASSERT_EQ(gr.blocks_size(), lr.matched());
  for (int i = 0; i < gr.blocks_size(); ++i) EXPECT_EQ(gr.blocks(i).data(), want[h[i]]) << i;
  EXPECT_EQ(p.Stop(), 0) << p.Log();
}

// The chart's CPU-only shape: no device tier at all; blocks live in host DRAM.
TEST(KvStoreBinaryTest, ServesWithoutADeviceTier) {
  ScratchDir scratch;
  const std::string port_file = scratch.path() + "/c.port";
  tandem::testing::ChildProcess p(
      "tandem-kvstore",
      {"--port", "0", "--device-mb=0", "--host-mb=64", "--ssd-mb=0", "--port-file", port_file},
      scratch.path() + "/c.log");
  const int port = WaitForPort(port_file);
  ASSERT_GT(port, 0) << p.Log();
  auto stub = Dial(port);
  std::mt19937_64 rng(22);
  const std::vector<uint64_t> h = Hashes(4, 8, 0);
  v1::KvPutRequest put;
  std::vector<std::string> want;
  for (uint64_t x : h) {
    const auto bytes = RandomBytes(rng, 60000);
    want.emplace_back(bytes.begin(), bytes.end());
    v1::KvBlock* b = put.add_blocks();
    b->set_hash(x);
    b->set_data(want.back());
  }
  v1::KvPutResponse pr;
  grpc::Status st = stub->Put(Ctx().get(), put, &pr);
  ASSERT_TRUE(st.ok()) << st.error_message();
  v1::KvLookupRequest lookup;
  for (uint64_t x : h) lookup.add_block_hashes(x);
  v1::KvLookupResponse lr;
  ASSERT_TRUE(stub->Lookup(Ctx().get(), lookup, &lr).ok());
  ASSERT_EQ(lr.matched(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(lr.tiers(i), v1::KV_TIER_HOST) << i;
  v1::KvGetRequest get;
  for (uint64_t x : h) get.add_block_hashes(x);
  v1::KvGetResponse gr;
  ASSERT_TRUE(stub->Get(Ctx().get(), get, &gr).ok());
  ASSERT_EQ(gr.blocks_size(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(gr.blocks(i).data(), want[i]) << i;
  v1::KvStatsResponse sr;
  ASSERT_TRUE(stub->Stats(Ctx().get(), v1::KvStatsRequest(), &sr).ok());
  ASSERT_EQ(sr.tiers_size(), 1);  // host only
  EXPECT_EQ(sr.tiers(0).tier(), "host");
  EXPECT_EQ(sr.tiers(0).blocks(), 4);
  EXPECT_EQ(sr.tiers(0).hits(), 4);
  EXPECT_EQ(p.Stop(), 0) << p.Log();
  EXPECT_EQ(p.Log().find("holds no slot"), std::string::npos) << p.Log();
}

}  // namespace
}  // namespace tandem::kvstore
