// The engine's step cost model and step work: the fit recovers a known line from noisy steps,
// the shape and work of a step are what its chunks say, an engine records every step it runs,
// and the CPU peaks come out plausible.
#include "engine/runtime/step_cost.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "engine/runtime/engine.h"
#include "gtest/gtest.h"
#include "tests/fakes/sanitizer.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::engine {
namespace {

TEST(StepCostModelTest, RecoversAKnownLineFromNoisySteps) {
  StepCostModel m;
  EXPECT_EQ(m.Predict({10, 2, 500}), 0.0) << "no steps yet";
  // 2 ms + 40 us per prefill token + 300 us per decode sequence + 0.5 us per KV position.
  auto truth = [](const StepShape& s) {
    return 2e-3 + 40e-6 * s.prefill_tokens + 300e-6 * s.decode_seqs + 0.5e-6 * s.decode_kv_tokens;
  };
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> pre(0, 256), seqs(0, 16), ctx(1, 2000);
  std::uniform_real_distribution<double> noise(0.97, 1.03);
  for (int i = 0; i < 3000; ++i) {
    StepShape s;
    s.prefill_tokens = i % 3 == 0 ? pre(rng) : 0;  // decode-only steps are the common case
    s.decode_seqs = seqs(rng);
    for (int64_t q = 0; q < s.decode_seqs; ++q) s.decode_kv_tokens += ctx(rng);
    if (s.prefill_tokens + s.decode_seqs == 0) s.decode_seqs = 1, s.decode_kv_tokens = 10;
    m.Observe(s, truth(s) * noise(rng));
  }
  const StepCostModel::Coefficients c = m.coefficients();
  EXPECT_NEAR(c.intercept_s, 2e-3, 0.15e-3);
  EXPECT_NEAR(c.prefill_token_s, 40e-6, 2e-6);
  EXPECT_NEAR(c.decode_seq_s, 300e-6, 30e-6);
  EXPECT_NEAR(c.decode_kv_token_s, 0.5e-6, 0.05e-6);
  const StepShape probe{100, 8, 8000};
  EXPECT_NEAR(m.Predict(probe), truth(probe), 0.03 * truth(probe));
  EXPECT_GT(m.relative_rmse(), 0.005);
  EXPECT_LT(m.relative_rmse(), 0.05) << "3% noise";
  EXPECT_EQ(m.steps(), 3000);
}

// Prefill time that grows faster than linearly (attention over the prompt) pulls an
// unconstrained linear fit's intercept below 0, which inflates the decode terms. The fit keeps
// every coefficient >= 0, and it is still the best such line: no coefficient vector >= 0 near it
// fits the steps better.
TEST(StepCostModelTest, CoefficientsStayNonNegativeAndFitBest) {
  StepCostModel m;
  auto truth = [](const StepShape& s) {
    const double p = static_cast<double>(s.prefill_tokens);
    return 0.2e-3 + 20e-6 * p + 0.3e-6 * p * p + 150e-6 * s.decode_seqs;
  };
  std::mt19937 rng(3);
  std::vector<StepShape> seen;
  for (int i = 0; i < 2000; ++i) {
    StepShape s;
    if (i % 2 == 0) {
      s.prefill_tokens = 64 + static_cast<int64_t>(rng() % 448);
    } else {
      s.decode_seqs = 1 + static_cast<int64_t>(rng() % 16);
      s.decode_kv_tokens = s.decode_seqs * (100 + static_cast<int64_t>(rng() % 200));
    }
    seen.push_back(s);
    m.Observe(s, truth(s));
  }
  const StepCostModel::Coefficients c = m.coefficients();
  for (double v : {c.intercept_s, c.prefill_token_s, c.decode_seq_s, c.decode_kv_token_s}) {
    EXPECT_GE(v, 0.0);
  }
  // Recent steps weigh more (kForget): the loss the fit minimises.
  auto loss = [&](const StepCostModel::Coefficients& k) {
    double l = 0, w = 1;
    for (auto it = seen.rbegin(); it != seen.rend(); ++it, w *= StepCostModel::kForget) {
      const double p = k.intercept_s + k.prefill_token_s * it->prefill_tokens +
                       k.decode_seq_s * it->decode_seqs +
                       k.decode_kv_token_s * it->decode_kv_tokens;
      l += w * (p - truth(*it)) * (p - truth(*it));
    }
    return l;
  };
  const double best = loss(c);
  for (int i = 0; i < 4; ++i) {
    for (double f : {0.9, 1.1}) {
      StepCostModel::Coefficients k = c;
      double* v[] = {&k.intercept_s, &k.prefill_token_s, &k.decode_seq_s, &k.decode_kv_token_s};
      *v[i] = *v[i] > 0 ? *v[i] * f : (f > 1 ? 1e-6 : 0);  // a zero can only go up
      EXPECT_GE(loss(k), best * (1 - 1e-9)) << "coefficient " << i << " x" << f;
    }
  }
  // Decode-only steps keep their cost: the decode terms are not inflated to make up for a
  // negative intercept.
  EXPECT_NEAR(m.Predict({0, 8, 1600}), truth({0, 8, 1600}), 0.25 * truth({0, 8, 1600}));
}

TEST(StepCostModelTest, AFeatureThatNeverVariedStaysNearZero) {
  // A decode worker never prefills: its prefill coefficient must not soak up anything.
  StepCostModel m;
  for (int i = 0; i < 500; ++i) {
    const StepShape s{0, 1 + i % 8, 300 * (1 + i % 8)};
    m.Observe(s, 1e-3 + 2e-4 * double(s.decode_seqs));
  }
  EXPECT_NEAR(m.coefficients().prefill_token_s, 0.0, 1e-6);
  EXPECT_NEAR(m.Predict({0, 4, 1200}), 1.8e-3, 0.05e-3);
}

class EngineStepsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string path =
        (std::filesystem::temp_directory_path() / ("step-cost-" + std::to_string(getpid()) + ".gguf"))
            .string();
    ASSERT_TRUE(testing::WriteTinyModel({}, path).ok());
    auto m = Model::Load(path);
    std::filesystem::remove(path);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::shared_ptr<const Model>(std::move(*m));
  }
  std::shared_ptr<const Model> model_;
};

