// Fault: the KV store dies. A cluster of real processes (router, one prefill worker publishing
// to and onboarding from a tandem-kvstore, one decode worker) warms a prompt prefix into the
// store's SSD tier, then the store is SIGKILLed:
// - every request still completes, token-identical to the greedy reference, down the miss path
//   (no cached tokens), and no slower than a cold request plus the lookup and read deadlines;
// - the prefill worker's publish queue stays bounded: blocks that cannot be published are
//   dropped (counted), and its RSS does not grow with the traffic;
// - restarted on the same port and SSD directory, the store serves the warmed prefix again from
//   SSD (the tier survives the kill), and the output is still the reference.
// Prints recovery_ms: from the restart to the first request onboarded from the store again.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/fault/fault_cluster.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
namespace v1 = tandem::v1;

constexpr int kMaxTokens = 16;
constexpr int kLookupMs = 200;
constexpr int kReadMs = 1000;
constexpr int kPublishQueueBlocks = 16;

const std::string kStory =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
    "One day, she saw a big red ball in the park. She ran to the ball and kicked it. ";

// Prompts of several full 16-token blocks, distinct from their first block on (so none shares
// a cached prefix with another).
std::string Prompt(int i) { return absl::StrCat("Story number ", i, ". ", kStory, kStory); }

int64_t FullBlocks(const Completion& c) { return c.usage.prompt_tokens() / 16; }

