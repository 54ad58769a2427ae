#include "engine/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::HasSubstr;

std::vector<float> RandomLogits(size_t n, uint32_t seed, float scale = 3.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

SamplingParams Params(float temperature, uint64_t seed = 1) {
  SamplingParams p;
  p.temperature = temperature;
  p.seed = seed;
  return p;
}

// Softmax in double of logits / t: the reference the draws are compared with.
std::vector<double> Softmax(const std::vector<float>& logits, double t) {
  const double mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp((logits[i] - mx) / t);
  for (double& x : p) x /= sum;
  return p;
}

std::vector<int> Histogram(const SamplingParams& p, const std::vector<float>& logits, int draws) {
  Sampler s(p);
  std::vector<int> h(logits.size(), 0);
  for (int i = 0; i < draws; ++i) {
    std::vector<float> l = logits;  // Sample may modify its input
    ++h[static_cast<size_t>(s.Sample(l, {}))];
  }
  return h;
}

// Logits whose softmax (t = 1) is exactly `probs`.
std::vector<float> LogitsFor(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double q : probs) l.push_back(static_cast<float>(std::log(q)));
  return l;
}

std::vector<int> Support(const std::vector<int>& hist) {
  std::vector<int> ids;
  for (size_t i = 0; i < hist.size(); ++i) {
    if (hist[i] > 0) ids.push_back(static_cast<int>(i));
  }
  return ids;
}

TEST(ValidateSamplingParams, DefaultsAreValid) {
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}, 100).ok());
}

TEST(ValidateSamplingParams, NamesTheFieldAndValue) {
  struct Case {
    void (*mutate)(SamplingParams&);
    const char* message;
  };
  const Case cases[] = {
      {[](SamplingParams& p) { p.temperature = -1; }, "temperature must be >= 0, got -1"},
      {[](SamplingParams& p) { p.temperature = NAN; }, "temperature must be >= 0"},
      {[](SamplingParams& p) { p.top_p = 0; }, "top_p must be in (0, 1], got 0"},
      {[](SamplingParams& p) { p.top_p = 1.5; }, "top_p must be in (0, 1], got 1.5"},
      {[](SamplingParams& p) { p.min_p = -0.5; }, "min_p must be in [0, 1], got -0.5"},
      {[](SamplingParams& p) { p.min_p = 2; }, "min_p must be in [0, 1], got 2"},
      {[](SamplingParams& p) { p.repetition_penalty = 0; }, "repetition_penalty must be > 0"},
      {[](SamplingParams& p) { p.presence_penalty = 2.5; }, "presence_penalty must be in [-2, 2], got 2.5"},
      {[](SamplingParams& p) { p.frequency_penalty = -3; }, "frequency_penalty must be in [-2, 2], got -3"},
      {[](SamplingParams& p) { p.penalty_last_n = -2; }, "penalty_last_n must be >= -1, got -2"},
      {[](SamplingParams& p) { p.max_tokens = 0; }, "max_tokens must be >= 1, got 0"},
      {[](SamplingParams& p) { p.stop_token_ids = {3, 100}; }, "stop_token_ids must be in [0, 100), got 100"},
      {[](SamplingParams& p) { p.stop_token_ids = {-1}; }, "stop_token_ids must be in [0, 100), got -1"},
      {[](SamplingParams& p) { p.stop_strings = {"x", ""}; }, "stop_strings must not be empty"},
      {[](SamplingParams& p) { p.logprobs = 21; }, "logprobs must be in [0, 20] (or -1: off), got 21"},
      {[](SamplingParams& p) { p.logprobs = -2; }, "logprobs must be in [0, 20]"},
  };
  for (const Case& c : cases) {
    SamplingParams p;
    c.mutate(p);
    absl::Status st = ValidateSamplingParams(p, 100);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.message));
  }
  // Boundaries that are allowed.
  SamplingParams ok;
  ok.temperature = 0;
  ok.top_p = 1;
  ok.min_p = 1;
  ok.presence_penalty = -2;
  ok.frequency_penalty = 2;
  ok.penalty_last_n = -1;
  ok.stop_token_ids = {0, 99};
  ok.top_k = -5;
  EXPECT_TRUE(ValidateSamplingParams(ok, 100).ok());
}

