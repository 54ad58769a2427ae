// Fault: a bit flipped in a KV transfer.
// - The injector itself (common/transfer/fault_injection.h) over the in-process transport:
//   exactly every Nth write lands with exactly one bit changed, the sender's bytes never change,
//   and with N = 0 nothing is wrapped.
// - Real processes: a prefill worker started with --test-fault-flip-bit-every corrupts one bit
//   of every Nth KV write it sends to the decode worker. No request may ever succeed with text
//   that differs from the greedy reference: a corrupted one fails with DATA_LOSS (or the router
//   re-prefills it) and a retry then returns the reference text. The decode worker's integrity
//   counter (WorkerStats and tandem_kv_integrity_failures_total on /metrics) counts every
//   refusal, and no KV block leaks (its pool and the kv_cache_usage_perc gauge return to idle
//   once the refused blocks' quarantine ends). Prints recovery_ms: from a request's first
//   DATA_LOSS to its successful retry.
#include <cstdio>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/transfer/fault_injection.h"
#include "common/transfer/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "tests/fault/fault_cluster.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
namespace v1 = tandem::v1;

TEST(FaultInjectingTransportTest, FlipsOneBitOfEveryNthWriteAndLeavesTheSourceAlone) {
  constexpr uint64_t kEvery = 3;
  constexpr size_t kLen = 4096;
  auto receiver = transfer::CreateInProcessTransport("bitflip-receiver");
  std::vector<uint8_t> region(kLen, 0);
  absl::StatusOr<transfer::RegionDescriptor> dst =
      receiver->RegisterRegion(region.data(), region.size());
  ASSERT_TRUE(dst.ok()) << dst.status();
  transfer::FaultInjectionOptions fo;
  fo.flip_bit_every_n_writes = kEvery;
  auto sender = transfer::MaybeInjectFaults(transfer::CreateInProcessTransport("bitflip-sender"),
                                            fo);
  auto* injector = dynamic_cast<transfer::FaultInjectingTransport*>(sender.get());
  ASSERT_NE(injector, nullptr);
  EXPECT_NE(sender->capabilities().detail.find("fault-injection"), std::string::npos);

  std::mt19937 rng(42);
  for (int call = 1; call <= 7; ++call) {
    SCOPED_TRACE(absl::StrCat("write ", call));
    std::vector<uint8_t> src(kLen / 2);
    for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
    const std::vector<uint8_t> before = src;
    std::fill(region.begin(), region.end(), 0xA5);  // poison
    // Two ops: only the first one of a corrupted call is touched.
    std::vector<transfer::WriteOp> ops = {{src.data(), kLen / 4, 0},
                                          {src.data() + kLen / 4, kLen / 4, kLen / 2}};
    absl::Status st = sender->Write(*dst, std::move(ops), std::chrono::seconds(5));
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(src, before) << "the sender's bytes changed";
    int bits = 0;
    for (size_t i = 0; i < kLen / 4; ++i) bits += __builtin_popcount(region[i] ^ src[i]);
    for (size_t i = 0; i < kLen / 4; ++i) {
      bits += __builtin_popcount(region[kLen / 2 + i] ^ src[kLen / 4 + i]);
    }
    EXPECT_EQ(bits, call % kEvery == 0 ? 1 : 0);
  }
  EXPECT_EQ(injector->writes_seen(), 7u);
  EXPECT_EQ(injector->bits_flipped(), 2u);

  // Off: the backend itself comes back.
  auto plain = transfer::CreateInProcessTransport("bitflip-plain");
  transfer::KvTransport* raw = plain.get();
  EXPECT_EQ(transfer::MaybeInjectFaults(std::move(plain), {}).get(), raw);
}

// Several prompts, some spanning many 16-token blocks.
std::vector<std::string> Prompts() {
  const std::string story =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "sun. One day, she saw a big red ball in the park. ";
  return {"Once upon a time",
          "The cat sat on the mat and",
          story + "She ran to the ball and kicked it.",
          story + story + "Then they went home.",
          "Tom and his dog went to the park.",
          story + "The ball went very high and landed in a tree."};
}

