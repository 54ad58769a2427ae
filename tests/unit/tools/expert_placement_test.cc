// Expert placement: parsing the load series, the placement's invariants on skewed loads, a case
// small enough to check by hand, and the refusals.
#include "tools/tandem/expert_placement.h"

#include <cmath>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tandem::tools {
namespace {

// Zipf-like loads (expert ranked k gets 1/k^s of the tokens), shuffled per layer.
ExpertLoad Skewed(int32_t n_layer, int32_t n_expert, double s, uint32_t seed) {
  ExpertLoad load{n_layer, n_expert, {}};
  std::mt19937 rng(seed);
  for (int32_t l = 0; l < n_layer; ++l) {
    std::vector<double> row(n_expert);
    for (int32_t k = 0; k < n_expert; ++k) row[k] = std::round(10000.0 / std::pow(k + 1, s));
    std::shuffle(row.begin(), row.end(), rng);
    load.tokens.insert(load.tokens.end(), row.begin(), row.end());
  }
  return load;
}

TEST(ExpertPlacementTest, ParsesAndSumsTheLoadSeriesOfSeveralWorkers) {
  const std::string text =
      "# TYPE tandem_expert_tokens_total counter\n"
      "tandem_expert_tokens_total{expert=\"0\",layer=\"0\",model_name=\"m\",role=\"decode\"} 5\n"
      "tandem_expert_tokens_total{expert=\"1\",layer=\"0\",model_name=\"m\",role=\"decode\"} 7\n"
      "tandem_expert_tokens_total{expert=\"1\",layer=\"1\",model_name=\"m\",role=\"decode\"} 2\n"
      "tandem_expert_tokens_total{expert=\"1\",layer=\"1\",model_name=\"m\",role=\"prefill\"} 3\n"
      "tandem_kv_cache_usage_perc{model_name=\"m\",role=\"decode\"} 0.5\n";
  auto load = ParseExpertLoad(text);
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->n_layer, 2);
  EXPECT_EQ(load->n_expert, 2);
  EXPECT_EQ(load->at(0, 0), 5);
  EXPECT_EQ(load->at(0, 1), 7);
  EXPECT_EQ(load->at(1, 0), 0);
  EXPECT_EQ(load->at(1, 1), 5);
  EXPECT_EQ(ParseExpertLoad("tandem_kv_cache_usage_perc 1\n").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      ParseExpertLoad("tandem_expert_tokens_total{expert=\"x\",layer=\"0\"} 1\n").status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(ExpertPlacementTest, EveryExpertIsPlacedSlotsAreEvenAndSkewIsBalanced) {
  const ExpertLoad load = Skewed(6, 32, 1.2, 4);
  for (const auto& [ranks, redundant] :
       {std::pair{4, 0}, std::pair{4, 4}, std::pair{8, 8}, std::pair{2, 2}}) {
    SCOPED_TRACE(absl::StrCat(ranks, " ranks, ", redundant, " redundant"));
    auto placed = PlaceExperts(load, ranks, redundant);
    ASSERT_TRUE(placed.ok()) << placed.status();
    auto contiguous = Placement::Contiguous(load.n_layer, load.n_expert, ranks);
    ASSERT_TRUE(contiguous.ok());
    ASSERT_EQ(placed->layers.size(), 6u);
    for (int32_t l = 0; l < load.n_layer; ++l) {
      std::vector<int> copies(load.n_expert, 0);
      for (const auto& held : placed->layers[l]) {
        EXPECT_EQ(static_cast<int>(held.size()), (32 + redundant) / ranks);
        EXPECT_EQ(std::set<int32_t>(held.begin(), held.end()).size(), held.size())
            << "an expert twice on one rank";
        for (int32_t e : held) ++copies[e];
      }
      int extra = 0;
      for (int c : copies) {
        EXPECT_GE(c, 1);
        extra += c - 1;
      }
      EXPECT_EQ(extra, redundant);
      const double before = Imbalance(load, *contiguous, l);
      const double after = Imbalance(load, *placed, l);
      EXPECT_LE(after, before + 1e-12) << "layer " << l;
      EXPECT_GE(after, 1.0);
      // The hottest expert alone holds 10000 of ~27600 tokens (s = 1.2 over 32): without
      // replicas a rank carrying it is at least that loaded; with them the ranks even out.
      if (redundant >= ranks) {
        EXPECT_LT(after, 1.1) << "layer " << l;
      }
    }
  }
}

TEST(ExpertPlacementTest, SmallCaseByHand) {
  // Loads 10, 1 x 6, 4 (20 tokens) over 2 ranks of 4 slots: the hot expert's rank must take
  // three others, 13 against a mean of 10. With 2 redundant slots the hot expert and the next
  // one are split across both ranks: 5 + 2 + 1 + 1 + 1 = 10 on each.
  ExpertLoad load{1, 8, {10, 1, 1, 1, 1, 1, 1, 4}};
  auto none = PlaceExperts(load, 2, 0);
  ASSERT_TRUE(none.ok());
  EXPECT_NEAR(Imbalance(load, *none, 0), 1.3, 1e-12);
  auto two = PlaceExperts(load, 2, 2);
  ASSERT_TRUE(two.ok());
  EXPECT_NEAR(Imbalance(load, *two, 0), 1.0, 1e-12);
  for (const auto& held : two->layers[0]) {
    EXPECT_NE(std::find(held.begin(), held.end(), 0), held.end()) << "expert 0 on every rank";
    EXPECT_NE(std::find(held.begin(), held.end(), 7), held.end()) << "expert 7 on every rank";
  }
  const nlohmann::json j = two->ToJson();
  EXPECT_EQ(j["ranks"], 2);
  EXPECT_EQ(j["layers"][0].size(), 2u);
}

TEST(ExpertPlacementTest, RefusesUnevenOrImpossiblePlacements) {
  const ExpertLoad load = Skewed(1, 8, 1.0, 1);
  EXPECT_EQ(PlaceExperts(load, 3, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlaceExperts(load, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlaceExperts(load, 2, -2).status().code(), absl::StatusCode::kInvalidArgument);
  // 8 experts on 2 ranks can have at most 8 extra replicas (each expert on both).
  EXPECT_EQ(PlaceExperts(load, 2, 10).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(PlaceExperts(load, 2, 8).ok());
}

}  // namespace
}  // namespace tandem::tools
