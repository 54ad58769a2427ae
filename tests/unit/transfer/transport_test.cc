// One test body for every KvTransport backend (NIXL_INSTANTIATE_TEST style): UCX over shared
// memory, UCX over TCP, and the in-process backend. Two transport instances live in this
// process; tests about dead or frozen peers start a real receiver process (transfer_test_peer).
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/transfer/inproc/inproc_transport.h"
#include "common/transfer/transfer.h"
#include "common/transfer/ucx/ucx_transport.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

extern char** environ;

namespace tandem::transfer {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

struct BackendParam {
  std::string name;
  std::string ucx_tls;        // empty for the in-process backend
  bool allocate;              // receiver regions come from AllocateRegion, not the caller
  bool one_sided;             // writes need nothing from the receiver (UCX puts)
};

void PrintTo(const BackendParam& p, std::ostream* os) { *os << p.name; }

std::unique_ptr<KvTransport> MakeTransport(const BackendParam& p, const std::string& name) {
  if (p.ucx_tls.empty()) return CreateInProcessTransport(name);
  UcxTransportOptions opts;
  opts.transports = p.ucx_tls;
  auto t = CreateUcxTransport(opts);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

uint64_t Fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x = rng();
    std::memcpy(&v[i], &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

// Waits for a number of asynchronous completions, with an explicit timeout.
class Completions {
 public:
  std::function<void(absl::Status)> Callback() {
    {
      absl::MutexLock l(&mu_);
      ++expected_;
    }
    return [this](absl::Status s) {
      absl::MutexLock l(&mu_);
      statuses_.push_back(std::move(s));
    };
  }
  // False on timeout.
  bool Wait(milliseconds timeout) {
    absl::MutexLock l(&mu_);
    auto all = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return statuses_.size() >= expected_;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&all),
                                absl::Milliseconds(timeout.count()));
  }
  std::vector<absl::Status> statuses() {
    absl::MutexLock l(&mu_);
    return statuses_;
  }

 private:
  absl::Mutex mu_;
  size_t expected_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
};

// Non-overlapping random ops covering a mix of sizes: empty ops, 16-token-block-sized ops,
// medium ops and multi-MB ops, in random order. Sources are random offsets into `src`.
std::vector<WriteOp> RandomOps(std::mt19937_64& rng, const std::vector<uint8_t>& src,
                               uint64_t region_len, uint64_t start, uint64_t end) {
  std::vector<WriteOp> ops;
  uint64_t cursor = start;
  for (;;) {
    uint64_t len;
    int kind = static_cast<int>(rng() % 100);
    if (kind < 15) {
      len = 0;
    } else if (kind < 65) {
      len = 4096;  // a 16-token KV block of a small model (16 tokens x 128 B)
    } else if (kind < 85) {
      len = 1 + rng() % 8192;
    } else if (kind < 97) {
      len = 16384 + rng() % (256 * 1024);
    } else {
      len = (1 << 20) + rng() % (2 << 20);
    }
    uint64_t gap = rng() % 3 == 0 ? 0 : rng() % 20000;
    if (cursor + gap + len > end) break;
    cursor += gap;
    WriteOp op;
    op.length = len;
    op.remote_offset = cursor;
    op.src = src.data() + rng() % (src.size() - len);
    ops.push_back(op);
    cursor += len;
  }
  std::shuffle(ops.begin(), ops.end(), rng);
  (void)region_len;
  return ops;
}

void ApplyOps(const std::vector<WriteOp>& ops, std::vector<uint8_t>& image) {
  for (const WriteOp& op : ops) {
    if (op.length > 0) std::memcpy(image.data() + op.remote_offset, op.src, op.length);
  }
}

// A receiver the test can kill or freeze: a transfer_test_peer process for UCX, a second
// in-process transport otherwise.
class RemotePeer {
 public:
  static std::unique_ptr<RemotePeer> Start(const BackendParam& p, uint64_t bytes) {
    auto peer = std::unique_ptr<RemotePeer>(new RemotePeer());
    if (p.ucx_tls.empty()) {
      peer->inproc_ = CreateInProcessTransport("remote");
      peer->inproc_region_.assign(bytes, 0x5A);
      auto d = peer->inproc_->RegisterRegion(peer->inproc_region_.data(), bytes);
      EXPECT_TRUE(d.ok());
      peer->desc_ = *d;
      return peer;
    }
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) return nullptr;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&fa, from_child[1], 1);
    posix_spawn_file_actions_addclose(&fa, to_child[1]);
    posix_spawn_file_actions_addclose(&fa, from_child[0]);
    std::string bin = std::string(TANDEM_BIN_DIR) + "/transfer_test_peer";
    std::string size = std::to_string(bytes);
    std::string tls = p.ucx_tls;
    std::string alloc = p.allocate ? "1" : "0";
    char* argv[] = {bin.data(),       const_cast<char*>("--tls"),   tls.data(),
                    const_cast<char*>("--bytes"), size.data(),      const_cast<char*>("--alloc"),
                    alloc.data(),     nullptr};
    int rc = posix_spawn(&peer->pid_, bin.c_str(), &fa, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(to_child[0]);
    close(from_child[1]);
    if (rc != 0) {
      ADD_FAILURE() << "cannot start " << bin;
      return nullptr;
    }
    peer->in_ = fdopen(to_child[1], "w");
    peer->out_ = fdopen(from_child[0], "r");
    std::string hex = peer->ReadLine();
    std::string wire;
    for (size_t i = 0; i + 1 < hex.size(); i += 2) {
      wire.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    }
    auto d = RegionDescriptor::Parse(wire);
    EXPECT_TRUE(d.ok()) << d.status() << " (peer printed '" << hex << "')";
    if (!d.ok()) return nullptr;
    peer->desc_ = *d;
    return peer;
  }