TEST(BitFlipTest, CorruptedTransferIsRefusedRetriedAndNeverReturnedAsWrongText) {
  if (!fs::exists(FaultModelPath())) GTEST_SKIP() << "no real model at " << FaultModelPath();
  constexpr int kMaxTokens = 24;
  constexpr int kMaxAttempts = 10;
  const int metrics_port = FreePort();
  ASSERT_GT(metrics_port, 0);
  FaultClusterOptions o;
  o.name = "bitflip";
  // No prefix cache: every attempt writes the whole prompt, one write call per layer, so the
  // corrupted calls move across requests and retries.
  o.prefill_args = {"--test-fault-flip-bit-every", "8", "--no-prefix-cache"};
  o.decode_args = {"--quarantine-ms", "300", "--metrics-port", std::to_string(metrics_port)};
  FaultCluster cluster(o);
  absl::Status up = cluster.Start();
  ASSERT_TRUE(up.ok()) << up;
  const absl::StatusOr<v1::WorkerStats> idle = cluster.Stats("decode-0");
  ASSERT_TRUE(idle.ok()) << idle.status();
  ASSERT_EQ(idle->kv_integrity_failures(), 0u);

  const std::vector<std::string> prompts = Prompts();
  int data_loss = 0, succeeded = 0;
  double worst_recovery_ms = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("prompt ", i, ": ", prompts[i].substr(0, 40)));
    const Completion ref = GreedyReference(prompts[i], kMaxTokens);
    ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();
    ASSERT_FALSE(ref.tokens.empty());
    absl::Time first_failure = absl::InfiniteFuture();
    bool ok = false;
    for (int attempt = 0; attempt < kMaxAttempts && !ok; ++attempt) {
      const Completion c = cluster.Generate(GreedyRequest(prompts[i], kMaxTokens));
      if (c.status.ok()) {
        // Success must mean the right text: a corrupted transfer may never get through.
        EXPECT_TRUE(c.finished);
        EXPECT_EQ(c.tokens, ref.tokens);
        EXPECT_EQ(c.text, ref.text);
        ok = true;
        ++succeeded;
        if (first_failure != absl::InfiniteFuture()) {
          worst_recovery_ms = std::max(
              worst_recovery_ms, absl::ToDoubleMilliseconds(absl::Now() - first_failure));
        }
      } else {
        ASSERT_EQ(c.status.error_code(), grpc::StatusCode::DATA_LOSS)
            << "a corrupted transfer must fail as DATA_LOSS: " << c.status.error_message();
        EXPECT_NE(c.status.error_message().find("checksum"), std::string::npos)
            << c.status.error_message();
        EXPECT_TRUE(c.tokens.empty()) << "tokens were streamed before the KV was verified";
        ++data_loss;
        if (first_failure == absl::InfiniteFuture()) first_failure = absl::Now();
      }
    }
    EXPECT_TRUE(ok) << "no attempt of " << kMaxAttempts << " succeeded";
  }
  EXPECT_EQ(succeeded, static_cast<int>(prompts.size()));

  const absl::StatusOr<v1::WorkerStats> after_or = cluster.Stats("decode-0");
  ASSERT_TRUE(after_or.ok()) << after_or.status();
  const v1::WorkerStats& after = *after_or;
  // Every refusal is counted (a router that re-prefills on DATA_LOSS hides some from us, so the
  // counter may exceed what the client saw, never fall short).
  EXPECT_GE(after.kv_integrity_failures(), 1u) << "the injector never hit a request";
  EXPECT_GE(after.kv_integrity_failures(), static_cast<uint64_t>(data_loss));
  const HttpResponse m = HttpCall(metrics_port, "GET", "/metrics");
  ASSERT_EQ(m.status, 200);
  EXPECT_EQ(MetricValue(m.body, "tandem_kv_integrity_failures_total"),
            static_cast<double>(after.kv_integrity_failures()))
      << m.body;

  // The refused requests' blocks come back once their quarantine ends: nothing leaks.
  std::string why;
  EXPECT_TRUE(cluster.WaitIdle(absl::Seconds(10), &why)) << why;
  const HttpResponse m2 = HttpCall(metrics_port, "GET", "/metrics");
  EXPECT_EQ(MetricValue(m2.body, "tandem_kv_cache_usage_perc"), 0.0) << m2.body;
  std::fprintf(stderr,
               "bitflip: %zu prompts, %d DATA_LOSS refusals, %llu integrity failures counted; "
               "recovery_ms=%.0f (worst, first DATA_LOSS to the retry's success)\n",
               prompts.size(), data_loss,
               static_cast<unsigned long long>(after.kv_integrity_failures()), worst_recovery_ms);
}

}  // namespace
}  // namespace tandem::testing