TEST(Sampler, GreedyPicksArgmaxLowestIdOnTies) {
  std::vector<float> l = RandomLogits(1000, 7);
  const auto expect = std::max_element(l.begin(), l.end()) - l.begin();
  Sampler s(Params(0));
  EXPECT_EQ(s.Sample(l, {}), expect);

  std::vector<float> tie(10, -1.0f);
  tie[6] = 2.0f;
  tie[3] = 2.0f;
  tie[8] = 2.0f;
  EXPECT_EQ(Sampler(Params(0)).Sample(tie, {}), 3);

  // A maximum in the tail after the last full block of eight, then ties across blocks.
  std::vector<float> big = RandomLogits(1003, 8);
  big[1001] = 100.0f;
  EXPECT_EQ(Sampler(Params(0)).Sample(big, {}), 1001);
  big[517] = 100.0f;
  big[9] = 100.0f;
  EXPECT_EQ(Sampler(Params(0)).Sample(big, {}), 9);
  big[4] = NAN;  // NaN is never the argmax
  EXPECT_EQ(Sampler(Params(0)).Sample(big, {}), 9);
}

// Reference penalties written from the definition, over a window of the history.
std::vector<float> ReferencePenalties(std::vector<float> l, const std::vector<int32_t>& hist,
                                      const SamplingParams& p) {
  size_t n = hist.size();
  if (p.penalty_last_n >= 0) n = std::min(n, static_cast<size_t>(p.penalty_last_n));
  std::map<int32_t, int> count;
  for (size_t i = hist.size() - n; i < hist.size(); ++i) ++count[hist[i]];
  for (auto [id, c] : count) {
    float& x = l[static_cast<size_t>(id)];
    x = x > 0 ? x / p.repetition_penalty : x * p.repetition_penalty;
    x -= static_cast<float>(c) * p.frequency_penalty + p.presence_penalty;
  }
  return l;
}

TEST(Sampler, PenaltiesChangeLogitsAsDefined) {
  const std::vector<float> logits = RandomLogits(50, 11);
  // Tokens 4 (three times in the window), 9 (twice), plus positive/negative logits; token 30
  // is only outside the window of 6 and must stay untouched.
  const std::vector<int32_t> history = {30, 30, 4, 9, 4, 17, 9, 4};
  for (int32_t last_n : {6, -1, 0, 100}) {
    SamplingParams p = Params(0);
    p.repetition_penalty = 1.3f;
    p.frequency_penalty = 0.4f;
    p.presence_penalty = 0.25f;
    p.penalty_last_n = last_n;
    std::vector<float> got = logits;
    Sampler(p).Sample(got, history);
    const std::vector<float> want =
        last_n == 0 ? logits : ReferencePenalties(logits, history, p);
    for (size_t i = 0; i < logits.size(); ++i) {
      EXPECT_FLOAT_EQ(got[i], want[i]) << "id " << i << " last_n " << last_n;
    }
    if (last_n == 6) {
      EXPECT_EQ(got[30], logits[30]);
      EXPECT_NE(got[4], logits[4]);
    }
  }
  // Sign handling: a positive logit shrinks towards 0, a negative one moves away from 0.
  std::vector<float> l = {2.0f, -2.0f, 1.0f};
  SamplingParams p = Params(0);
  p.repetition_penalty = 2.0f;
  Sampler(p).Sample(l, std::vector<int32_t>{0, 1});
  EXPECT_FLOAT_EQ(l[0], 1.0f);
  EXPECT_FLOAT_EQ(l[1], -4.0f);
  EXPECT_FLOAT_EQ(l[2], 1.0f);
}

TEST(Sampler, PenaltiesApplyBeforeGreedy) {
  std::vector<float> l = {1.0f, 3.0f, 2.5f};
  SamplingParams p = Params(0);
  p.presence_penalty = 1.0f;
  EXPECT_EQ(Sampler(p).Sample(l, std::vector<int32_t>{1}), 2);
}

