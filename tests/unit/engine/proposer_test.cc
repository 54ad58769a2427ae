// The n-gram proposer, the --speculative parser and the adaptive draft length.
#include "engine/spec/proposer.h"

#include <random>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

std::vector<int32_t> Propose(Proposer& p, const std::vector<int32_t>& tokens, int k) {
  std::vector<int32_t> d = {99, 99};  // replaced, never appended to
  p.Propose(tokens, k, &d);
  return d;
}

TEST(NgramProposerTest, ContinuesTheLatestEarlierOccurrenceOfTheLongestSuffix) {
  NgramProposer p(1, 3);
  // Suffix "2 3" last occurred at index 5 (followed by 8 9), earlier at 1 (followed by 4 5);
  // the 3-gram "7 2 3" never occurred before, so the 2-gram decides, latest occurrence first.
  const std::vector<int32_t> t = {1, 2, 3, 4, 5, 2, 3, 8, 9, 7, 2, 3};
  EXPECT_EQ(Propose(p, t, 4), (std::vector<int32_t>{8, 9, 7, 2}));
  EXPECT_EQ(Propose(p, t, 2), (std::vector<int32_t>{8, 9}));
  // The longer match wins over a later shorter one: "1 2 3" occurred at 0 (then 4); "2 3" alone
  // occurred later, at 5.
  const std::vector<int32_t> u = {1, 2, 3, 4, 6, 2, 3, 5, 1, 2, 3};
  EXPECT_EQ(Propose(p, u, 3), (std::vector<int32_t>{4, 6, 2}));
}

TEST(NgramProposerTest, DraftStopsAtTheEndOfWhatIsKnown) {
  NgramProposer p(1, 3);
  // The only earlier "5" is at index 3: what follows it is the suffix itself, cut at the end.
  EXPECT_EQ(Propose(p, {1, 2, 3, 5, 6, 5}, 8), (std::vector<int32_t>{6, 5}));
}

TEST(NgramProposerTest, NoGuessWithoutAMatch) {
  NgramProposer p(2, 3);
  EXPECT_TRUE(Propose(p, {1, 2, 3, 4, 5}, 4).empty());
  EXPECT_TRUE(Propose(p, {7}, 4).empty());
  EXPECT_TRUE(Propose(p, {}, 4).empty());
  EXPECT_TRUE(Propose(p, {1, 2, 1, 2}, 0).empty());
  // ngram_min 2: a single repeated token is not enough.
  EXPECT_TRUE(Propose(p, {4, 1, 2, 3, 4}, 4).empty());
  NgramProposer one(1, 3);
  EXPECT_EQ(Propose(one, {4, 1, 2, 3, 4}, 4), (std::vector<int32_t>{1, 2, 3, 4}));
}

TEST(ParseSpeculativeTest, AcceptsTheDesignedForms) {
  auto off = ParseSpeculative("off", 4);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->method, SpecMethod::kOff);
  auto ng = ParseSpeculative("ngram", 6);
  ASSERT_TRUE(ng.ok());
  EXPECT_EQ(ng->method, SpecMethod::kNgram);
  EXPECT_EQ(ng->max_draft, 6);
  EXPECT_EQ(SpecMethodName(ng->method), "ngram");
  EXPECT_NE(MakeProposer(*ng), nullptr);
  EXPECT_EQ(MakeProposer(*off), nullptr);
  EXPECT_EQ(SpecHandshake(*ng), "ngram");
  auto self = ParseSpeculative("self:Q4_0", 4);
  ASSERT_TRUE(self.ok()) << self.status();
  EXPECT_EQ(self->method, SpecMethod::kSelf);
  EXPECT_EQ(self->self_type, kernels::DType::kQ4_0);
  EXPECT_EQ(SpecHandshake(*self), "self:q4_0");
  auto draft = ParseSpeculative("draft:/models/a/small.gguf", 3);
  ASSERT_TRUE(draft.ok()) << draft.status();
  EXPECT_EQ(draft->method, SpecMethod::kDraft);
  EXPECT_EQ(draft->draft_path, "/models/a/small.gguf");
  // Pods mount the same file at different paths: the handshake names the file only.
  EXPECT_EQ(SpecHandshake(*draft), "draft:small.gguf");
  EXPECT_EQ(MakeProposer(*draft), nullptr) << "model proposers come from MakeSpecProposer";
}

