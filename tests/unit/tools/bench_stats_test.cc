// `tandem bench`'s statistics (percentiles, TPOT, goodput) and workload generation (prompts,
// arrival times) on hand-computed inputs.
#include "tools/tandem/bench_stats.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "tools/tandem/bench_workload.h"

namespace tandem::tools::bench {
namespace {

TEST(BenchStatsTest, PercentilesInterpolateLikeNumpy) {
  const std::vector<double> v = {7, 1, 10, 3, 2, 4, 5, 6, 9, 8};  // 1..10, shuffled
  EXPECT_DOUBLE_EQ(PercentileLinear(v, 50), 5.5);
  EXPECT_DOUBLE_EQ(PercentileLinear(v, 90), 9.1);
  EXPECT_DOUBLE_EQ(PercentileLinear(v, 99), 9.91);
  EXPECT_DOUBLE_EQ(PercentileLinear(v, 0), 1);
  EXPECT_DOUBLE_EQ(PercentileLinear(v, 100), 10);
  EXPECT_DOUBLE_EQ(PercentileLinear({42}, 99), 42);
  EXPECT_DOUBLE_EQ(PercentileLinear({}, 50), 0);
  const Summary s = Summarize(v);
  EXPECT_EQ(s.count, 10u);
  EXPECT_DOUBLE_EQ(s.mean, 5.5);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 10);
  EXPECT_DOUBLE_EQ(s.p90, 9.1);
}

RequestResult Ok(double ttft, double e2e, int in, int out, std::vector<double> itl) {
  RequestResult r;
  r.ok = true;
  r.ttft_s = ttft;
  r.e2e_s = e2e;
  r.prompt_tokens = in;
  r.output_tokens = out;
  r.itl_s = std::move(itl);
  return r;
}

TEST(BenchStatsTest, TpotFollowsVllm) {
  EXPECT_DOUBLE_EQ(Tpot(Ok(0.1, 1.0, 5, 10, {})), 0.1);  // (1.0 - 0.1) / 9
  EXPECT_LT(Tpot(Ok(0.1, 0.1, 5, 1, {})), 0);            // one token: no TPOT
}

TEST(BenchStatsTest, ThroughputAndGoodputOnKnownRequests) {
  std::vector<RequestResult> rs = {
      Ok(0.1, 1.0, 5, 10, std::vector<double>(9, 0.1)),  // TTFT 100, TPOT 100: good
      Ok(0.3, 0.5, 7, 3, {0.1, 0.1}),                    // TTFT 300 > 200: not good
      Ok(0.05, 0.05, 2, 1, {}),                          // one token: TPOT 0, good
  };
  RequestResult failed;
  failed.error = "14: down";
  rs.push_back(failed);
  Slo slo;
  slo.ttft_ms = 200;
  slo.tpot_ms = 150;
  const BenchStats s = ComputeStats(rs, 2.0, slo);
  EXPECT_EQ(s.completed, 3u);
  EXPECT_EQ(s.failed, 1u);
  EXPECT_EQ(s.good_requests, 2u);
  EXPECT_DOUBLE_EQ(s.goodput, 1.0);
  EXPECT_DOUBLE_EQ(s.request_throughput, 1.5);
  EXPECT_EQ(s.total_input_tokens, 14);
  EXPECT_EQ(s.total_output_tokens, 14);
  EXPECT_DOUBLE_EQ(s.output_token_throughput, 7.0);
  EXPECT_DOUBLE_EQ(s.total_token_throughput, 14.0);
  EXPECT_EQ(s.ttft_ms.count, 3u);
  EXPECT_NEAR(s.ttft_ms.mean, 150, 1e-9);
  EXPECT_EQ(s.tpot_ms.count, 2u);  // the one-token request has none
  EXPECT_NEAR(s.tpot_ms.mean, 100, 1e-9);
  EXPECT_EQ(s.itl_ms.count, 11u);
  EXPECT_NEAR(s.itl_ms.p99, 100, 1e-9);
  EXPECT_NEAR(s.e2e_ms.max, 1000, 1e-9);
  EXPECT_TRUE(std::is_sorted(s.e2e_values_ms.begin(), s.e2e_values_ms.end()));
  // Without an SLO every successful request counts.
  EXPECT_DOUBLE_EQ(ComputeStats(rs, 2.0, Slo{}).goodput, 1.5);
  // An e2e target alone.
  Slo e2e;
  e2e.e2e_ms = 600;
  EXPECT_EQ(ComputeStats(rs, 2.0, e2e).good_requests, 2u);
  const nlohmann::json j = StatsJson(s);
  EXPECT_DOUBLE_EQ(j["goodput"].get<double>(), 1.0);
  EXPECT_EQ(j["ttft_ms"]["count"].get<int>(), 3);
}

// Acceptance over successful requests only: rate = accepted / drafted, length = tokens per
// verify step with the target's own token.
TEST(BenchStatsTest, SpeculativeAcceptanceOverSuccessfulRequests) {
  std::vector<RequestResult> rs(3);
  rs[0].ok = true;
  rs[0].spec_verify_steps = 10;
  rs[0].spec_draft_tokens = 40;
  rs[0].spec_accepted_tokens = 25;
  rs[1].ok = true;  // did not speculate
  rs[2].ok = false;
  rs[2].spec_verify_steps = 50;
  rs[2].spec_draft_tokens = 200;
  const BenchStats s = ComputeStats(rs, 1.0, {});
  EXPECT_EQ(s.spec_verify_steps, 10);
  EXPECT_DOUBLE_EQ(s.spec_acceptance_rate, 25.0 / 40.0);
  EXPECT_DOUBLE_EQ(s.spec_mean_accept_length, 1.0 + 25.0 / 10.0);
  const nlohmann::json j = StatsJson(s);
  EXPECT_EQ(j["speculative"]["draft_tokens"].get<int>(), 40);
  EXPECT_DOUBLE_EQ(j["speculative"]["mean_accept_length"].get<double>(), 3.5);
  const BenchStats none = ComputeStats({rs[1]}, 1.0, {});
  EXPECT_EQ(none.spec_acceptance_rate, 0);
  EXPECT_EQ(none.spec_mean_accept_length, 0);
}

TEST(BenchStatsTest, ParsesSloSpecs) {
  absl::StatusOr<Slo> s = ParseSlo("ttft:500,tpot:50");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->ttft_ms, 500);
  EXPECT_DOUBLE_EQ(s->tpot_ms, 50);
  EXPECT_DOUBLE_EQ(s->e2e_ms, 0);
  s = ParseSlo("e2el:2500.5");
  ASSERT_TRUE(s.ok());
  EXPECT_DOUBLE_EQ(s->e2e_ms, 2500.5);
  EXPECT_FALSE(ParseSlo("").value().any());
  for (const char* bad : {"ttft", "ttft:-1", "ttft:0", "itl:5", "ttft:abc", "ttft:1:2"}) {
    EXPECT_EQ(ParseSlo(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

WorkloadOptions Wl(Workload w, int n) {
  WorkloadOptions o;
  o.workload = w;
  o.num_requests = n;
  o.input_len = 12;
  o.output_len = 5;
  o.prefix_len = 20;
  o.turns = 3;
  o.vocab_size = 100;
  o.seed = 7;
  return o;
}

TEST(BenchWorkloadTest, RandomPromptsHaveExactLengthsAndAreSeeded) {
  auto a = MakeRequests(Wl(Workload::kRandom, 4));
  auto b = MakeRequests(Wl(Workload::kRandom, 4));
  WorkloadOptions other = Wl(Workload::kRandom, 4);
  other.seed = 8;
  auto c = MakeRequests(other);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_EQ(a->size(), 4u);
  for (const PlannedRequest& r : *a) {
    EXPECT_EQ(r.prompt.size(), 12u);
    EXPECT_EQ(r.max_tokens, 5);
    for (int32_t t : r.prompt) {
      EXPECT_GE(t, kFirstOrdinaryToken);
      EXPECT_LT(t, 100);
    }
  }
  EXPECT_EQ((*a)[2].prompt, (*b)[2].prompt);
  EXPECT_NE((*a)[2].prompt, (*c)[2].prompt);
  EXPECT_NE((*a)[0].prompt, (*a)[1].prompt);
}

TEST(BenchWorkloadTest, SharedPrefixAndMultiTurnShapes) {
  auto sp = MakeRequests(Wl(Workload::kSharedPrefix, 3));
  ASSERT_TRUE(sp.ok());
  for (const PlannedRequest& r : *sp) {
    ASSERT_EQ(r.prompt.size(), 32u);
    EXPECT_TRUE(std::equal(r.prompt.begin(), r.prompt.begin() + 20, (*sp)[0].prompt.begin()));
  }
  EXPECT_NE((*sp)[0].prompt, (*sp)[1].prompt);  // the suffixes differ

  auto mt = MakeRequests(Wl(Workload::kMultiTurn, 6));
  ASSERT_TRUE(mt.ok());
  const std::vector<int> sessions = {0, 0, 0, 1, 1, 1}, turns = {0, 1, 2, 0, 1, 2};
  const std::vector<size_t> lens = {12, 29, 46, 12, 29, 46};  // + reply 5 + input 12 per turn
  for (int i = 0; i < 6; ++i) {
    const PlannedRequest& r = (*mt)[i];
    EXPECT_EQ(r.session, sessions[i]);
    EXPECT_EQ(r.turn, turns[i]);
    EXPECT_EQ(r.prompt.size(), lens[i]) << i;
    if (r.turn > 0) {  // the previous turn's prompt is this one's history
      const std::vector<int32_t>& prev = (*mt)[i - 1].prompt;
      EXPECT_TRUE(std::equal(prev.begin(), prev.end(), r.prompt.begin())) << i;
    }
  }
  EXPECT_NE((*mt)[3].prompt, std::vector<int32_t>((*mt)[0].prompt));

  WorkloadOptions bad = Wl(Workload::kRandom, 0);
  EXPECT_FALSE(MakeRequests(bad).ok());
  bad = Wl(Workload::kRandom, 2);
  bad.vocab_size = 3;
  EXPECT_FALSE(MakeRequests(bad).ok());
}

TEST(BenchWorkloadTest, ArrivalTimes) {
  auto c = ArrivalTimes(4, 2.0, Arrival::kConstant, 1);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, (std::vector<double>{0, 0.5, 1.0, 1.5}));
  auto b = ArrivalTimes(5, 4.0, Arrival::kBurst, 1, /*burst_size=*/2);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, (std::vector<double>{0, 0, 0.5, 0.5, 1.0}));
  auto p = ArrivalTimes(20000, 10.0, Arrival::kPoisson, 5);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)[0], 0);
  EXPECT_TRUE(std::is_sorted(p->begin(), p->end()));
  const double mean_gap = p->back() / (p->size() - 1);
  EXPECT_NEAR(mean_gap, 0.1, 0.003);  // exponential gaps of mean 1/rate
  // Gaps of an exponential distribution: about 63% are below the mean.
  int below = 0;
  for (size_t i = 1; i < p->size(); ++i) below += ((*p)[i] - (*p)[i - 1]) < 0.1;
  EXPECT_NEAR(below / static_cast<double>(p->size() - 1), 1 - std::exp(-1.0), 0.02);
  EXPECT_FALSE(ArrivalTimes(3, 0, Arrival::kPoisson, 1).ok());
  EXPECT_EQ(ParseArrival("burst").value(), Arrival::kBurst);
  EXPECT_FALSE(ParseArrival("uniform").ok());
  EXPECT_EQ(ParseWorkload("multi-turn").value(), Workload::kMultiTurn);
  EXPECT_FALSE(ParseWorkload("chat").ok());
}