  ~RemotePeer() {
    if (in_ != nullptr) std::fclose(in_);  // end of input: a live peer exits by itself
    Reap(SIGKILL);
    if (out_ != nullptr) std::fclose(out_);
  }

  const RegionDescriptor& descriptor() const { return desc_; }

  uint64_t RegionHash() {
    if (inproc_) return Fnv1a(inproc_region_.data(), inproc_region_.size());
    std::fputs("hash\n", in_);
    std::fflush(in_);
    return std::stoull(ReadLine(), nullptr, 16);
  }

  void Kill() {
    if (inproc_) {
      inproc_.reset();
    } else {
      Reap(SIGKILL);
    }
  }
  bool is_process() const { return pid_ > 0; }
  // Returns once every thread of the peer has stopped: kill() only queues the signal, and
  // a peer still running for a moment could finish a message-based write.
  void Freeze() {
    kill(pid_, SIGSTOP);
    int status = 0;
    while (waitpid(pid_, &status, WUNTRACED) < 0 && errno == EINTR) {
    }
  }
  void Thaw() { kill(pid_, SIGCONT); }

 private:
  RemotePeer() = default;
  std::string ReadLine() {
    char buf[4096];
    if (std::fgets(buf, sizeof(buf), out_) == nullptr) return {};
    std::string s(buf);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    return s;
  }
  void Reap(int sig) {
    if (pid_ <= 0) return;
    kill(pid_, SIGCONT);
    kill(pid_, sig);
    int status;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  RegionDescriptor desc_;
  pid_t pid_ = -1;
  FILE* in_ = nullptr;
  FILE* out_ = nullptr;
  std::unique_ptr<KvTransport> inproc_;
  std::vector<uint8_t> inproc_region_;
};

class TransportTest : public ::testing::TestWithParam<BackendParam> {
 protected:
  void SetUp() override {
    sender_ = MakeTransport(GetParam(), "sender");
    receiver_ = MakeTransport(GetParam(), "receiver");
    ASSERT_NE(sender_, nullptr);
    ASSERT_NE(receiver_, nullptr);
  }

  // A registered receiver region poisoned with random bytes; `image_` is what it must hold.
  void MakeRegion(uint64_t bytes) {
    image_ = RandomBytes(bytes, 0xDEAD);
    if (GetParam().allocate) {
      auto a = receiver_->AllocateRegion(bytes);
      ASSERT_TRUE(a.ok()) << a.status();
      region_ = static_cast<uint8_t*>(a->base);
      desc_ = a->descriptor;
    } else {
      own_ = image_;
      region_ = own_.data();
      auto d = receiver_->RegisterRegion(region_, bytes);
      ASSERT_TRUE(d.ok()) << d.status();
      desc_ = *d;
    }
    std::memcpy(region_, image_.data(), bytes);
  }
  bool RegionMatchesImage() const {
    return std::memcmp(region_, image_.data(), image_.size()) == 0;
  }

