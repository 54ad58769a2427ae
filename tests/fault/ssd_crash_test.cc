// Fault: tandem-kvstore SIGKILLed while it writes blocks to its SSD tier, then restarted on the
// same directory (the process, its gRPC API and its files are all real):
// - two clients Put blocks as fast as the store takes them; its host tier holds 16 blocks, so
//   almost every Put demotes one to SSD, and the kill lands amid file writes;
// - what a crash can leave is then made certain: a file cut short (a torn write), a flipped
//   payload byte (a bad sector) and an unfinished temporary file sit beside the good files;
// - the restarted store rebuilds its index from the directory: every intact file is found and
//   served byte for byte, the torn file and every temporary file are gone, and the damaged block
//   is refused (DATA_LOSS, counted) instead of served. No block ever differs from what was Put.
// Prints recovery_ms: from the restart to the first block served from SSD.
#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tandem/v1/kvstore.grpc.pb.h"
#include "tests/fakes/child_process.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
namespace v1 = tandem::v1;

constexpr size_t kPayload = 60000;  // fits a 64 KiB block
constexpr int kWriters = 2;
constexpr int kBlocksPerPut = 4;

// Each block's bytes follow from its hash, so any block read back can be checked.
std::string Payload(uint64_t hash) {
  std::mt19937_64 rng(hash);
  std::string s(kPayload, '\0');
  for (size_t i = 0; i < s.size(); i += 8) {
    const uint64_t x = rng();
    for (size_t j = 0; j < 8 && i + j < s.size(); ++j) s[i + j] = static_cast<char>(x >> (8 * j));
  }
  return s;
}

uint64_t HashOf(int writer, uint64_t i) {
  return (static_cast<uint64_t>(writer + 1) << 56) ^ (i * 0x9E3779B97F4A7C15ull + 1);
}

std::unique_ptr<v1::KvStore::Stub> Dial(int port) {
  return v1::KvStore::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
}

void Deadline(grpc::ClientContext* c, absl::Duration d) {
  c->set_deadline(absl::ToChronoTime(absl::Now() + d));
}

// Hashes of the block files in `dir`, and the number of temporary files beside them.
struct DirScan {
  std::vector<uint64_t> blocks;
  int temporaries = 0;
};
DirScan Scan(const std::string& dir) {
  DirScan s;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    uint64_t h = 0;
    if (name.ends_with(".kvb.tmp")) {
      ++s.temporaries;
    } else if (name.size() == 20 && name.ends_with(".kvb") &&
               absl::SimpleHexAtoi(name.substr(0, 16), &h)) {
      s.blocks.push_back(h);
    }
  }
  return s;
}

std::string FileOf(const std::string& dir, uint64_t hash) {
  char name[32];
  std::snprintf(name, sizeof(name), "%016llx.kvb", static_cast<unsigned long long>(hash));
  return dir + "/" + name;
}

v1::KvTierStats SsdStats(v1::KvStore::Stub* stub) {
  grpc::ClientContext c;
  Deadline(&c, absl::Seconds(10));
  v1::KvStatsResponse r;
  EXPECT_TRUE(stub->Stats(&c, v1::KvStatsRequest(), &r).ok());
  for (const auto& t : r.tiers()) {
    if (t.tier() == "ssd") return t;
  }
  ADD_FAILURE() << "no ssd tier in " << r.ShortDebugString();
  return {};
}