TEST(BenchWorkloadTest, ParsesAClassMixAndDrawsClassesByWeight) {
  auto mix = ParseMix("interactive:1:ttft=400:tpot=50, batch:3");
  ASSERT_TRUE(mix.ok()) << mix.status();
  ASSERT_EQ(mix->size(), 2u);
  EXPECT_EQ((*mix)[0].name, "interactive");
  EXPECT_DOUBLE_EQ((*mix)[0].ttft_ms, 400);
  EXPECT_DOUBLE_EQ((*mix)[0].tpot_ms, 50);
  EXPECT_EQ((*mix)[1].name, "batch");
  EXPECT_DOUBLE_EQ((*mix)[1].weight, 3);
  EXPECT_DOUBLE_EQ((*mix)[1].ttft_ms, 0);
  EXPECT_TRUE(ParseMix("").value().empty());
  for (const char* bad : {"interactive", "interactive:0", "interactive:x", "a:1,a:2",
                          "a:1:ttft", "a:1:ttft=0", "a:1:e2e=5", ":1"}) {
    EXPECT_FALSE(ParseMix(bad).ok()) << bad;
  }
  auto plan = MakeRequests(Wl(Workload::kRandom, 4000));
  ASSERT_TRUE(plan.ok());
  AssignClasses(*mix, 7, &*plan);
  int batch = 0;
  for (const PlannedRequest& r : *plan) {
    ASSERT_TRUE(r.cls == 0 || r.cls == 1);
    batch += r.cls == 1;
  }
  EXPECT_NEAR(batch / 4000.0, 0.75, 0.03);
  auto again = MakeRequests(Wl(Workload::kRandom, 4000));
  AssignClasses(*mix, 7, &*again);
  for (size_t i = 0; i < plan->size(); ++i) ASSERT_EQ((*plan)[i].cls, (*again)[i].cls);
  std::vector<PlannedRequest> none = *again;
  AssignClasses({}, 7, &none);
  EXPECT_EQ(none[0].cls, (*again)[0].cls);  // no classes: left as they were
}

}  // namespace
}  // namespace tandem::tools::bench