TEST(ParseSpeculativeTest, RefusesWhatItCannotRun) {
  EXPECT_EQ(ParseSpeculative("ngram", 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSpeculative("ngram", 17).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSpeculative("eagle", 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSpeculative("self:", 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSpeculative("draft:", 4).status().code(), absl::StatusCode::kInvalidArgument);
  for (const char* bad : {"self:q5_9", "self:q4_1", "self:i8"}) {
    auto self = ParseSpeculative(bad, 4);
    EXPECT_EQ(self.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(self.status().message().find("q4_0"), std::string::npos) << self.status();
  }
}

SpeculativeOptions Ngram(int k, double cost) {
  SpeculativeOptions o;
  o.method = SpecMethod::kNgram;
  o.max_draft = k;
  o.verify_cost = cost;
  return o;
}

TEST(DraftLengthTest, LengthFollowsAcceptance) {
  DraftLength d(Ngram(8, 0.1));
  const int32_t prior = d.Next();
  EXPECT_GE(prior, 1);
  EXPECT_LT(prior, 8);
  for (int i = 0; i < 40; ++i) d.Record(4, 4);  // every draft kept
  EXPECT_GT(d.acceptance(), 0.9);
  EXPECT_EQ(d.Next(), 8);
  for (int i = 0; i < 60; ++i) d.Record(4, 0);  // none kept
  EXPECT_LT(d.acceptance(), 0.1);
  // A loss now: no drafting, except one probe token every kProbeEvery steps.
  int drafted_steps = 0;
  for (int i = 0; i < 4 * DraftLength::kProbeEvery; ++i) {
    const int32_t k = d.Next();
    EXPECT_LE(k, 1);
    drafted_steps += k;
  }
  EXPECT_EQ(drafted_steps, 4);
}

// Rejected probes space the next ones out, twice as far each time up to kMaxProbeEvery; a kept
// probe brings the period back.
TEST(DraftLengthTest, RejectedProbesBackOff) {
  DraftLength d(Ngram(4, 0.1));
  for (int i = 0; i < 60; ++i) d.Record(4, 0);
  std::vector<int> gaps;
  int since = 0;
  for (int i = 0; i < 2000 && gaps.size() < 7; ++i) {
    ++since;
    if (d.Next() == 1) {
      gaps.push_back(since);
      since = 0;
      d.Record(1, 0);
    }
  }
  EXPECT_EQ(gaps, (std::vector<int>{8, 16, 32, 64, 128, 128, 128}));
  // A kept probe: the sequence drafts again within kProbeEvery steps (at once, if the raised
  // acceptance estimate already makes drafting pay).
  for (int i = 0; i < 127; ++i) EXPECT_EQ(d.Next(), 0);
  ASSERT_EQ(d.Next(), 1);
  d.Record(1, 1);
  int gap = 0;
  while (d.Next() == 0) ++gap;
  EXPECT_LT(gap, DraftLength::kProbeEvery);
}

// A draft model's proposer starts from its own prior and, once drafting loses, never probes.
TEST(DraftLengthTest, ModelDraftsStartHopefulAndStopForGood) {
  SpeculativeOptions o = Ngram(4, 0.1);
  o.draft_cost = 0.6;
  o.prior_acceptance = 0.8;
  DraftLength d(o);
  EXPECT_NEAR(d.acceptance(), 0.8, 1e-12);
  EXPECT_GE(d.Next(), 1);
  o.prior_acceptance = 0.5;
  EXPECT_EQ(DraftLength(o).Next(), 0) << "at a = 0.5 a draft costing 0.6 a token loses";
  for (int i = 0; i < 10; ++i) d.Record(2, 0);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(d.Next(), 0) << "step " << i;
}

TEST(DraftLengthTest, CostlierVerificationDraftsLess) {
  DraftLength cheap(Ngram(8, 0.02)), dear(Ngram(8, 0.5));
  for (int i = 0; i < 30; ++i) {
    cheap.Record(3, 2);
    dear.Record(3, 2);
  }
  EXPECT_GT(cheap.Next(), dear.Next());
}

TEST(DraftLengthTest, FixedLengthWithoutAdaptation) {
  SpeculativeOptions o = Ngram(5, 0.1);
  o.adaptive = false;
  DraftLength d(o);
  for (int i = 0; i < 30; ++i) d.Record(5, 0);
  EXPECT_EQ(d.Next(), 5);
  SpeculativeOptions off;
  EXPECT_EQ(DraftLength(off).Next(), 0);
}

// The cost model answers with the priors until it has seen steps that tell the slope apart,
// then recovers alpha and beta from noisy timings of a known line, per batch size.
TEST(SpecCostModelTest, LearnsTheCostOfADraftTokenFromStepTimes) {
  SpeculativeOptions o = Ngram(6, 0.1);
  o.draft_cost = 0.3;
  o.max_batch = 8;
  SpecCostModel m(o);
  EXPECT_DOUBLE_EQ(m.verify_cost(1), 0.1);
  EXPECT_DOUBLE_EQ(m.draft_cost(1), 0.3);
  // Steps that never draft: nothing to learn a slope from.
  for (int i = 0; i < 50; ++i) m.ObserveStep(1, 0, 1e-3);
  EXPECT_DOUBLE_EQ(m.verify_cost(1), 0.1);
  // At B = 1 a step costs 1 ms + 0.4 ms per draft token; at B = 4, 2 ms + 0.2 ms per token.
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> k(0, 6);
  std::uniform_real_distribution<double> noise(0.97, 1.03);
  for (int i = 0; i < 400; ++i) {
    const int k1 = k(rng), k4 = k(rng);
    m.ObserveStep(1, k1, (1e-3 + 0.4e-3 * k1) * noise(rng));
    m.ObserveStep(4, k4, (2e-3 + 0.2e-3 * k4) * noise(rng));
  }
  EXPECT_NEAR(m.verify_cost(1), 0.4, 0.05);
  EXPECT_NEAR(m.verify_cost(4), 4 * 0.2 / 2.0, 0.06) << "B draft tokens, one per sequence";
  EXPECT_DOUBLE_EQ(m.verify_cost(2), 0.2) << "B = 2 has seen no steps: the prior, per sequence";
  // Draft steps of 0.5 ms against B = 1's 1 ms plain step.
  for (int i = 0; i < 20; ++i) m.ObserveDraftStep(1, 0.5e-3);
  EXPECT_NEAR(m.draft_cost(1), 0.5, 0.05);
  EXPECT_DOUBLE_EQ(m.draft_cost(2), 0.3);
  // The new line replaces the old one as old steps are forgotten.
  for (int i = 0; i < 600; ++i) {
    const int k1 = k(rng);
    m.ObserveStep(1, k1, (1e-3 + 0.05e-3 * k1) * noise(rng));
  }
  EXPECT_NEAR(m.verify_cost(1), 0.05, 0.02);
}

// Steps that all draft the same amount cannot tell a plain step's time from a draft token's:
// every kCalibrateEvery such steps the model asks for one plain step, and once it has one the
// fit answers (and asks no more while the window holds it).
TEST(SpecCostModelTest, AsksForAPlainStepWhenEveryStepDraftsAlike) {
  SpeculativeOptions o = Ngram(4, 0.1);
  o.max_batch = 8;
  SpecCostModel m(o);
  for (int i = 0; i < SpecCostModel::kCalibrateEvery - 1; ++i) {
    m.ObserveStep(4, 16, 3e-3);
    EXPECT_FALSE(m.WantsPlainStep(4)) << i;
  }
  m.ObserveStep(4, 16, 3e-3);
  EXPECT_TRUE(m.WantsPlainStep(4));
  EXPECT_FALSE(m.WantsPlainStep(2)) << "another batch size has its own fit";
  m.ObserveStep(4, 0, 2e-3);
  EXPECT_FALSE(m.WantsPlainStep(4));
  for (int i = 0; i < 3 * SpecCostModel::kCalibrateEvery; ++i) {
    m.ObserveStep(4, 16, 3e-3);
    EXPECT_FALSE(m.WantsPlainStep(4)) << i;
  }
  // 4 sequences, 16 drafts cost 1 ms over a 2 ms plain step.
  EXPECT_NEAR(m.verify_cost(4), 4 * (1e-3 / 16) / 2e-3, 0.01);
}

// With the price of a draft token measured, the draft length follows it: cheap verification
// drafts long, dear verification stops drafting at the same acceptance.
TEST(SpecCostModelTest, DraftLengthFollowsTheMeasuredPrice) {
  DraftLength d(Ngram(6, 0.1));
  for (int i = 0; i < 30; ++i) d.Record(4, 3);
  EXPECT_GE(d.Next(0.02), 5);
  EXPECT_EQ(d.Next(0.9), 0);
}

}  // namespace
}  // namespace tandem::engine
