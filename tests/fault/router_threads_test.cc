// The router holds no thread per request: with 64 streams open through it at once, its process
// runs only a few more threads than when idle. (On gRPC's sync server, as it was, each stream
// held a thread of its own for its whole life.) Every stream still completes with all its
// tokens.
#include <filesystem>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/fakes/sanitizer.h"
#include "tests/fault/fault_cluster.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
namespace v1 = tandem::v1;

constexpr int kStreams = 64;
constexpr int kMaxTokens = 400;

int ThreadCount(pid_t pid) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(absl::StrCat("/proc/", pid, "/task"))) {
    (void)e;
    ++n;
  }
  return n;
}

TEST(RouterThreadsTest, ManyOpenStreamsAddNoThreadEach) {
  if (!fs::exists(FaultModelPath())) GTEST_SKIP() << "no real model at " << FaultModelPath();
  FaultClusterOptions o;
  o.name = "router-threads";
  o.router_args = {"--max-inflight", "128", "--max-queue", "128"};
  o.decode_args = {"--max-seqs", std::to_string(kStreams)};
  FaultCluster cluster(o);
  absl::Status up = cluster.Start();
  ASSERT_TRUE(up.ok()) << up;
  ASSERT_TRUE(cluster.Generate(GreedyRequest("Once upon a time", 8)).status.ok());
  const pid_t router = cluster.pid("router");
  const int idle = ThreadCount(router);

  std::atomic<int> open{0}, max_open{0}, peak{idle}, completed{0};
  std::atomic<bool> stop{false};
  std::thread sampler([&] {
    while (!stop.load()) {
      const int n = ThreadCount(router);
      int p = peak.load();
      while (n > p && !peak.compare_exchange_weak(p, n)) {
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  });
  std::barrier start(kStreams);
  std::vector<std::thread> clients;
  for (int i = 0; i < kStreams; ++i) {
    clients.emplace_back([&, i] {
      grpc::ClientContext cc;
      cc.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(120))));
      start.arrive_and_wait();
      auto reader = cluster.inference().Generate(
          &cc, GreedyRequest(absl::StrCat("Stream ", i, ": once upon a time"), kMaxTokens,
                             /*ignore_eos=*/true));
      v1::GenerateResponse m;
      int tokens = 0;
      bool counted = false;
      while (reader->Read(&m)) {
        tokens += m.token_ids_size();
        if (!counted) {
          counted = true;
          const int now = ++open;
          int p = max_open.load();
          while (now > p && !max_open.compare_exchange_weak(p, now)) {
          }
        }
      }
      if (counted) --open;
      const grpc::Status st = reader->Finish();
      EXPECT_TRUE(st.ok()) << "stream " << i << ": " << st.error_message();
      EXPECT_EQ(tokens, kMaxTokens) << "stream " << i;
      if (st.ok() && tokens == kMaxTokens) ++completed;
    });
  }
  for (std::thread& t : clients) t.join();
  stop = true;
  sampler.join();
  std::printf("router threads: %d idle, %d at most with %d of %d streams open at once\n", idle,
              peak.load(), max_open.load(), kStreams);
  EXPECT_EQ(completed.load(), kStreams);
  ASSERT_GE(max_open.load(), kStreams * 3 / 4)
      << "the streams did not overlap enough for the thread count to mean anything";
  EXPECT_LT(peak.load() - idle, 16) << "the router grew a thread per stream";
}

}  // namespace
}  // namespace tandem::testing