TEST(Sampler, DeterministicPerSeed) {
  const std::vector<float> logits = RandomLogits(2000, 3, 1.0f);
  auto run = [&](uint64_t seed) {
    SamplingParams p = Params(0.9f, seed);
    p.top_k = 50;
    p.top_p = 0.95f;
    p.min_p = 0.01f;
    Sampler s(p);
    std::vector<int32_t> out;
    for (int i = 0; i < 200; ++i) {
      std::vector<float> l = logits;
      out.push_back(s.Sample(l, out));
    }
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(Sampler, TemperatureDrawsFollowSoftmax) {
  const std::vector<float> logits = RandomLogits(8, 5, 1.0f);
  for (float t : {0.5f, 1.0f, 2.0f}) {
    const int kDraws = 40000;
    const std::vector<int> h = Histogram(Params(t, 123), logits, kDraws);
    const std::vector<double> want = Softmax(logits, t);
    double chi2 = 0;
    for (size_t i = 0; i < h.size(); ++i) {
      const double e = want[i] * kDraws;
      chi2 += (h[i] - e) * (h[i] - e) / e;
    }
    // 7 degrees of freedom: P(chi2 > 30) is about 1e-4. A sampler that ignored the
    // temperature would land in the thousands.
    EXPECT_LT(chi2, 30.0) << "temperature " << t;
  }
}

TEST(Sampler, TopKExcludesTheRest) {
  const std::vector<float> logits = RandomLogits(100, 9);
  SamplingParams p = Params(5.0f);  // hot, so without top-k many ids would appear
  p.top_k = 3;
  std::vector<int> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  std::vector<int> top3(order.begin(), order.begin() + 3);
  std::sort(top3.begin(), top3.end());
  EXPECT_EQ(Support(Histogram(p, logits, 3000)), top3);
}

TEST(Sampler, TopPKeepsTheSmallestNucleus) {
  const std::vector<float> logits = LogitsFor({0.05, 0.5, 0.15, 0.3});
  SamplingParams p = Params(1.0f);
  p.top_p = 0.75f;  // 0.5 + 0.3 reaches it
  EXPECT_EQ(Support(Histogram(p, logits, 4000)), (std::vector<int>{1, 3}));
  p.top_p = 0.85f;  // needs the 0.15 token too
  EXPECT_EQ(Support(Histogram(p, logits, 4000)), (std::vector<int>{1, 2, 3}));
  // The nucleus is taken over the tempered distribution: at t = 0.5 the probabilities are
  // proportional to 0.25, 0.09, 0.0225, 0.0025, so the top token alone holds 0.685 of the mass
  // and top_p = 0.6 keeps only it, where at t = 1 (0.5 of the mass) it needs a second token.
  p.top_p = 0.6f;
  EXPECT_EQ(Support(Histogram(p, logits, 4000)), (std::vector<int>{1, 3}));
  p.temperature = 0.5f;
  EXPECT_EQ(Support(Histogram(p, logits, 2000)), (std::vector<int>{1}));
}

TEST(Sampler, MinPDropsTokensBelowFractionOfMax) {
  const std::vector<float> logits = LogitsFor({0.05, 0.5, 0.15, 0.3});
  SamplingParams p = Params(1.0f);
  p.min_p = 0.25f;  // keeps p >= 0.125
  EXPECT_EQ(Support(Histogram(p, logits, 4000)), (std::vector<int>{1, 2, 3}));
  p.min_p = 0.5f;  // keeps p >= 0.25
  EXPECT_EQ(Support(Histogram(p, logits, 4000)), (std::vector<int>{1, 3}));
}

TEST(Sampler, SurvivorsKeepRelativeProbabilities) {
  const std::vector<float> logits = LogitsFor({0.05, 0.5, 0.15, 0.3});
  SamplingParams p = Params(1.0f, 77);
  p.top_k = 2;
  const int kDraws = 20000;
  const std::vector<int> h = Histogram(p, logits, kDraws);
  EXPECT_EQ(h[0] + h[2], 0);
  EXPECT_NEAR(static_cast<double>(h[1]) / kDraws, 0.5 / 0.8, 0.015);
}

// Brute-force reference of the whole pipeline: a full sort for the filters, then the
// documented draw (53-bit uniform from raw mt19937_64 output, survivors walked in id order).
// The production code must agree token for token while never sorting the vocabulary.
class ReferenceSampler {
 public:
  explicit ReferenceSampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}
  int32_t Sample(const std::vector<float>& logits) {
    struct C {
      float l;
      int32_t id;
    };
    std::vector<C> c;
    for (size_t i = 0; i < logits.size(); ++i) c.push_back({logits[i], static_cast<int32_t>(i)});
    auto by_rank = [](const C& a, const C& b) { return a.l > b.l || (a.l == b.l && a.id < b.id); };
    auto by_id = [](const C& a, const C& b) { return a.id < b.id; };
    std::sort(c.begin(), c.end(), by_rank);
    if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < c.size()) c.resize(p_.top_k);
    const float mx = c.front().l;
    const float inv_t = 1.0f / p_.temperature;
    auto weight = [&](const C& x) { return std::exp((x.l - mx) * inv_t); };
    if (p_.top_p < 1.0f) {
      std::vector<C> in_ids = c;
      std::sort(in_ids.begin(), in_ids.end(), by_id);
      double total = 0;
      for (const C& x : in_ids) total += weight(x);
      double cum = 0;
      for (size_t i = 0; i < c.size(); ++i) {
        cum += weight(c[i]);
        if (cum >= p_.top_p * total) {
          c.resize(i + 1);
          break;
        }
      }
    }
    if (p_.min_p > 0) {
      std::erase_if(c, [&](const C& x) { return weight(x) < p_.min_p; });
    }
    std::sort(c.begin(), c.end(), by_id);
    double total = 0;
    for (const C& x : c) total += weight(x);
    const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * total;
    double cum = 0;
    for (const C& x : c) {
      cum += weight(x);
      if (cum > u) return x.id;
    }
    return c.back().id;
  }

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
};