  std::unique_ptr<KvTransport> sender_;
  std::unique_ptr<KvTransport> receiver_;
  std::vector<uint8_t> own_;
  uint8_t* region_ = nullptr;
  std::vector<uint8_t> image_;
  RegionDescriptor desc_;
};

TEST_P(TransportTest, RandomRangesLandExactlyAndNothingElseChanges) {
  constexpr uint64_t kRegion = 24 << 20;
  MakeRegion(kRegion);
  // The descriptor travels as bytes, as it would over gRPC.
  auto parsed = RegionDescriptor::Parse(desc_.Serialize());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  std::vector<uint8_t> src = RandomBytes(8 << 20, 42);
  std::mt19937_64 rng(7);

  // Eight batches in flight at once, each into its own slice of the region.
  Completions done;
  uint64_t total = 0;
  constexpr int kBatches = 8;
  for (int b = 0; b < kBatches; ++b) {
    uint64_t lo = kRegion / kBatches * b, hi = kRegion / kBatches * (b + 1);
    std::vector<WriteOp> ops = RandomOps(rng, src, kRegion, lo, hi);
    ApplyOps(ops, image_);
    for (const WriteOp& op : ops) total += op.length;
    sender_->WriteAsync(*parsed, std::move(ops), Clock::now() + std::chrono::seconds(10),
                        done.Callback());
  }
  ASSERT_TRUE(done.Wait(milliseconds(15000))) << "writes did not complete";
  for (const absl::Status& s : done.statuses()) EXPECT_TRUE(s.ok()) << s;
  size_t first_diff = 0;
  while (first_diff < image_.size() && region_[first_diff] == image_[first_diff]) ++first_diff;
  EXPECT_EQ(first_diff, image_.size()) << "region differs from the expected image";

  TransportStats tx = sender_->stats();
  EXPECT_EQ(tx.bytes_written, total);
  EXPECT_EQ(tx.writes_failed, 0u);
  // Every byte is attributed to the lanes it went over: tcp alone over tcp, only shared-memory
  // transports over shm (tandem_kv_transport_bytes_total{lanes} is built on this).
  uint64_t by_lanes = 0;
  for (const auto& [lanes, bytes] : tx.bytes_written_by_lanes) {
    by_lanes += bytes;
    const std::string& tls = GetParam().ucx_tls;
    if (tls.empty()) {
      EXPECT_EQ(lanes, "inproc");
    } else if (tls == "tcp") {
      EXPECT_EQ(lanes, "tcp");
    } else {
      for (absl::string_view tl : absl::StrSplit(lanes, ',')) {
        EXPECT_TRUE(tl == "posix" || tl == "sysv" || tl == "cma" || tl == "self") << lanes;
      }
    }
  }
  EXPECT_EQ(by_lanes, total);
  TransportStats rx = receiver_->stats();
  EXPECT_EQ(rx.bytes_received, GetParam().one_sided ? 0u : total);
  EXPECT_TRUE(receiver_->DeregisterRegion(desc_.region_id).ok());
}

TEST_P(TransportTest, BlockingWriteAndEmptyBatches) {
  MakeRegion(1 << 20);
  std::vector<uint8_t> src = RandomBytes(64 << 10, 3);
  // Only empty ops: nothing to send, still OK.
  std::vector<WriteOp> empty = {{src.data(), 0, 100}, {nullptr, 0, 5}};
  EXPECT_TRUE(sender_->Write(desc_, empty, milliseconds(5000)).ok());
  EXPECT_TRUE(sender_->Write(desc_, {}, milliseconds(5000)).ok());
  // One op exactly at the end of the region.
  std::vector<WriteOp> tail = {{src.data(), src.size(), (1 << 20) - src.size()}};
  ApplyOps(tail, image_);
  ASSERT_TRUE(sender_->Write(desc_, tail, milliseconds(5000)).ok());
  EXPECT_TRUE(RegionMatchesImage());
}

TEST_P(TransportTest, OutOfRangeWriteIsInvalidArgumentAndWritesNothing) {
  MakeRegion(1 << 20);
  std::vector<uint8_t> src = RandomBytes(1 << 16, 5);
  std::vector<std::vector<WriteOp>> bad = {
      {{src.data(), 4096, 0}, {src.data(), 4096, (1 << 20) - 4095}},   // one byte past the end
      {{src.data(), 16, 0}, {src.data(), 1, 1 << 20}},                   // starts at the end
      {{src.data(), 4096, UINT64_MAX - 100}},                            // offset overflow
      {{nullptr, 64, 0}},                                                // no source
  };
  for (auto& ops : bad) {
    Completions done;
    sender_->WriteAsync(desc_, ops, Clock::now() + std::chrono::seconds(5), done.Callback());
    ASSERT_TRUE(done.Wait(milliseconds(5000)));
    EXPECT_EQ(done.statuses()[0].code(), absl::StatusCode::kInvalidArgument)
        << done.statuses()[0];
  }
  EXPECT_TRUE(RegionMatchesImage()) << "a refused batch wrote bytes";
  EXPECT_EQ(sender_->stats().writes_failed, bad.size());
  EXPECT_EQ(sender_->stats().bytes_written, 0u);
}

TEST_P(TransportTest, DeregisteredRegionIsRefusedAndUnknownIdIsNotFound) {
  MakeRegion(1 << 20);
  EXPECT_EQ(receiver_->DeregisterRegion(desc_.region_id + 1000).code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(receiver_->DeregisterRegion(desc_.region_id).ok());
  EXPECT_EQ(receiver_->DeregisterRegion(desc_.region_id).code(), absl::StatusCode::kNotFound);
  if (GetParam().one_sided) {
    GTEST_SKIP() << "one-sided puts: the receiver's CPU is not involved and cannot refuse a "
                    "stale descriptor (leases prevent it; see ucx_transport.h)";
  }
  std::vector<uint8_t> src = RandomBytes(200 << 10, 9);
  std::vector<WriteOp> ops = {{src.data(), 4096, 0}, {src.data(), 200 << 10, 8192}};
  absl::Status s = sender_->Write(desc_, ops, milliseconds(5000));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_TRUE(RegionMatchesImage()) << "bytes landed in a deregistered region";
  EXPECT_EQ(receiver_->stats().bytes_received, 0u);
}

TEST_P(TransportTest, ConcurrentWritersFromSeveralThreads) {
  constexpr int kThreads = 4;
  constexpr int kPerThread = 40;
  constexpr uint64_t kSlice = 1 << 20;
  MakeRegion(kSlice * kThreads);
  std::vector<std::vector<uint8_t>> srcs;
  for (int t = 0; t < kThreads; ++t) srcs.push_back(RandomBytes(kSlice, 100 + t));
  std::atomic<int> ok{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Each batch writes 16 blocks of 4 KiB at block-aligned, thread-owned offsets; the last
      // batches cover every block, so the end state is the thread's source slice.
      Completions done;
      for (int i = 0; i < kPerThread; ++i) {
        std::vector<WriteOp> ops;
        for (int k = 0; k < 16; ++k) {
          uint64_t block = (static_cast<uint64_t>(i) * 16 + k) % (kSlice / 4096);
          ops.push_back({srcs[t].data() + block * 4096, 4096, t * kSlice + block * 4096});
        }
        sender_->WriteAsync(desc_, std::move(ops), Clock::now() + std::chrono::seconds(10),
                            done.Callback());
      }
      if (!done.Wait(milliseconds(15000))) {
        failed += kPerThread;
        return;
      }
      for (const absl::Status& s : done.statuses()) (s.ok() ? ok : failed)++;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), kThreads * kPerThread);
  EXPECT_EQ(failed.load(), 0);
  // 40 batches x 16 blocks = 640 blocks per thread: blocks [0, 256) are all written.
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(std::memcmp(region_ + t * kSlice, srcs[t].data(), kSlice), 0)
        << "thread " << t;
  }
  EXPECT_EQ(sender_->stats().bytes_written, uint64_t{kThreads} * kPerThread * 16 * 4096);
}

