// The MoE FFN: routing against a double-precision softmax/top-k, which experts a step runs,
// quantised experts against the reference forward, and the loader's checks on MoE files.
#include "engine/runtime/moe.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <numeric>
#include <random>

#include "common/gguf/gguf.h"
#include "engine/runtime/engine.h"
#include "gtest/gtest.h"
#include "tests/fakes/tiny_model.h"
#include "tests/unit/engine/reference_model.h"

namespace tandem::engine {
namespace {

using testing::RandomTokens;
using testing::TinyModelOptions;

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          (name + "-" + std::to_string(getpid()) + ".gguf"))
      .string();
}

TEST(RouteTokensTest, MatchesADoubleSoftmaxAndTopK) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  constexpr int32_t kExperts = 60, kUsed = 4;
  constexpr int64_t kTokens = 50;
  std::vector<float> logits(kTokens * kExperts);
  for (float& l : logits) l = normal(rng);
  for (bool normalize : {false, true}) {
    SCOPED_TRACE(normalize);
    Routing r;
    RouteTokens(logits.data(), kTokens, kExperts, kUsed, ExpertGating::kSoftmax, normalize, &r);
    ASSERT_EQ(r.k, kUsed);
    for (int64_t t = 0; t < kTokens; ++t) {
      const float* l = logits.data() + t * kExperts;
      std::vector<double> p(kExperts);
      double sum = 0;
      for (int32_t e = 0; e < kExperts; ++e) sum += (p[e] = std::exp(double(l[e])));
      for (double& v : p) v /= sum;
      std::vector<int32_t> order(kExperts);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return p[a] > p[b]; });
      double chosen = 0;
      for (int32_t s = 0; s < kUsed; ++s) chosen += p[order[s]];
      for (int32_t s = 0; s < kUsed; ++s) {
        EXPECT_EQ(r.expert[t * kUsed + s], order[s]) << "token " << t << " slot " << s;
        const double want = normalize ? p[order[s]] / chosen : p[order[s]];
        EXPECT_NEAR(r.weight[t * kUsed + s], want, 1e-6 * std::max(1.0, want));
      }
    }
  }
}

// gpt-oss: the top k by logit, weighted by a softmax over just those k logits.
TEST(RouteTokensTest, SoftmaxWeightGatingNormalisesOverTheChosen) {
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  constexpr int32_t kExperts = 32, kUsed = 4;
  constexpr int64_t kTokens = 20;
  std::vector<float> logits(kTokens * kExperts);
  for (float& l : logits) l = normal(rng);
  Routing r;
  RouteTokens(logits.data(), kTokens, kExperts, kUsed, ExpertGating::kSoftmaxWeight, false, &r);
  for (int64_t t = 0; t < kTokens; ++t) {
    const float* l = logits.data() + t * kExperts;
    std::vector<int32_t> order(kExperts);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
    double sum = 0;
    for (int32_t s = 0; s < kUsed; ++s) sum += std::exp(double(l[order[s]]));
    for (int32_t s = 0; s < kUsed; ++s) {
      EXPECT_EQ(r.expert[t * kUsed + s], order[s]);
      EXPECT_NEAR(r.weight[t * kUsed + s], std::exp(double(l[order[s]])) / sum, 1e-6);
    }
  }
}

TEST(RouteTokensTest, TiesGoToTheLowerExpertAndWeightsShareEvenly) {
  const std::vector<float> logits = {0.5f, 1.0f, 1.0f, 1.0f, -2.0f};
  Routing r;
  RouteTokens(logits.data(), 1, 5, 2, ExpertGating::kSoftmax, /*normalize=*/true, &r);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{1, 2}));
  EXPECT_FLOAT_EQ(r.weight[0], 0.5f);
  EXPECT_FLOAT_EQ(r.weight[1], 0.5f);
}

