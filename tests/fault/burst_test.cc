// Fault: a burst of 10x the cluster's concurrent capacity. The router admits --max-inflight
// requests and queues --max-queue more; everything beyond is refused at once. Sent all at once,
// over gRPC and over the OpenAI HTTP front door:
// - excess requests get RESOURCE_EXHAUSTED (gRPC) or 429 with a Retry-After header (HTTP), and
//   nothing else fails;
// - every accepted request completes with the greedy reference's text;
// - the router's RSS stays bounded (a second burst costs no more memory than the first);
// - afterwards the router's queue is empty (num_requests_running/waiting on its /metrics), no
//   worker holds a request or a KV block, and the cluster serves normally again.
// Prints recovery_ms: from the burst's last answer to the cluster being idle again.
#include <barrier>
#include <cstdio>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/fakes/sanitizer.h"
#include "tests/fault/fault_cluster.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
namespace v1 = tandem::v1;

constexpr int kMaxInflight = 2;
constexpr int kMaxQueue = 2;
constexpr int kCapacity = kMaxInflight + kMaxQueue;
constexpr int kGrpcBurst = 10 * kCapacity;
constexpr int kHttpBurst = 10 * kCapacity / 2;
constexpr int kMaxTokens = 24;

const std::vector<std::string>& Prompts() {
  static const std::vector<std::string> p = {"Once upon a time", "The cat sat on the mat and",
                                             "Tom and his dog went to the park.",
                                             "One day, a little girl named Lily"};
  return p;
}

struct BurstResult {
  int accepted = 0, refused = 0, other = 0, retry_after_missing = 0;
  int http_accepted = 0, http_refused = 0;
  absl::Time last_answer = absl::InfinitePast();
};

class BurstTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(FaultModelPath())) GTEST_SKIP() << "no real model at " << FaultModelPath();
    for (const std::string& p : Prompts()) {
      refs_.push_back(GreedyReference(p, kMaxTokens));
      ASSERT_TRUE(refs_.back().status.ok()) << refs_.back().status.error_message();
    }
  }

  // kGrpcBurst gRPC calls and kHttpBurst HTTP completions, all released at one barrier.
  BurstResult Burst(FaultCluster& cluster, int http_port) {
    BurstResult r;
    std::mutex mu;
    std::barrier start(kGrpcBurst + kHttpBurst);
    std::vector<std::thread> threads;
    for (int i = 0; i < kGrpcBurst; ++i) {
      threads.emplace_back([&, i] {
        const size_t k = i % Prompts().size();
        start.arrive_and_wait();
        const Completion c = cluster.Generate(GreedyRequest(Prompts()[k], kMaxTokens));
        std::lock_guard<std::mutex> l(mu);
        r.last_answer = std::max(r.last_answer, absl::Now());
        if (c.status.ok()) {
          ++r.accepted;
          EXPECT_EQ(c.tokens, refs_[k].tokens) << "accepted gRPC request " << i;
          EXPECT_EQ(c.text, refs_[k].text);
        } else if (c.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          ++r.refused;
          EXPECT_TRUE(c.tokens.empty());
        } else {
          ++r.other;
          ADD_FAILURE() << "gRPC request " << i << ": " << c.status.error_code() << " "
                        << c.status.error_message();
        }
      });
    }
    for (int i = 0; i < kHttpBurst; ++i) {
      threads.emplace_back([&, i] {
        const size_t k = i % Prompts().size();
        const nlohmann::json body = {{"model", "stories260K"},
                                     {"prompt", Prompts()[k]},
                                     {"max_tokens", kMaxTokens},
                                     {"temperature", 0}};
        start.arrive_and_wait();
        const HttpResponse h = HttpCall(http_port, "POST", "/v1/completions", body.dump());
        std::lock_guard<std::mutex> l(mu);
        r.last_answer = std::max(r.last_answer, absl::Now());
        if (h.status == 200) {
          ++r.accepted;
          ++r.http_accepted;
          const nlohmann::json j = nlohmann::json::parse(h.body, nullptr, false);
          ASSERT_FALSE(j.is_discarded()) << h.body;
          EXPECT_EQ(j["choices"][0]["text"].get<std::string>(), refs_[k].text) << h.body;
        } else if (h.status == 429) {
          ++r.refused;
          ++r.http_refused;
          auto it = h.headers.find("retry-after");
          if (it == h.headers.end() || std::atoi(it->second.c_str()) < 1) {
            ++r.retry_after_missing;
          }
        } else {
          ++r.other;
          ADD_FAILURE() << "HTTP request " << i << ": " << h.status << " " << h.body;
        }
      });
    }
    for (std::thread& t : threads) t.join();
    return r;
  }

  std::vector<Completion> refs_;
};