TEST(KvStoreKillTest, WorkersCarryOnColdWhileTheStoreIsDownAndSsdHitsReturnAfterARestart) {
  if (!fs::exists(FaultModelPath())) GTEST_SKIP() << "no real model at " << FaultModelPath();
  FaultClusterOptions o;
  o.name = "kvkill";
  o.kvstore = true;
  // No cache of its own, so every hit is the store's.
  o.prefill_args = {"--no-prefix-cache",
                    "--kvstore-lookup-ms", std::to_string(kLookupMs),
                    "--kvstore-read-ms", std::to_string(kReadMs),
                    "--publish-queue-blocks", std::to_string(kPublishQueueBlocks),
                    // Peaks given, so no start-up probe: its transient read buffer would land
                    // in the RSS compared below.
                    "--peak-read-gbs", "20", "--peak-gflops", "100"};
  // One 1 MiB device slot and no host tier: each new block pushes the previous one to SSD.
  o.kvstore_args = {"--device-mb", "1",  "--host-mb", "0", "--block-kb", "1024",
                    "--ssd-mb",    "64", "--ssd-min-hits", "0"};
  FaultCluster cluster(o);
  absl::Status up = cluster.Start();
  ASSERT_TRUE(up.ok()) << up;

  const std::string warm_prompt = Prompt(0);
  const Completion ref = GreedyReference(warm_prompt, kMaxTokens);
  ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();
  auto published = [&] {
    absl::StatusOr<v1::WorkerStats> s = cluster.Stats("prefill-0");
    return s.ok() ? s->kvstore_published_blocks() : 0u;
  };

  // Warm: publish the prompt's blocks, then another prompt's, which pushes the last of the
  // first prompt's blocks out of the one device slot onto SSD.
  const Completion cold = cluster.Generate(GreedyRequest(warm_prompt, kMaxTokens));
  ASSERT_TRUE(cold.status.ok()) << cold.status.error_message();
  EXPECT_EQ(cold.tokens, ref.tokens);
  EXPECT_EQ(cold.usage.cached_prompt_tokens(), 0);
  const int64_t blocks = FullBlocks(cold);
  ASSERT_GE(blocks, 3) << "the prompt should span several blocks";
  ASSERT_TRUE(WaitFor(absl::Seconds(10), [&] { return published() >= uint64_t(blocks); }));
  const Completion pusher = cluster.Generate(GreedyRequest(Prompt(1), kMaxTokens));
  ASSERT_TRUE(pusher.status.ok()) << pusher.status.error_message();
  ASSERT_TRUE(WaitFor(absl::Seconds(10),
                      [&] { return published() >= uint64_t(blocks + FullBlocks(pusher)); }));
  const Completion warm = cluster.Generate(GreedyRequest(warm_prompt, kMaxTokens));
  ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();
  EXPECT_EQ(warm.tokens, ref.tokens);
  EXPECT_EQ(warm.usage.cached_prompt_tokens(), blocks * 16) << "the warm run missed the store";
  // A cold request's latency here, for the bound on the miss path below.
  absl::Duration cold_latency = absl::ZeroDuration();
  uint64_t expect_published = uint64_t(blocks + FullBlocks(pusher));
  for (int i = 2; i < 4; ++i) {
    const Completion c = cluster.Generate(GreedyRequest(Prompt(i), kMaxTokens));
    ASSERT_TRUE(c.status.ok()) << c.status.error_message();
    cold_latency = std::max(cold_latency, c.elapsed);
    expect_published += uint64_t(FullBlocks(c));
  }
  // Their blocks are published in the background: the baseline below is taken once that is
  // done, or a late publish would count as one made while the store was down.
  ASSERT_TRUE(WaitFor(absl::Seconds(10), [&] {
    absl::StatusOr<v1::WorkerStats> s = cluster.Stats("prefill-0");
    return s.ok() && s->running() == 0 && published() >= expect_published;
  }));
  const absl::StatusOr<v1::WorkerStats> before_or = cluster.Stats("prefill-0");
  ASSERT_TRUE(before_or.ok()) << before_or.status();
  const v1::WorkerStats before_kill = *before_or;
  const int64_t rss_before = VmRssKb(cluster.pid("prefill-0"));

  // The store dies.
  cluster.KillKvstore();
  const absl::Time killed = absl::Now();
  absl::Duration worst_down = absl::ZeroDuration();
  int down_requests = 0;
  // The warmed prompt and 12 new ones (whose blocks cannot be published).
  for (int i = -1; i < 12; ++i) {
    const std::string prompt = i < 0 ? warm_prompt : Prompt(100 + i);
    SCOPED_TRACE(absl::StrCat("while down: ", prompt.substr(0, 24)));
    const Completion want = GreedyReference(prompt, kMaxTokens);
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();
    const Completion c = cluster.Generate(GreedyRequest(prompt, kMaxTokens));
    ASSERT_TRUE(c.status.ok()) << c.status.error_message();
    EXPECT_EQ(c.tokens, want.tokens);
    EXPECT_EQ(c.text, want.text);
    EXPECT_EQ(c.usage.cached_prompt_tokens(), 0);
    worst_down = std::max(worst_down, c.elapsed);
    ++down_requests;
  }
  // Bounded: a cold request, plus at most the lookup and read deadlines, plus scheduling slack
  // on a loaded machine.
  const absl::Duration bound =
      cold_latency + absl::Milliseconds(kLookupMs + kReadMs) + absl::Milliseconds(1500);
  EXPECT_LT(worst_down, bound) << "a request took " << worst_down << " with the store down";

  // Publishing did not queue without bound: what could not be published was dropped.
  ASSERT_TRUE(WaitFor(absl::Seconds(15), [&] {
    absl::StatusOr<v1::WorkerStats> s = cluster.Stats("prefill-0");
    return s.ok() && s->kvstore_publish_dropped() >= before_kill.kvstore_publish_dropped() +
                                                        uint64_t(12 * (blocks - 1));
  })) << "publishing neither dropped nor stored the blocks";
  const absl::StatusOr<v1::WorkerStats> after_or = cluster.Stats("prefill-0");
  ASSERT_TRUE(after_or.ok()) << after_or.status();
  const v1::WorkerStats after_down = *after_or;
  EXPECT_EQ(after_down.kvstore_published_blocks(), before_kill.kvstore_published_blocks());
  const int64_t rss_after = VmRssKb(cluster.pid("prefill-0"));
  ASSERT_GT(rss_before, 0);
  EXPECT_LT(rss_after - rss_before, 32 * 1024)
      << "prefill RSS grew from " << rss_before << " KiB to " << rss_after << " KiB";

  // Restarted on the same port and SSD directory: the warmed prefix is served from SSD again.
  const absl::Status restarted = cluster.RestartKvstore();
  ASSERT_TRUE(restarted.ok()) << restarted;
  const absl::Time back = absl::Now();
  Completion hit;
  const bool hits_back = WaitFor(
      absl::Seconds(20),
      [&] {
        hit = cluster.Generate(GreedyRequest(warm_prompt, kMaxTokens));
        return hit.status.ok() && hit.usage.cached_prompt_tokens() > 0;
      },
      absl::Milliseconds(100));
  const absl::Duration recovery = absl::Now() - back;
  ASSERT_TRUE(hits_back) << "no hit from the restarted store: " << hit.status.error_message();
  EXPECT_EQ(hit.tokens, ref.tokens);
  EXPECT_EQ(hit.text, ref.text);
  EXPECT_EQ(hit.usage.cached_prompt_tokens(), blocks * 16);
  EXPECT_GT(hit.ttft.prefix_onboarding_tiers().ssd(), 0) << hit.ttft.ShortDebugString();
  std::string why;
  EXPECT_TRUE(cluster.WaitIdle(absl::Seconds(10), &why)) << why;
  std::fprintf(stderr,
               "kvstore kill: %d requests served cold while down (worst %.0f ms, cold %.0f ms, "
               "bound %.0f ms); %llu blocks dropped from the publish queue; prefill RSS %lld -> "
               "%lld KiB; down for %.0f ms; recovery_ms=%.0f (restart to the first SSD hit)\n",
               down_requests, absl::ToDoubleMilliseconds(worst_down),
               absl::ToDoubleMilliseconds(cold_latency), absl::ToDoubleMilliseconds(bound),
               static_cast<unsigned long long>(after_down.kvstore_publish_dropped() -
                                               before_kill.kvstore_publish_dropped()),
               static_cast<long long>(rss_before), static_cast<long long>(rss_after),
               absl::ToDoubleMilliseconds(back - killed), absl::ToDoubleMilliseconds(recovery));
}

}  // namespace
}  // namespace tandem::testing