TEST_P(TransportTest, ExpiredDeadlineIsDeadlineExceeded) {
  MakeRegion(1 << 20);
  std::vector<uint8_t> src = RandomBytes(4096, 1);
  Completions done;
  sender_->WriteAsync(desc_, {{src.data(), 4096, 0}}, Clock::now() - milliseconds(1),
                      done.Callback());
  ASSERT_TRUE(done.Wait(milliseconds(5000)));
  EXPECT_EQ(done.statuses()[0].code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(RegionMatchesImage());
}

TEST_P(TransportTest, WritesAcrossProcessesAndDeadPeerFailsWithinDeadline) {
  constexpr uint64_t kBytes = 4 << 20;
  auto peer = RemotePeer::Start(GetParam(), kBytes);
  ASSERT_NE(peer, nullptr);
  std::vector<uint8_t> image(kBytes, 0x5A);
  std::vector<uint8_t> src = RandomBytes(1 << 20, 77);
  std::vector<WriteOp> ops = {{src.data(), 1 << 20, 12345}, {src.data() + 7, 4096, 3 << 20}};
  ApplyOps(ops, image);
  ASSERT_TRUE(sender_->Write(peer->descriptor(), ops, milliseconds(5000)).ok());
  EXPECT_EQ(peer->RegionHash(), Fnv1a(image.data(), image.size()));

  peer->Kill();
  auto start = Clock::now();
  constexpr auto kDeadline = milliseconds(1500);
  absl::Status s = sender_->Write(peer->descriptor(), ops, kDeadline);
  auto took = Clock::now() - start;
  EXPECT_FALSE(s.ok()) << "a write to a dead peer succeeded";
  EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable ||
              s.code() == absl::StatusCode::kDeadlineExceeded ||
              s.code() == absl::StatusCode::kCancelled)
      << s;
  // DEADLINE_EXCEEDED may take the cancel grace on top of the deadline, never longer.
  EXPECT_LT(took, kDeadline + std::chrono::milliseconds(2500));
  EXPECT_GE(sender_->stats().writes_failed, 1u);
}