TEST(Sampler, LargeVocabMatchesBruteForceReference) {
  const size_t kVocab = 150000;
  struct Case {
    float t;
    int32_t k;
    float top_p;
    float min_p;
  };
  // A hot temperature makes the nucleus span tens of thousands of tokens (the bucketed
  // search crosses deep into the vocabulary); a cold one puts it in the first few buckets.
  // top_k 5000 takes the nth_element path, 40 the heap.
  const Case cases[] = {
      {0.8f, 40, 1.0f, 0.0f},  {1.0f, 0, 0.9f, 0.0f},    {3.0f, 0, 0.95f, 0.0f},
      {0.2f, 0, 0.5f, 0.0f},   {1.0f, 0, 1.0f, 0.05f},   {1.0f, 0, 1.0f, 0.0f},
      {0.7f, 100, 0.8f, 0.02f}, {1.2f, 5000, 0.97f, 0.0f}, {50.0f, 0, 0.999f, 0.0f},
  };
  std::vector<std::vector<float>> steps;
  for (int step = 0; step < 4; ++step) steps.push_back(RandomLogits(kVocab, 100 + step, 1.5f));
  for (const Case& c : cases) {
    SamplingParams p = Params(c.t, 2024);
    p.top_k = c.k;
    p.top_p = c.top_p;
    p.min_p = c.min_p;
    Sampler s(p);
    ReferenceSampler ref(p);
    for (int step = 0; step < 4; ++step) {
      const std::vector<float>& logits = steps[static_cast<size_t>(step)];
      std::vector<float> l = logits;
      ASSERT_EQ(s.Sample(l, {}), ref.Sample(logits))
          << "t=" << c.t << " k=" << c.k << " top_p=" << c.top_p << " min_p=" << c.min_p
          << " step " << step;
    }
  }
}

TEST(Sampler, AllButOneMaskedReturnsTheSurvivor) {
  std::vector<float> l(1000, -INFINITY);
  l[417] = 0.3f;
  SamplingParams p = Params(1.0f);
  p.top_p = 0.5f;
  p.min_p = 0.1f;
  EXPECT_EQ(Sampler(p).Sample(l, {}), 417);
}

TEST(Sampler, NanLogitsAreNeverDrawn) {
  std::vector<float> logits = RandomLogits(3000, 21, 0.5f);
  for (size_t i = 0; i < logits.size(); i += 3) logits[i] = NAN;
  SamplingParams p = Params(1.0f, 5);
  p.top_k = 500;
  p.top_p = 0.9f;
  Sampler s(p);
  for (int i = 0; i < 200; ++i) {
    std::vector<float> l = logits;
    EXPECT_NE(s.Sample(l, {}) % 3, 0);
  }
}

TEST(Sampler, LogprobsAreTheRawLogSoftmaxWhateverThePenaltiesAndTemperature) {
  // A 150k vocabulary of random logits: the reference log-softmax in double, ranked by value
  // (lower id on ties) for the alternatives.
  const std::vector<float> logits = RandomLogits(150000, 31, 4.0f);
  const double mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(l - mx);
  const double lse = mx + std::log(sum);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  struct Case {
    float t;
    float repetition;
    int32_t n;
  };
  for (const Case c : {Case{0.0f, 1.0f, 5}, Case{0.8f, 1.3f, 20}, Case{1.5f, 1.0f, 0}}) {
    SamplingParams p = Params(c.t, 9);
    p.repetition_penalty = c.repetition;
    p.logprobs = c.n;
    Sampler s(p);
    Sampler plain([&] {
      SamplingParams q = p;
      q.logprobs = -1;
      return q;
    }());
    const std::vector<int32_t> history = {order[0], order[3], 17};
    for (int step = 0; step < 4; ++step) {
      std::vector<float> l = logits, l2 = logits;
      const int32_t t = s.Sample(l, history);
      EXPECT_EQ(t, plain.Sample(l2, history)) << "logprobs change the draw";
      ASSERT_NE(s.logprobs(), nullptr);
      const TokenLogprobs& lp = *s.logprobs();
      EXPECT_NEAR(lp.logprob, logits[t] - lse, 1e-4) << "t=" << c.t << " token " << t;
      ASSERT_EQ(lp.top.size(), static_cast<size_t>(c.n));
      for (int32_t k = 0; k < c.n; ++k) {
        EXPECT_EQ(lp.top[k].id, order[k]) << k;
        EXPECT_NEAR(lp.top[k].logprob, logits[order[k]] - lse, 1e-4) << k;
      }
    }
  }
  EXPECT_EQ(Sampler(Params(1.0f)).logprobs(), nullptr);  // off by default
}

}  // namespace
}  // namespace tandem::engine