TEST_F(EngineStepsTest, ShapeAndWorkFollowTheChunks) {
  EngineOptions o;
  o.ctx_size = 128;
  o.max_seqs = 4;
  auto e = Engine::Create(model_, o);
  ASSERT_TRUE(e.ok()) << e.status();
  Engine& eng = **e;
  auto a = eng.kv().pool().AllocateN(4);
  auto b = eng.kv().pool().AllocateN(4);
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<int32_t> prompt = testing::RandomTokens(20, model_->config().n_vocab, 3);
  const std::vector<int32_t> one = {5};
  std::vector<float> logits;
  // A 20-token prefill chunk and, in the next step, a decode row at position 20 beside a
  // one-token chunk of the other sequence at position 0.
  SeqChunk pre{prompt, 0, *a, true};
  ASSERT_TRUE(eng.Step(std::span<const SeqChunk>(&pre, 1), &logits).ok());
  EXPECT_EQ(eng.steps(), 1);
  EXPECT_EQ(eng.last_step().shape.prefill_tokens, 20);
  EXPECT_EQ(eng.last_step().shape.decode_seqs, 0);
  EXPECT_GT(eng.last_step().seconds, 0);
  const std::vector<SeqChunk> dec = {{one, 20, *a, true}, {one, 0, *b, true}};
  ASSERT_TRUE(eng.Step(dec, &logits).ok());
  const Engine::StepRecord& r = eng.last_step();
  EXPECT_EQ(eng.steps(), 2);
  EXPECT_EQ(r.shape.prefill_tokens, 0);
  EXPECT_EQ(r.shape.decode_seqs, 2);
  EXPECT_EQ(r.shape.decode_kv_tokens, 21 + 1);
  // Bytes: every weight once, then each sequence's K/V read (21 and 1 positions) and written
  // (1 each); K and V of every layer, f32.
  const ModelConfig& c = model_->config();
  const double per_pos = 2.0 * c.n_layer * c.n_head_kv * c.head_dim * 4;
  EXPECT_DOUBLE_EQ(r.work.bytes,
                   double(model_->weight_bytes_per_token()) + per_pos * (21 + 1 + 1 + 1));
  // FLOPs: 2 per weight element per token (the classifier for both rows), and attention over
  // 21 and 1 positions.
  const double d = c.n_embd, q = double(c.n_head) * c.head_dim, kv = double(c.n_head_kv) * c.head_dim;
  const double params = c.n_layer * (d * (q + 2 * kv) + q * d + 3 * d * c.n_ff) + d * c.n_vocab;
  EXPECT_DOUBLE_EQ(r.work.flops, 2 * params * 2 + 4.0 * c.n_layer * q * 22);
  // A failed step records nothing.
  const std::vector<int32_t> bad = {c.n_vocab + 3};
  SeqChunk oops{bad, 21, *a, true};
  EXPECT_FALSE(eng.Step(std::span<const SeqChunk>(&oops, 1), &logits).ok());
  EXPECT_EQ(eng.steps(), 2);
  EXPECT_EQ(eng.step_cost().steps(), 2);
}