TEST_P(TransportTest, FrozenPeerHitsDeadlineThenTransportRecovers) {
  constexpr uint64_t kBytes = 8 << 20;
  auto peer = RemotePeer::Start(GetParam(), kBytes);
  ASSERT_NE(peer, nullptr);
  if (!peer->is_process()) GTEST_SKIP() << "in-process peers cannot be frozen";
  std::vector<uint8_t> src = RandomBytes(kBytes, 78);
  std::vector<WriteOp> ops = {{src.data(), kBytes, 0}};
  ASSERT_TRUE(sender_->Write(peer->descriptor(), ops, milliseconds(5000)).ok());
  peer->Freeze();
  auto start = Clock::now();
  absl::Status s = sender_->Write(peer->descriptor(), ops, milliseconds(500));
  auto took = Clock::now() - start;
  peer->Thaw();
  if (!GetParam().one_sided) {
    // Messages need the receiver's progress: the write cannot finish while it is stopped.
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  } else {
    // One-sided puts need nothing from the frozen process.
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_LT(took, milliseconds(500 + 2500));
  // The connection was torn down if needed; the next write reconnects and lands.
  std::vector<uint8_t> src2 = RandomBytes(kBytes, 79);
  std::vector<WriteOp> ops2 = {{src2.data(), kBytes, 0}};
  absl::Status s2 = sender_->Write(peer->descriptor(), ops2, milliseconds(5000));
  ASSERT_TRUE(s2.ok()) << s2;
  EXPECT_EQ(peer->RegionHash(), Fnv1a(src2.data(), src2.size()));
}

TEST_P(TransportTest, ForgetPeerThenWriteReconnects) {
  MakeRegion(1 << 20);
  std::vector<uint8_t> src = RandomBytes(1 << 16, 11);
  std::vector<WriteOp> ops = {{src.data(), 1 << 16, 0}};
  ApplyOps(ops, image_);
  ASSERT_TRUE(sender_->Write(desc_, ops, milliseconds(5000)).ok());
  sender_->ForgetPeer(desc_.peer_address);
  std::vector<WriteOp> ops2 = {{src.data() + 1, 1000, 1 << 17}};
  ApplyOps(ops2, image_);
  ASSERT_TRUE(sender_->Write(desc_, ops2, milliseconds(5000)).ok());
  EXPECT_TRUE(RegionMatchesImage());
}

TEST_P(TransportTest, IdleTransportUsesNoCpu) {
  MakeRegion(1 << 20);
  std::vector<uint8_t> src = RandomBytes(1 << 16, 12);
  ASSERT_TRUE(sender_->Write(desc_, {{src.data(), 1 << 16, 0}}, milliseconds(5000)).ok());
  // Let the adaptive spin after the last completion run out.
  std::this_thread::sleep_for(milliseconds(20));
  auto cpu = [] {
    rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 + ru.ru_utime.tv_usec +
           ru.ru_stime.tv_usec;
  };
  double before = cpu();
  std::this_thread::sleep_for(milliseconds(300));
  double used_us = cpu() - before;
  EXPECT_LT(used_us, 5000) << "two idle transports burned " << used_us / 1000 << " ms of CPU "
                           << "in 300 ms";
}

TEST_P(TransportTest, CapabilitiesNameTheBackend) {
  Capabilities c = sender_->capabilities();
  EXPECT_EQ(c.name, GetParam().ucx_tls.empty() ? "inproc" : "ucx");
  EXPECT_FALSE(c.detail.empty());
}

INSTANTIATE_TEST_SUITE_P(
    Backends, TransportTest,
    ::testing::Values(BackendParam{"ucx_shm_put", "shm", true, true},
                      BackendParam{"ucx_shm_am", "shm", false, false},
                      BackendParam{"ucx_tcp", "tcp", false, false},
                      BackendParam{"inproc", "", false, false}),
    [](const ::testing::TestParamInfo<BackendParam>& info) { return info.param.name; });

// ---- descriptor wire format ----

TEST(RegionDescriptorTest, RoundTrips) {
  RegionDescriptor d;
  d.peer_address = std::string("ucx1:\0\x01\xff binary", 15);
  d.region_id = 0x0102030405060708ull;
  d.base = 0xfffffffffff0000ull;
  d.length = 123456789;
  d.rkey = std::string(300, '\xab');
  auto p = RegionDescriptor::Parse(d.Serialize());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->peer_address, d.peer_address);
  EXPECT_EQ(p->region_id, d.region_id);
  EXPECT_EQ(p->base, d.base);
  EXPECT_EQ(p->length, d.length);
  EXPECT_EQ(p->rkey, d.rkey);
}

