// The router's TTFT prediction (services/router/slo.h): the pool's backlog and the queue ahead
// shared over the fitted workers, the request's own prefill, and the overhead learned from
// measured TTFTs (either sign); unfitted workers are left out.
#include "services/router/slo.h"

#include <random>

#include "gtest/gtest.h"

namespace tandem::router {
namespace {

WorkerRegistry::Load Worker(int64_t tokens, int32_t requests, double intercept, double per_token,
                            uint64_t steps = 100) {
  WorkerRegistry::Load l;
  l.worker_id = std::string(1, 'w');  // (a literal trips GCC 12's -Wrestrict false positive)
  l.backlog_tokens = tokens;
  l.backlog_requests = requests;
  l.cost.set_intercept_s(intercept);
  l.cost.set_prefill_token_s(per_token);
  l.cost.set_steps(steps);
  return l;
}

TEST(SloTest, OneWorkerWaitsForItsWholeBacklogThenItsOwnPrefill) {
  // 3 requests of 1000 tokens in flight, 2 (500 tokens) queued ahead, own 200 tokens.
  const TtftPrediction p =
      PredictTtft({Worker(1000, 3, 1e-3, 1e-5)}, /*ahead_tokens=*/500, /*ahead_requests=*/2,
                  /*tokens=*/200, /*correction_s=*/0.004);
  ASSERT_TRUE(p.known);
  EXPECT_NEAR(p.backlog_s, 3e-3 + 1000e-5 + 2e-3 + 500e-5, 1e-12);
  EXPECT_NEAR(p.own_s, 1e-3 + 200e-5, 1e-12);
  EXPECT_NEAR(p.seconds, p.backlog_s + p.own_s + 0.004, 1e-12);
}

TEST(SloTest, PoolSharesTheBacklogAndUnfittedWorkersDoNotCount) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.5, 2.0);
  for (int trial = 0; trial < 50; ++trial) {
    const double i0 = 1e-3 * u(rng), t0 = 1e-5 * u(rng), i1 = 1e-3 * u(rng), t1 = 1e-5 * u(rng);
    const int64_t b0 = static_cast<int64_t>(1000 * u(rng)), b1 = static_cast<int64_t>(300 * u(rng));
    const std::vector<WorkerRegistry::Load> pool = {
        Worker(b0, 2, i0, t0), Worker(b1, 1, i1, t1),
        Worker(99999, 50, 1, 1, /*steps=*/kMinFittedSteps - 1)};  // not fitted yet: ignored
    const TtftPrediction p = PredictTtft(pool, 400, 1, 100, 0);
    ASSERT_TRUE(p.known);
    // In long double, from the definition: the work ahead over two workers at the mean cost.
    const long double mi = (static_cast<long double>(i0) + i1) / 2, mt = (static_cast<long double>(t0) + t1) / 2;
    const long double work = 2 * static_cast<long double>(i0) + b0 * static_cast<long double>(t0) + i1 +
                             b1 * static_cast<long double>(t1) + mi + 400 * mt;
    EXPECT_NEAR(p.backlog_s, static_cast<double>(work / 2), 1e-12);
    EXPECT_NEAR(p.own_s, static_cast<double>(mi + 100 * mt), 1e-12);
  }
  EXPECT_FALSE(PredictTtft({Worker(10, 1, 1e-3, 1e-5, 0)}, 0, 0, 10, 0).known);
  EXPECT_FALSE(PredictTtft({}, 0, 0, 10, 0).known);
}

TEST(SloTest, ANegativeFittedInterceptCountsAsZero) {
  // Steps all of one size leave the intercept badly determined; it may come out below zero.
  const TtftPrediction p = PredictTtft({Worker(768, 2, -0.02, 2e-4)}, 0, 0, 384, 0);
  ASSERT_TRUE(p.known) << "the per-token cost alone still predicts";
  EXPECT_NEAR(p.backlog_s, 768 * 2e-4, 1e-12);
  EXPECT_NEAR(p.own_s, 384 * 2e-4, 1e-12);
  EXPECT_NEAR(BacklogSeconds(Worker(768, 2, -0.02, 2e-4)), 768 * 2e-4, 1e-12);
}

