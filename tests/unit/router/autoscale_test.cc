// The replica recommendation rule and its helpers on hand-computed inputs.
#include "services/router/autoscale.h"

#include <vector>

#include "gtest/gtest.h"

namespace tandem::router {
namespace {

AutoscaleOptions Slo(double ttft_s, double itl_s) {
  AutoscaleOptions o;
  o.slo_ttft_s = ttft_s;
  o.slo_itl_s = itl_s;
  o.target_utilization = 0.8;
  o.min_replicas = 1;
  o.max_replicas = 16;
  return o;
}

TEST(AutoscaleTest, LatencyTermScalesTheCurrentCountByP90OverSlo) {
  AutoscaleInputs in;
  in.current_prefill = 2;
  in.current_decode = 3;
  in.p90_ttft_s = 0.75;  // 2 * 0.75 / 0.5 = 3
  in.p90_itl_s = 0.05;   // 3 * 0.05 / 0.04 = 3.75 -> 4
  const Recommendation r = Recommend(in, Slo(0.5, 0.04));
  EXPECT_EQ(r.prefill, 3);
  EXPECT_EQ(r.decode, 4);
}

TEST(AutoscaleTest, ThroughputTermKeepsHeadroom) {
  AutoscaleInputs in;
  in.current_prefill = 1;
  in.current_decode = 1;
  in.p90_ttft_s = 0.1;  // well under the SLO: latency alone would say 1
  in.p90_itl_s = 0.01;
  in.prompt_tokens_per_s = 5000;  // 5000 / (1000 * 0.8) = 6.25 -> 7
  in.prefill_capacity_tps = 1000;
  in.output_tokens_per_s = 480;  // 480 / (200 * 0.8) = 3 exactly (no float round-up to 4)
  in.decode_capacity_tps = 200;
  const Recommendation r = Recommend(in, Slo(1.0, 0.05));
  EXPECT_EQ(r.prefill, 7);
  EXPECT_EQ(r.decode, 3);
}

TEST(AutoscaleTest, TheLargerTermWins) {
  AutoscaleInputs in;
  in.current_prefill = 4;
  in.p90_ttft_s = 2.0;           // 4 * 2 / 1 = 8
  in.prompt_tokens_per_s = 800;  // 800 / (1000 * 0.8) = 1
  in.prefill_capacity_tps = 1000;
  EXPECT_EQ(Recommend(in, Slo(1.0, 0)).prefill, 8);
  in.prompt_tokens_per_s = 9600;  // 12
  EXPECT_EQ(Recommend(in, Slo(1.0, 0)).prefill, 12);
}

TEST(AutoscaleTest, UnknownInputsKeepTheCurrentCountWithinBounds) {
  AutoscaleInputs in;
  in.current_prefill = 5;
  in.current_decode = 0;
  // No SLO, no capacity, no samples: stay; zero workers still recommends the minimum.
  Recommendation r = Recommend(in, Slo(0, 0));
  EXPECT_EQ(r.prefill, 5);
  EXPECT_EQ(r.decode, 1);
  // A latency far beyond the target is capped at max_replicas.
  in.p90_ttft_s = 100;
  r = Recommend(in, Slo(0.01, 0));
  EXPECT_EQ(r.prefill, 16);
  // An SLO without samples is no signal either.
  in.p90_ttft_s = -1;
  EXPECT_EQ(Recommend(in, Slo(0.01, 0)).prefill, 5);
}

TEST(AutoscaleTest, PercentileIsNearestRank) {
  std::vector<double> v = {5, 1, 4, 2, 3, 10, 9, 8, 7, 6};
  EXPECT_DOUBLE_EQ(Percentile(v, 0.9), 9);
  EXPECT_DOUBLE_EQ(Percentile(v, 0.5), 5);
  EXPECT_DOUBLE_EQ(Percentile(v, 0.0), 1);
  EXPECT_DOUBLE_EQ(Percentile(v, 1.0), 10);
  EXPECT_DOUBLE_EQ(Percentile(v, 0.99), 10);
  std::vector<double> empty;
  EXPECT_LT(Percentile(empty, 0.9), 0);
  std::vector<double> one = {0.25};
  EXPECT_DOUBLE_EQ(Percentile(one, 0.9), 0.25);
}

TEST(AutoscaleTest, SampleWindowForgetsOldValuesAndCaps) {
  SampleWindow w(absl::Seconds(10), /*max_samples=*/3);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  w.Add(t0, 1);
  w.Add(t0 + absl::Seconds(5), 2);
  w.Add(t0 + absl::Seconds(9), 4);
  EXPECT_DOUBLE_EQ(w.Sum(), 7);
  w.Expire(t0 + absl::Seconds(12));  // drops the value at t0
  EXPECT_EQ(w.Values(), (std::vector<double>{2, 4}));
  w.Add(t0 + absl::Seconds(13), 8);
  w.Add(t0 + absl::Seconds(14), 16);  // over the cap: the oldest (2) goes
  EXPECT_EQ(w.Values(), (std::vector<double>{4, 8, 16}));
  w.Expire(t0 + absl::Seconds(100));
  EXPECT_EQ(w.size(), 0u);
}

}  // namespace
}  // namespace tandem::router