TEST(RegionDescriptorTest, GarbageIsInvalidArgumentNeverACrash) {
  RegionDescriptor d;
  d.peer_address = "inproc:x#1";
  d.region_id = 3;
  d.length = 4096;
  d.rkey = "key";
  std::string wire = d.Serialize();
  // Every truncation.
  for (size_t n = 0; n < wire.size(); ++n) {
    EXPECT_EQ(RegionDescriptor::Parse(wire.substr(0, n)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << n;
  }
  // Trailing bytes, wrong version, huge field length.
  EXPECT_FALSE(RegionDescriptor::Parse(wire + "x").ok());
  std::string v2 = wire;
  v2[4] = 2;
  EXPECT_EQ(RegionDescriptor::Parse(v2).status().code(), absl::StatusCode::kInvalidArgument);
  std::string huge = wire;
  huge[8] = huge[9] = huge[10] = huge[11] = '\xff';
  EXPECT_EQ(RegionDescriptor::Parse(huge).status().code(), absl::StatusCode::kInvalidArgument);
  // Random bytes and random single-byte corruptions: any result but a crash.
  std::mt19937_64 rng(1);
  for (int i = 0; i < 2000; ++i) {
    std::string g(rng() % 64, '\0');
    for (char& c : g) c = static_cast<char>(rng());
    if (i % 2) {
      g = wire;
      g[rng() % g.size()] ^= static_cast<char>(1 + rng() % 255);
    }
    auto r = RegionDescriptor::Parse(g);
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST(UcxOptionsTest, TransportShorthandsAndBadLists) {
  EXPECT_EQ(*ResolveUcxTransports("shm"), "posix,sysv,cma,self");
  EXPECT_EQ(*ResolveUcxTransports("tcp"), "tcp,self");
  EXPECT_EQ(*ResolveUcxTransports("posix,cma"), "posix,cma");
  EXPECT_FALSE(ResolveUcxTransports("").ok());
  EXPECT_FALSE(ResolveUcxTransports("tcp;rm -rf").ok());
  UcxTransportOptions o;
  o.transports = "";
  EXPECT_EQ(CreateUcxTransport(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(UcxTransportTest, DescriptorForAnotherBackendIsRefused) {
  auto t = CreateUcxTransport(UcxTransportOptions{});
  ASSERT_TRUE(t.ok()) << t.status();
  auto inproc = CreateInProcessTransport("other");
  std::vector<uint8_t> region(4096);
  auto d = inproc->RegisterRegion(region.data(), region.size());
  ASSERT_TRUE(d.ok());
  std::vector<uint8_t> src(64, 1);
  absl::Status s = (*t)->Write(*d, {{src.data(), 64, 0}}, milliseconds(2000));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

}  // namespace
}  // namespace tandem::transfer