TEST_F(BurstTest, TenTimesCapacityIsRefusedFastAndTheRestIsServedCorrectly) {
  const int http_port = FreePort();
  const int metrics_port = FreePort();
  ASSERT_GT(http_port, 0);
  ASSERT_GT(metrics_port, 0);
  FaultClusterOptions o;
  o.name = "burst";
  o.router_args = {"--max-inflight", std::to_string(kMaxInflight),
                   "--max-queue",    std::to_string(kMaxQueue),
                   "--http-port",    std::to_string(http_port),
                   "--metrics-port", std::to_string(metrics_port)};
  // Every prefill step sleeps a little, so accepted requests hold their slots while the rest
  // of the burst arrives.
  o.prefill_args = {"--test-step-delay-ms", "40"};
  FaultCluster cluster(o);
  absl::Status up = cluster.Start();
  ASSERT_TRUE(up.ok()) << up;
  const pid_t router = cluster.pid("router");

  // Warm-up: the router's lazily built state (channels, HTTP threads) exists before measuring.
  for (size_t k = 0; k < Prompts().size(); ++k) {
    const Completion c = cluster.Generate(GreedyRequest(Prompts()[k], kMaxTokens));
    ASSERT_TRUE(c.status.ok()) << c.status.error_message();
    EXPECT_EQ(c.tokens, refs_[k].tokens);
  }
  const int64_t rss0 = VmRssKb(router);
  ASSERT_GT(rss0, 0);

  int64_t rss[2] = {0, 0};
  absl::Duration recovery[2];
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(absl::StrCat("burst ", round + 1));
    const BurstResult r = Burst(cluster, http_port);
    EXPECT_EQ(r.accepted + r.refused, kGrpcBurst + kHttpBurst);
    EXPECT_EQ(r.other, 0);
    EXPECT_GE(r.accepted, kMaxInflight) << "the burst starved the admitted requests";
    // With every prefill step slowed, most of the burst finds the router full.
    EXPECT_GE(r.refused, (kGrpcBurst + kHttpBurst) / 2);
    EXPECT_GE(r.http_refused, 1) << "no HTTP request was refused: the 429 path went untested";
    EXPECT_EQ(r.retry_after_missing, 0) << "a 429 without Retry-After";
    // Queues drain: the router's and every worker's.
    std::string why;
    const bool idle = cluster.WaitIdle(absl::Seconds(15), &why) &&
                      WaitFor(absl::Seconds(5), [&] {
                        const HttpResponse m = HttpCall(metrics_port, "GET", "/metrics");
                        why = "router /metrics: " + m.body.substr(0, 200);
                        return m.status == 200 &&
                               MetricValue(m.body, "tandem_num_requests_running") == 0 &&
                               MetricValue(m.body, "tandem_num_requests_waiting") == 0;
                      });
    EXPECT_TRUE(idle) << why;
    recovery[round] = absl::Now() - r.last_answer;
    rss[round] = VmRssKb(router);
    std::fprintf(stderr,
                 "burst %d: %d accepted, %d refused (HTTP: %d accepted, %d refused with 429); "
                 "router RSS %lld KiB\n",
                 round + 1, r.accepted, r.refused, r.http_accepted, r.http_refused,
                 static_cast<long long>(rss[round]));
  }
  // Bounded: the first burst may grow pools once; the second may not grow them again.
  // (Not under TSan: its shadow memory grows with every heap byte touched.)
  if (!kUnderTsan) {
    EXPECT_LT(rss[0] - rss0, 64 * 1024) << "router RSS " << rss0 << " -> " << rss[0] << " KiB";
    EXPECT_LT(rss[1] - rss[0], 8 * 1024) << "router RSS " << rss[0] << " -> " << rss[1] << " KiB";
  }

  // And the cluster serves normally.
  const Completion after = cluster.Generate(GreedyRequest(Prompts()[0], kMaxTokens));
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.tokens, refs_[0].tokens);
  std::fprintf(stderr, "burst: router RSS %lld -> %lld -> %lld KiB; recovery_ms=%.0f (%.0f)\n",
               static_cast<long long>(rss0), static_cast<long long>(rss[0]),
               static_cast<long long>(rss[1]), absl::ToDoubleMilliseconds(recovery[0]),
               absl::ToDoubleMilliseconds(recovery[1]));
}

}  // namespace
}  // namespace tandem::testing