std::shared_ptr<const Model> LoadTiny(const TinyModelOptions& o, const std::string& tag) {
  const std::string path = TempPath("tandem-moe-" + tag);
  absl::Status st = testing::WriteTinyModel(o, path);
  EXPECT_TRUE(st.ok()) << st;
  auto m = Model::Load(path);
  EXPECT_TRUE(m.ok()) << m.status();
  std::filesystem::remove(path);
  return std::shared_ptr<const Model>(std::move(*m));
}

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<const Model> m) {
  EngineOptions o;
  o.threads = 2;
  o.ctx_size = 64;
  o.max_seqs = 2;
  o.block_size = 16;
  auto e = Engine::Create(std::move(m), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

// A step routes each token to n_expert_used experts in every layer; a one-token step runs
// exactly that many experts per layer (the others' weights are not read).
TEST(MoeEngineTest, ExpertLoadCountsEveryRoutedToken) {
  TinyModelOptions o;
  o.arch = "qwen3moe";
  o.n_expert = 16;
  o.n_expert_used = 4;
  auto model = LoadTiny(o, "load");
  auto e = MakeEngine(model);
  const ModelConfig& c = model->config();
  ASSERT_EQ(e->expert_tokens().size(), size_t(c.n_layer) * c.n_expert);
  const auto tokens = RandomTokens(9, c.n_vocab, 2);
  auto blocks = *e->kv().pool().AllocateN(1);
  std::vector<float> logits;
  SeqChunk prompt{tokens, 0, blocks, true};
  ASSERT_TRUE(e->Step({&prompt, 1}, &logits).ok());
  const std::vector<int64_t> after_prompt = e->expert_tokens();
  for (int32_t l = 0; l < c.n_layer; ++l) {
    int64_t sum = 0, used = 0;
    for (int32_t x = 0; x < c.n_expert; ++x) {
      sum += after_prompt[l * c.n_expert + x];
      used += after_prompt[l * c.n_expert + x] > 0;
    }
    EXPECT_EQ(sum, 9 * 4) << "layer " << l;
    EXPECT_GT(used, 4) << "nine tokens all routed to the same four experts: routing is degenerate";
  }
  const int32_t next = tokens[0];
  SeqChunk one{{&next, 1}, 9, blocks, true};
  ASSERT_TRUE(e->Step({&one, 1}, &logits).ok());
  for (int32_t l = 0; l < c.n_layer; ++l) {
    int64_t ran = 0;
    for (int32_t x = 0; x < c.n_expert; ++x) {
      const int64_t d = e->expert_tokens()[l * c.n_expert + x] - after_prompt[l * c.n_expert + x];
      EXPECT_TRUE(d == 0 || d == 1);
      ran += d;
    }
    EXPECT_EQ(ran, 4) << "layer " << l;
  }
}

// Quantised and half-precision experts (every weight type tandem multiplies by; MXFP4 as
// gpt-oss ships it): the engine against the reference forward over the same (dequantised)
// weights, within the error of quantising the activations as llama.cpp does.
TEST(MoeEngineTest, QuantisedExpertsMatchTheReference) {
  struct Case {
    std::string arch;
    kernels::DType type;
    int32_t width = 64;  // n_embd and expert width; K-quants need whole 256-value blocks
  };
  const Case cases[] = {
      {"qwen2moe", kernels::DType::kQ8_0},       {"qwen3moe", kernels::DType::kQ8_0},
      {"mixtral", kernels::DType::kQ8_0},        {"gpt-oss", kernels::DType::kQ8_0},
      {"gpt-oss", kernels::DType::kMXFP4},       {"qwen3moe", kernels::DType::kQ4_0},
      {"qwen3moe", kernels::DType::kF16},        {"mixtral", kernels::DType::kBF16},
      {"qwen3moe", kernels::DType::kQ4_K, 256},  {"mixtral", kernels::DType::kQ6_K, 256}};
  for (const auto& [arch, type, width] : cases) {
    SCOPED_TRACE(arch + " " + std::string(kernels::Traits(type).name));
    TinyModelOptions o;
    o.arch = arch;
    o.type = type;
    o.n_embd = width;
    o.n_ff = width;
    auto model = LoadTiny(o, arch + "-" + std::string(kernels::Traits(type).name));
    auto e = MakeEngine(model);
    const auto tokens = RandomTokens(13, model->config().n_vocab, 4);
    auto blocks = *e->kv().pool().AllocateN(1);
    std::vector<float> got;
    SeqChunk ch{tokens, 0, blocks, true};
    ASSERT_TRUE(e->Step({&ch, 1}, &got).ok());
    const std::vector<double> want = testing::ReferenceForward(*model, tokens);
    double max_err = 0, spread = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      max_err = std::max(max_err, std::fabs(got[i] - want[i]));
      spread = std::max(spread, std::fabs(want[i]));
    }
    EXPECT_GT(spread, 0.1);
    // Rounding the activations to Q8 blocks in every matmul (as llama.cpp does) moves these
    // logits by 1-3.5% of their spread over seeds 1-8; a wrong expert slab or a flipped expert
    // moves them by 10% or more (F32 experts are checked at 0.1% in engine_test).
    EXPECT_LT(max_err, 5e-2 * spread) << max_err << " of " << spread;
  }
}

// A copy of a tiny MoE file with one key or tensor changed, for the loader's checks.
absl::Status LoadEdited(const std::function<void(gguf::GgufWriter&, const gguf::GgufFile&)>& edit,
                        const std::string& skip_tensor = "") {
  TinyModelOptions o;
  o.arch = "qwen3moe";
  const std::string src = TempPath("tandem-moe-src"), dst = TempPath("tandem-moe-dst");
  EXPECT_TRUE(testing::WriteTinyModel(o, src).ok());
  auto in = gguf::GgufFile::Open(src);
  EXPECT_TRUE(in.ok());
  gguf::GgufWriter w;
  for (const gguf::KeyValue& kv : (*in)->metadata()) w.CopyValue(std::string(kv.key), kv.value);
  for (const gguf::TensorInfo& t : (*in)->tensors()) {
    if (t.name == skip_tensor) continue;
    EXPECT_TRUE(w.AddTensor(std::string(t.name), t.dims, t.type, {t.data, t.nbytes}).ok());
  }
  edit(w, **in);
  EXPECT_TRUE(w.Write(dst).ok());
  absl::Status st = Model::Load(dst).status();
  std::filesystem::remove(src);
  std::filesystem::remove(dst);
  return st;
}

TEST(MoeModelTest, LoaderNamesWhatIsWrong) {
  EXPECT_TRUE(LoadEdited([](gguf::GgufWriter&, const gguf::GgufFile&) {}).ok());
  absl::Status st =
      LoadEdited([](gguf::GgufWriter&, const gguf::GgufFile&) {}, "blk.1.ffn_down_exps.weight");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("blk.1.ffn_down_exps.weight"), std::string::npos) << st;
  st = LoadEdited([](gguf::GgufWriter& w, const gguf::GgufFile&) {
    w.SetU32("qwen3moe.expert_used_count", 9);
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("expert_used_count 9 exceeds expert_count 8"), std::string::npos)
      << st;
  st = LoadEdited(
      [](gguf::GgufWriter& w, const gguf::GgufFile&) { w.SetU32("qwen3moe.expert_count", 0); });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("expert_count must be > 0"), std::string::npos) << st;
  // An expert tensor of the wrong width: the loader says which and what it expected.
  st = LoadEdited([](gguf::GgufWriter& w, const gguf::GgufFile&) {
    w.SetU32("qwen3moe.expert_feed_forward_length", 64);
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("ffn_gate_exps.weight has shape 64x128x8, expected 64x64x8"),
            std::string::npos)
      << st;
}

}  // namespace
}  // namespace tandem::engine
