// SampleTopKTopPReference against an independent statement of the same distribution: ids sorted
// by probability, top-k and top-p cut on that order, renormalised. Sweeping u over a fine grid
// must select each survivor in proportion to its probability and never anything else.
#include "tandem/kernels/topk_topp.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/unit/kernels/kernel_test_util.h"

namespace tandem::kernels {
namespace {

std::map<int32_t, double> ExpectedDistribution(const std::vector<float>& logits,
                                               const TopKTopPParams& p) {
  const int32_t n = static_cast<int32_t>(logits.size());
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  int32_t keep = (p.top_k > 0 && p.top_k < n) ? p.top_k : n;
  std::vector<double> prob(keep);
  double z = 0;
  for (int32_t i = 0; i < keep; ++i) {
    prob[i] = std::exp((double(logits[order[i]]) - logits[order[0]]) / p.temperature);
    z += prob[i];
  }
  if (p.top_p < 1.0f) {
    double cum = 0;
    for (int32_t i = 0; i < keep; ++i) {
      cum += prob[i] / z;
      if (cum >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  std::map<int32_t, double> out;
  double z2 = 0;
  for (int32_t i = 0; i < keep; ++i) z2 += prob[i];
  for (int32_t i = 0; i < keep; ++i) out[order[i]] = prob[i] / z2;
  return out;
}

TEST(TopKTopPReferenceTest, UniformSweepReproducesTheFilteredDistribution) {
  const TopKTopPParams cases[] = {
      {1.0f, 0, 1.0f}, {0.7f, 5, 1.0f}, {1.3f, 0, 0.8f}, {1.0f, 12, 0.5f}, {0.5f, 1, 1.0f},
  };
  int seed = 1;
  for (const TopKTopPParams& p : cases) {
    const auto logits = testing::RandomNormal(40, seed++, 2.0f);
    const auto want = ExpectedDistribution(logits, p);
    constexpr int kSteps = 20000;
    std::map<int32_t, int> hits;
    for (int j = 0; j < kSteps; ++j) {
      const double u = (j + 0.5) / kSteps;
      ++hits[SampleTopKTopPReference(logits.data(), 40, p, u)];
    }
    for (const auto& [id, count] : hits) {
      ASSERT_TRUE(want.count(id)) << "id " << id << " was filtered out, top_k " << p.top_k
                                  << " top_p " << p.top_p;
    }
    for (const auto& [id, prob] : want) {
      EXPECT_NEAR(double(hits[id]) / kSteps, prob, 2.0 / kSteps) << id;
    }
  }
}

TEST(TopKTopPReferenceTest, GreedyIsArgmaxWithLowestIdOnTies) {
  std::vector<float> logits = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f};
  TopKTopPParams p;
  p.temperature = 0.0f;
  EXPECT_EQ(SampleTopKTopPReference(logits.data(), 5, p, 0.99), 1);
  p.temperature = 1.0f;
  p.top_k = 1;
  EXPECT_EQ(SampleTopKTopPReference(logits.data(), 5, p, 0.99), 3);  // ties at the cut kept
  EXPECT_EQ(SampleTopKTopPReference(logits.data(), 5, p, 0.0), 1);
}

}  // namespace
}  // namespace tandem::kernels