// Cancelled, the measurement stops at its next check (every slice of a few MiB) and returns 0
// for what it did not finish: a worker's exit never waits for a measurement starved of CPU.
TEST(CpuPeaksTest, ACancelledMeasurementReturnsPromptlyWithNothing) {
  std::atomic<bool> cancel{true};
  DevicePeaks p = MeasureCpuPeaks(2, &cancel);
  EXPECT_EQ(p.read_gbs, 0);
  EXPECT_EQ(p.gflops, 0);
  cancel = false;
  std::atomic<bool> done{false};
  absl::Time cancelled_at;
  std::thread t([&] {
    p = MeasureCpuPeaks(2, &cancel);
    done = true;
  });
  absl::SleepFor(absl::Milliseconds(30));
  cancelled_at = absl::Now();
  cancel = true;
  t.join();
  EXPECT_LT(absl::Now() - cancelled_at, absl::Milliseconds(500));
  EXPECT_EQ(p.gflops, 0);  // the FMA passes come last: never reached in 30 ms
}

TEST(CpuPeaksTest, PlausibleForThisMachine) {
  if (tandem::testing::kUnderTsan) GTEST_SKIP() << "a speed check: TSan slows the loops it times";
  const DevicePeaks p = MeasureCpuPeaks(1);
  // A core reads 1-500 GB/s and does 1-1000 GFLOP/s of f32 FMAs on any machine this runs on.
  EXPECT_GT(p.read_gbs, 1);
  EXPECT_LT(p.read_gbs, 500);
  EXPECT_GT(p.gflops, 1);
  EXPECT_LT(p.gflops, 1000);
}


// Decode TPOT admission against a fit of a known line: the newcomer is refused exactly when the
// batch with it would step slower than the tightest target of any member (its own included),
// and never before the fit has seen enough steps, into an empty batch, or with no target.
TEST(StepCostModelTest, DecodeTpotAdmissionRefusesWhatWouldPassTheTightestTarget) {
  // 1 ms + 200 us per decode sequence + 0.1 us per KV position.
  auto truth = [](const StepShape& s) {
    return 1e-3 + 200e-6 * s.decode_seqs + 0.1e-6 * s.decode_kv_tokens;
  };
  StepCostModel m;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> seqs(1, 32), ctx(1, 4000);
  auto observe = [&](int n) {
    for (int i = 0; i < n; ++i) {
      StepShape s;
      s.decode_seqs = seqs(rng);
      for (int64_t q = 0; q < s.decode_seqs; ++q) s.decode_kv_tokens += ctx(rng);
      m.Observe(s, truth(s));
    }
  };
  observe(5);
  std::uniform_int_distribution<int> members(1, 24), tgt_ms(2, 12);
  std::vector<DecodeMember> batch(8, DecodeMember{1000, 0.002});
  int admitted = 0, refused = 0;
  const DecodeMember tight{1000, 0.001};
  EXPECT_TRUE(CheckDecodeTpot(m, /*min_steps=*/20, batch, tight).admit) << "fit too young";
  observe(2000);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<DecodeMember> b(members(rng));
    double tightest = 0;
    int64_t kv = 0;
    for (DecodeMember& x : b) {
      x.context_tokens = ctx(rng);
      kv += x.context_tokens;
      // Some members without a target, as requests without one are.
      x.tpot_target_s = trial % 3 == 0 ? 0.0 : tgt_ms(rng) * 1e-3;
      if (x.tpot_target_s > 0 && (tightest == 0 || x.tpot_target_s < tightest)) {
        tightest = x.tpot_target_s;
      }
    }
    DecodeMember joining{ctx(rng), trial % 2 == 0 ? 0.0 : tgt_ms(rng) * 1e-3};
    if (joining.tpot_target_s > 0 && (tightest == 0 || joining.tpot_target_s < tightest)) {
      tightest = joining.tpot_target_s;
    }
    const StepShape with{0, static_cast<int64_t>(b.size()) + 1, kv + joining.context_tokens};
    const double want = truth(with);
    const TpotCheck c = CheckDecodeTpot(m, 20, b, joining);
    EXPECT_DOUBLE_EQ(c.target_s, tightest);
    if (tightest == 0) {
      EXPECT_TRUE(c.admit);
      continue;
    }
    EXPECT_NEAR(c.predicted_s, want, 0.01 * want);
    // Away from the boundary, where the fit's error could tip it, the verdict is the truth's.
    if (std::abs(want - tightest) > 0.02 * tightest) {
      EXPECT_EQ(c.admit, want <= tightest) << "trial " << trial << ": " << want << " vs "
                                           << tightest;
    }
    (c.admit ? admitted : refused)++;
  }
  EXPECT_GT(admitted, 50);  // both verdicts were exercised
  EXPECT_GT(refused, 50);
  EXPECT_TRUE(CheckDecodeTpot(m, 20, {}, tight).admit) << "alone it is as fast as it gets";
}

}  // namespace
}  // namespace tandem::engine
