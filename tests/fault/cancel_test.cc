// Client cancellation at each stage of a request, on a cluster of real processes
// (fault_cluster.h; the real stories260K model): while it waits in the router's admission
// queue, while its prompt is being prefilled (a decode reservation is held and KV is being
// written into it), and while it decodes. Each cancel must end the call with CANCELLED at once
// and return every worker to its idle baseline: nothing running, waiting or reserved, every KV
// block free, nothing in flight at the router, and the router's queue empty.
// Skips without ../shared/models.
#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/fault/fault_cluster.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
namespace v1 = tandem::v1;

// A request the test can cancel from its own thread at any moment.
struct Call {
  grpc::ClientContext cc;
  grpc::Status status;
  std::atomic<int> tokens{0};
  std::atomic<bool> done{false};
  absl::Time cancelled_at, ended_at;
  std::thread thread;

  void Start(FaultCluster& cluster, v1::GenerateRequest req) {
    cc.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    thread = std::thread([this, &cluster, req = std::move(req)] {
      auto reader = cluster.inference().Generate(&cc, req);
      v1::GenerateResponse m;
      while (reader->Read(&m)) tokens += m.token_ids_size();
      status = reader->Finish();
      ended_at = absl::Now();
      done = true;
    });
  }
  void Cancel() {
    cancelled_at = absl::Now();
    cc.TryCancel();
  }
  void Join() {
    if (thread.joinable()) thread.join();
  }
  ~Call() { Join(); }
};

v1::GenerateRequest Request(const std::string& prompt, int max_tokens) {
  return GreedyRequest(prompt, max_tokens, /*ignore_eos=*/true);
}

std::string LongPrompt() {
  std::string p = "Once upon a time";
  for (int k = 0; k < 12; ++k) p += ", Tom and Lily went to the park to play with a big red ball";
  return p + ".";
}

class CancelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(FaultModelPath())) {
      GTEST_SKIP() << "no real model at " << FaultModelPath() << " (../shared/models is absent)";
    }
    metrics_port_ = FreePort();
    FaultClusterOptions o;
    o.name = "cancel";
    o.prefill = 1;
    o.decode = 1;
    // One request at a time: a second one waits in the router's queue.
    o.router_args = {"--metrics-port", std::to_string(metrics_port_), "--max-inflight", "1"};
    // Slow chunked prefill: a long prompt takes about a second, long enough to cancel inside.
    o.prefill_args = {"--test-step-delay-ms", "40", "--max-batch-tokens", "16"};
    o.decode_args = {"--quarantine-ms", "300"};
    cluster_ = std::make_unique<FaultCluster>(o);
    ASSERT_TRUE(cluster_->Start().ok());
  }

  double RouterMetric(const std::string& name) {
    const HttpResponse r = HttpCall(metrics_port_, "GET", "/metrics");
    return r.status == 200 ? MetricValue(r.body, name) : -1;
  }

  void ExpectBaseline() {
    std::string why;
    EXPECT_TRUE(cluster_->WaitIdle(absl::Seconds(15), &why)) << why;
    EXPECT_EQ(RouterMetric("tandem_num_requests_running"), 0);
    EXPECT_EQ(RouterMetric("tandem_num_requests_waiting"), 0);
  }

  // The call ended CANCELLED, promptly.
  static void ExpectCancelled(Call& c) {
    c.Join();
    EXPECT_EQ(c.status.error_code(), grpc::StatusCode::CANCELLED) << c.status.error_message();
    EXPECT_LT(c.ended_at - c.cancelled_at, absl::Seconds(2));
  }

  int metrics_port_ = 0;
  std::unique_ptr<FaultCluster> cluster_;
};

TEST_F(CancelTest, WhileQueuedAtTheRouter) {
  // The only slot is held by a long decode; the second request queues behind it.
  Call holder, queued;
  holder.Start(*cluster_, Request("Once upon a time", 1500));
  ASSERT_TRUE(WaitFor(absl::Seconds(20), [&] { return holder.tokens > 0 || holder.done; }));
  queued.Start(*cluster_, Request("Lily had a ball", 20));
  ASSERT_TRUE(WaitFor(absl::Seconds(5), [&] {
    return RouterMetric("tandem_num_requests_waiting") == 1;
  })) << "the second request never queued";
  queued.Cancel();
  ExpectCancelled(queued);
  EXPECT_EQ(queued.tokens, 0);
  // The router notices the cancel within its admission poll and leaves the queue.
  EXPECT_TRUE(
      WaitFor(absl::Seconds(2), [&] { return RouterMetric("tandem_num_requests_waiting") == 0; }));
  holder.Cancel();
  ExpectCancelled(holder);
  ExpectBaseline();
}

TEST_F(CancelTest, DuringPrefill) {
  Call c;
  c.Start(*cluster_, Request(LongPrompt(), 50));
  // The stage: the router has the prefill in flight and decode holds its reservation.
  ASSERT_TRUE(WaitFor(
      absl::Seconds(10),
      [&] {
        absl::StatusOr<v1::WorkerStats> d = cluster_->Stats("decode-0");
        absl::StatusOr<v1::WorkerStats> p = cluster_->Stats("prefill-0");
        return d.ok() && p.ok() && d->reservations() == 1 && p->running() + p->waiting() == 1;
      },
      absl::Milliseconds(5)))
      << "the request never reached the prefill stage";
  absl::SleepFor(absl::Milliseconds(100));  // a few chunks in: KV writes under way
  ASSERT_FALSE(c.done);
  c.Cancel();
  ExpectCancelled(c);
  EXPECT_EQ(c.tokens, 0);
  ExpectBaseline();
}

TEST_F(CancelTest, DuringDecode) {
  Call c;
  c.Start(*cluster_, Request("Once upon a time", 1500));
  ASSERT_TRUE(WaitFor(absl::Seconds(20), [&] { return c.tokens >= 20 || c.done; }));
  ASSERT_FALSE(c.done) << "the stream ended before it could be cancelled";
  absl::StatusOr<v1::WorkerStats> d = cluster_->Stats("decode-0");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->running(), 1);
  EXPECT_LT(d->kv_blocks_free(), d->kv_blocks_total());
  c.Cancel();
  ExpectCancelled(c);
  EXPECT_LT(c.tokens, 1500);
  ExpectBaseline();
}

// All three stages in one go, several times over: the baseline still holds.
TEST_F(CancelTest, RepeatedCancelsAtEveryStageLeakNothing) {
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    Call decoding, prefilling;
    decoding.Start(*cluster_, Request(absl::StrCat("Round ", round, ": once upon a time"), 1500));
    ASSERT_TRUE(WaitFor(absl::Seconds(20), [&] { return decoding.tokens >= 5 || decoding.done; }));
    prefilling.Start(*cluster_, Request(absl::StrCat(round, LongPrompt()), 30));  // queued
    absl::SleepFor(absl::Milliseconds(50));
    decoding.Cancel();  // frees the slot: the queued one goes to prefill
    ExpectCancelled(decoding);
    ASSERT_TRUE(WaitFor(
        absl::Seconds(10),
        [&] {
          absl::StatusOr<v1::WorkerStats> p = cluster_->Stats("prefill-0");
          return p.ok() && p->running() + p->waiting() == 1;
        },
        absl::Milliseconds(5)));
    absl::SleepFor(absl::Milliseconds(80));
    prefilling.Cancel();
    ExpectCancelled(prefilling);
  }
  ExpectBaseline();
}

}  // namespace
}  // namespace tandem::testing