TEST(SsdCrashTest, KilledMidWriteRestartsWithItsIndexAndServesNoDamagedBlock) {
  const std::string root =
      (fs::temp_directory_path() / ("tandem-ssd-crash-" + std::to_string(getpid()))).string();
  fs::remove_all(root);
  const std::string ssd = root + "/ssd";
  fs::create_directories(ssd);
  const auto flags = [&](const std::string& port_file) {
    return std::vector<std::string>{
        "--port",   "0",   "--dir",      ssd,  "--device-mb",    "0", "--host-mb",   "1",
        "--ssd-mb", "256", "--block-kb", "64", "--ssd-min-hits", "0", "--port-file", port_file};
  };

  // 1. Writes, then SIGKILL while they go on.
  DirScan at_kill;
  {
    ChildProcess store("tandem-kvstore", flags(root + "/a.port"), root + "/a.log");
    const int port = WaitForPortFile(root + "/a.port", &store);
    ASSERT_GT(port, 0) << store.Log();
    std::atomic<bool> stop{false};
    std::atomic<int64_t> acked{0};
    std::vector<std::thread> writers;
    for (int w = 0; w < kWriters; ++w) {
      writers.emplace_back([&, w] {
        auto stub = Dial(port);
        for (uint64_t i = 0; !stop.load();) {
          v1::KvPutRequest put;
          for (int k = 0; k < kBlocksPerPut; ++k, ++i) {
            v1::KvBlock* b = put.add_blocks();
            b->set_hash(HashOf(w, i));
            b->set_data(Payload(HashOf(w, i)));
          }
          grpc::ClientContext c;
          Deadline(&c, absl::Seconds(5));
          v1::KvPutResponse r;
          if (!stub->Put(&c, put, &r).ok()) break;  // the store is gone
          acked += r.stored();
        }
      });
    }
    // Kill once a few hundred blocks have reached the disk, with writes still under way.
    const absl::Time end = absl::Now() + absl::Seconds(60);
    while (Scan(ssd).blocks.size() < 200 && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    store.Signal(SIGKILL);
    EXPECT_EQ(store.Wait(absl::Seconds(10)), 128 + SIGKILL);
    stop = true;
    for (auto& t : writers) t.join();
    at_kill = Scan(ssd);
    std::printf("killed after %lld acknowledged blocks: %zu block files, %d temporary files\n",
                static_cast<long long>(acked.load()), at_kill.blocks.size(), at_kill.temporaries);
    ASSERT_GE(at_kill.blocks.size(), 200u) << store.Log();
  }

  // 2. The damage a crash (or the disk) can leave, made certain.
  ASSERT_GE(at_kill.blocks.size(), 3u);
  const uint64_t torn = at_kill.blocks[0];
  const uint64_t flipped = at_kill.blocks[1];
  fs::resize_file(FileOf(ssd, torn), 4096 + kPayload / 2);
  {
    std::fstream f(FileOf(ssd, flipped), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(64 + 12345);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(64 + 12345);
    f.write(&c, 1);
  }
  {
    const uint64_t unfinished = HashOf(7, 1);
    std::ofstream f(FileOf(ssd, unfinished) + ".tmp", std::ios::binary);
    const std::string half = Payload(unfinished).substr(0, 5000);
    f.write(half.data(), static_cast<std::streamsize>(half.size()));
  }

  // 3. Restart on the same directory.
  const absl::Time restart = absl::Now();
  ChildProcess store("tandem-kvstore", flags(root + "/b.port"), root + "/b.log");
  const int port = WaitForPortFile(root + "/b.port", &store);
  ASSERT_GT(port, 0) << store.Log();
  auto stub = Dial(port);

  const DirScan after = Scan(ssd);
  EXPECT_EQ(after.temporaries, 0) << "temporary files are discarded at start";
  EXPECT_FALSE(fs::exists(FileOf(ssd, torn))) << "the torn file is discarded";
  const v1::KvTierStats opened = SsdStats(stub.get());
  EXPECT_EQ(opened.blocks(), static_cast<int64_t>(at_kill.blocks.size()) - 1)
      << "every intact file (and the flipped one, whose header is intact) is indexed";
  EXPECT_GE(opened.integrity_failures(), 1) << "the torn file is counted";

  // 4. Every block on disk, one Get each: served byte for byte, or refused; never wrong.
  int served = 0, refused = 0;
  double recovery_ms = -1;
  for (uint64_t h : at_kill.blocks) {
    if (h == torn) continue;
    v1::KvGetRequest get;
    get.add_block_hashes(h);
    grpc::ClientContext c;
    Deadline(&c, absl::Seconds(10));
    v1::KvGetResponse r;
    ASSERT_TRUE(stub->Get(&c, get, &r).ok());
    if (r.blocks_size() == 1) {
      ASSERT_EQ(r.blocks(0).data(), Payload(h)) << "block " << h << " served with wrong bytes";
      if (recovery_ms < 0) recovery_ms = absl::ToDoubleMilliseconds(absl::Now() - restart);
      ++served;
    } else {
      EXPECT_EQ(h, flipped) << "an intact block was not served";
      EXPECT_EQ(r.integrity_failures(), 1);
      ++refused;
    }
  }
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(served, static_cast<int>(at_kill.blocks.size()) - 2);
  EXPECT_FALSE(fs::exists(FileOf(ssd, flipped))) << "a block that failed its checksum is deleted";
  EXPECT_GE(SsdStats(stub.get()).integrity_failures(), 2);
  std::printf(
      "restart: %zu blocks indexed, %d served byte for byte, torn file and %d temporary "
      "file(s) discarded, 1 damaged block refused; recovery_ms=%.0f\n",
      at_kill.blocks.size() - 1, served, at_kill.temporaries + 1, recovery_ms);
  EXPECT_EQ(store.Stop(), 0) << store.Log();
  fs::remove_all(root);
}

}  // namespace
}  // namespace tandem::testing