TEST(SloTest, BacklogIsTheWorkersFittedCostOfItsWorkAndZeroUnfitted) {
  EXPECT_NEAR(BacklogSeconds(Worker(1000, 2, 1e-3, 1e-5)), 2e-3 + 1000e-5, 1e-12);
  EXPECT_NEAR(BacklogSeconds(Worker(100, 1, 1e-3, 1e-5)), 1e-3 + 100e-5, 1e-12);
  EXPECT_EQ(BacklogSeconds(Worker(100, 1, 1e-3, 1e-5, /*steps=*/0)), 0);
  EXPECT_EQ(BacklogSeconds(Worker(0, 0, 0, 0, 0)), 0);
}

TEST(SloTest, CorrectionSettlesOnThe90thPercentileOfTheResidualsEitherWay) {
  SloTracker t;
  EXPECT_EQ(t.correction_s(), 0);
  t.Observe(0.010, 0.013);  // the first observation is taken as is
  EXPECT_NEAR(t.correction_s(), 0.003, 1e-12);
  std::mt19937 rng(11);
  // Measured = predicted + U(20 ms, 120 ms): the 0.9 quantile of the residual is 110 ms.
  std::uniform_real_distribution<double> late(0.020, 0.120);
  for (int i = 0; i < 20000; ++i) t.Observe(0.050, 0.050 + late(rng));
  EXPECT_NEAR(t.correction_s(), 0.110, 0.008);
  // Then the workers batch better than the model: residuals U(-40 ms, -10 ms), quantile -13 ms.
  std::uniform_real_distribution<double> early(-0.040, -0.010);
  for (int i = 0; i < 20000; ++i) t.Observe(0.200, 0.200 + early(rng));
  EXPECT_NEAR(t.correction_s(), -0.013, 0.003);
  // A GPU-sized scale: residuals U(0, 2 ms) settle too, on 2.0e-3 * 0.9.
  std::uniform_real_distribution<double> tiny(0.0, 0.002);
  for (int i = 0; i < 40000; ++i) t.Observe(0.010, 0.010 + tiny(rng));
  EXPECT_NEAR(t.correction_s(), 0.0018, 0.0003);
  // A stall is bounded.
  for (int i = 0; i < 20000; ++i) t.Observe(0.0, 30.0);
  EXPECT_LE(t.correction_s(), 1.0);
}

TEST(SloTest, AFreshTrackerSettlesWithinAHundredRequests) {
  // A fresh router under load: residuals U(200 ms, 300 ms), 0.9 quantile 290 ms, first seen
  // after a quiet warm-up whose residual was 0. Every seed settles near it within 100 requests.
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    SloTracker t;
    t.Observe(0.1, 0.1);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> late(0.200, 0.300);
    for (int i = 0; i < 100; ++i) t.Observe(0.1, 0.1 + late(rng));
    EXPECT_NEAR(t.correction_s(), 0.290, 0.03) << "seed " << seed;
  }
}

TEST(SloTest, ANegativeCorrectionNeverPredictsLessThanTheOwnPrefill) {
  const TtftPrediction p = PredictTtft({Worker(1000, 1, 1e-3, 1e-5)}, 0, 0, 200, -1.0);
  ASSERT_TRUE(p.known);
  EXPECT_NEAR(p.seconds, p.own_s, 1e-12);
  const TtftPrediction q = PredictTtft({Worker(1000, 1, 1e-3, 1e-5)}, 0, 0, 200, -0.005);
  EXPECT_NEAR(q.seconds, q.backlog_s + q.own_s - 0.005, 1e-12);
}

}  // namespace
}  // namespace tandem::router
