// Model tools: llama2.c conversion against llama.cpp's own conversion, synthetic models
// (determinism, layout, numerical tameness through a reference forward pass) and
// requantisation accuracy.
#include "tools/tandem/model_tools.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/kernels/quant.h"

namespace tandem::tools {
namespace {

using gguf::GgufFile;
using gguf::TensorInfo;
using kernels::DType;
using ::testing::HasSubstr;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// Per-process scratch folder (ctest runs tests of this binary in parallel processes), removed
// when the process's tests end.
const std::string& ScratchDir() {
  static const std::string* dir = [] {
    auto* d =
        new std::string(::testing::TempDir() + "/model_tools_test." + std::to_string(::getpid()));
    std::filesystem::create_directories(*d);
    return d;
  }();
  return *dir;
}

class RemoveScratchDir : public ::testing::Environment {
 public:
  void TearDown() override { std::filesystem::remove_all(ScratchDir()); }
};
[[maybe_unused]] const auto* const kRemoveScratch =
    ::testing::AddGlobalTestEnvironment(new RemoveScratchDir);

std::string TempPath(const std::string& name) { return ScratchDir() + "/" + name; }

std::vector<uint8_t> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), {});
}

void WriteAll(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Row r of a tensor as f32, whatever its type.
std::vector<float> Row(const TensorInfo& t, int64_t r) {
  std::vector<float> out(t.dims[0]);
  const uint64_t rb = kernels::RowBytes(t.type, t.dims[0]);
  kernels::DequantizeRow(t.type, t.data + r * rb, out.data(), t.dims[0]);
  return out;
}

std::vector<float> AllF32(const TensorInfo& t) {
  std::vector<float> out;
  for (int64_t r = 0; r < t.Rows(); ++r) {
    auto row = Row(t, r);
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

const std::string kStoriesDir = std::string(TANDEM_SHARED_MODELS_DIR) + "/stories260K";
const std::string kVocabDir = TANDEM_VOCAB_DIR;

// ---------------------------------------------------------------------------------------------
// llama2.c conversion

TEST(ConvertLlama2c, Stories260KMatchesLlamaCppConversion) {
  const std::string bin = kStoriesDir + "/stories260K.bin";
  const std::string tok = kStoriesDir + "/tok512.bin";
  const std::string ref_path = kStoriesDir + "/stories260K.gguf";
  if (!std::filesystem::exists(bin) || !std::filesystem::exists(ref_path)) {
    GTEST_SKIP() << kStoriesDir << " is absent";
  }
  const std::string out = TempPath("stories260K.gguf");
  ASSERT_TRUE(ConvertLlama2c({bin, tok, out}).ok());
  auto ours_or = GgufFile::Open(out);
  auto ref_or = GgufFile::Open(ref_path);
  ASSERT_TRUE(ours_or.ok()) << ours_or.status();
  ASSERT_TRUE(ref_or.ok()) << ref_or.status();
  const GgufFile& ours = **ours_or;
  const GgufFile& ref = **ref_or;

  for (const char* key :
       {"llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
        "llama.attention.head_count_kv", "llama.block_count", "llama.rope.dimension_count",
        "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id"}) {
    EXPECT_EQ(*ours.GetUInt(key), *ref.GetUInt(key)) << key;
  }
  EXPECT_EQ(*ours.GetFloat("llama.attention.layer_norm_rms_epsilon"),
            *ref.GetFloat("llama.attention.layer_norm_rms_epsilon"));
  // llama.cpp's converter writes its own default context (2048); ours keeps the checkpoint's.
  EXPECT_EQ(*ours.GetUInt("llama.context_length"), 512u);
  EXPECT_EQ(*ours.GetFloat("llama.rope.freq_base"), 10000.0);
  EXPECT_EQ(*ours.GetString("general.architecture"), "llama");
  EXPECT_EQ(*ours.GetString("general.name"), "stories260K");
  EXPECT_EQ(*ours.GetUInt("general.file_type"), 0u);
  EXPECT_EQ(*ours.GetString("tokenizer.ggml.model"), *ref.GetString("tokenizer.ggml.model"));

  auto our_tokens = *ours.GetStringArray("tokenizer.ggml.tokens");
  auto ref_tokens = *ref.GetStringArray("tokenizer.ggml.tokens");
  ASSERT_EQ(our_tokens.size(), 512u);
  EXPECT_TRUE(
      std::equal(our_tokens.begin(), our_tokens.end(), ref_tokens.begin(), ref_tokens.end()));
  EXPECT_EQ(our_tokens[259], "\xe2\x96\x81t");  // " t" with the SentencePiece space
  const auto our_scores = *ours.GetF32Array("tokenizer.ggml.scores");
  const auto ref_scores = *ref.GetF32Array("tokenizer.ggml.scores");
  ASSERT_EQ(our_scores.size(), ref_scores.size());
  EXPECT_EQ(0, std::memcmp(our_scores.data(), ref_scores.data(), our_scores.size() * 4));
  EXPECT_EQ(*ours.GetIntArray("tokenizer.ggml.token_type"),
            *ref.GetIntArray("tokenizer.ggml.token_type"));

  ASSERT_EQ(ours.tensors().size(), ref.tensors().size());
  for (const TensorInfo& r : ref.tensors()) {
    const TensorInfo* o = ours.FindTensor(r.name);
    ASSERT_NE(o, nullptr) << r.name;
    EXPECT_EQ(o->dims, r.dims) << r.name;
    EXPECT_EQ(o->type, r.type) << r.name;
    ASSERT_EQ(o->nbytes, r.nbytes) << r.name;
    EXPECT_EQ(0, std::memcmp(o->data, r.data, r.nbytes)) << r.name;
  }
}

// A hand-made checkpoint with a separate classifier, GQA and a tokenizer with byte and space
// tokens: checks the weight order and the token rewriting, independent of the shared model.
struct TinyCheckpoint {
  static constexpr int32_t kDim = 8, kHidden = 16, kLayers = 2, kHeads = 2, kKvHeads = 1,
                           kVocab = 6, kSeq = 4;
  std::vector<float> floats;  // every weight, in file order
  std::vector<uint8_t> model, tokenizer;

  TinyCheckpoint() {
    const int32_t header[7] = {kDim, kHidden, kLayers, kHeads, kKvHeads, -kVocab, kSeq};
    const int kv = kDim * kKvHeads / kHeads, hs = kDim / kHeads;
    const size_t n = kVocab * kDim + kLayers * kDim + kLayers * kDim * kDim * 2 +
                     kLayers * kDim * kv * 2 + kLayers * kDim + kLayers * kDim * kHidden * 3 +
                     kDim + kSeq * hs + kVocab * kDim;
    floats.resize(n);
    for (size_t i = 0; i < n; ++i) floats[i] = static_cast<float>(i) * 0.5f + 0.25f;
    model.resize(28 + n * 4);
    std::memcpy(model.data(), header, 28);
    std::memcpy(model.data() + 28, floats.data(), n * 4);
    auto put_i32 = [&](int32_t v) {
      tokenizer.insert(tokenizer.end(), reinterpret_cast<uint8_t*>(&v),
                       reinterpret_cast<uint8_t*>(&v) + 4);
    };
    auto put_tok = [&](float score, std::string_view s) {
      put_i32(0);
      std::memcpy(tokenizer.data() + tokenizer.size() - 4, &score, 4);
      put_i32(static_cast<int32_t>(s.size()));
      tokenizer.insert(tokenizer.end(), s.begin(), s.end());
    };
    put_i32(6);  // max_token_length
    put_tok(0.f, "<unk>");
    put_tok(0.f, "\n<s>\n");
    put_tok(0.f, "\n</s>\n");
    put_tok(0.f, "<0x41>");
    put_tok(-1.5f, " a b");
    put_tok(-2.5f, "");
  }
};

TEST(ConvertLlama2c, UntiedClassifierGqaAndTokens) {
  TinyCheckpoint ck;
  const std::string bin = TempPath("tiny.bin"), tok = TempPath("tiny_tok.bin"),
                    out = TempPath("tiny.gguf");
  WriteAll(bin, ck.model);
  WriteAll(tok, ck.tokenizer);
  ASSERT_TRUE(ConvertLlama2c({bin, tok, out}).ok());
  auto f = GgufFile::Open(out);
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(*g.GetUInt("llama.attention.head_count_kv"), 1u);
  EXPECT_EQ(*g.GetUInt("llama.rope.dimension_count"), 4u);
  EXPECT_EQ(*g.GetUInt("llama.context_length"), 4u);
  EXPECT_THAT(*g.GetStringArray("tokenizer.ggml.tokens"),
              ::testing::ElementsAre("<unk>", "<s>", "</s>", "<0x41>",
                                     "\xe2\x96\x81"
                                     "a\xe2\x96\x81"
                                     "b",
                                     ""));
  EXPECT_THAT(*g.GetIntArray("tokenizer.ggml.token_type"),
              ::testing::ElementsAre(2, 3, 3, 6, 1, 3));
  EXPECT_THAT(*g.GetF32Array("tokenizer.ggml.scores"),
              ::testing::ElementsAre(0.f, 0.f, 0.f, 0.f, -1.5f, -2.5f));

  // Walk the file order and check each tensor picked up its own slice.
  const int D = TinyCheckpoint::kDim, H = TinyCheckpoint::kHidden, L = TinyCheckpoint::kLayers,
            V = TinyCheckpoint::kVocab, KV = D / 2;
  size_t at = 0;
  auto expect_slice = [&](const std::string& name, std::vector<int64_t> dims, size_t count) {
    const TensorInfo* t = g.FindTensor(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->dims, dims) << name;
    ASSERT_EQ(t->nbytes, count * 4) << name;
    EXPECT_EQ(0, std::memcmp(t->data, ck.floats.data() + at, count * 4)) << name;
  };
  auto per_layer = [&](const std::string& suffix, std::vector<int64_t> dims, size_t count) {
    for (int l = 0; l < L; ++l) {
      expect_slice("blk." + std::to_string(l) + "." + suffix, dims, count);
      at += count;
    }
  };
  expect_slice("token_embd.weight", {D, V}, V * D);
  at += V * D;
  per_layer("attn_norm.weight", {D}, D);
  per_layer("attn_q.weight", {D, D}, D * D);
  per_layer("attn_k.weight", {D, KV}, D * KV);
  per_layer("attn_v.weight", {D, KV}, D * KV);
  per_layer("attn_output.weight", {D, D}, D * D);
  per_layer("ffn_norm.weight", {D}, D);
  per_layer("ffn_gate.weight", {D, H}, D * H);
  per_layer("ffn_down.weight", {H, D}, H * D);
  per_layer("ffn_up.weight", {D, H}, D * H);
  expect_slice("output_norm.weight", {D}, D);
  at += D + TinyCheckpoint::kSeq * (D / TinyCheckpoint::kHeads);  // skip the freq_cis tables
  expect_slice("output.weight", {D, V}, V * D);
  EXPECT_EQ(at + V * D, ck.floats.size());
}

TEST(ConvertLlama2c, BadInputs) {
  TinyCheckpoint ck;
  const std::string bin = TempPath("bad.bin"), tok = TempPath("bad_tok.bin"),
                    out = TempPath("bad.gguf");
  WriteAll(tok, ck.tokenizer);
  // Every truncation of the checkpoint is rejected (the header fixes the exact size).
  for (size_t n : {size_t{0}, size_t{27}, size_t{28}, ck.model.size() - 4, ck.model.size() + 4}) {
    std::vector<uint8_t> b = ck.model;
    b.resize(n);
    WriteAll(bin, b);
    auto st = ConvertLlama2c({bin, tok, out});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << n << ": " << st;
  }
  std::vector<uint8_t> b = ck.model;
  int32_t bad_heads = 3;  // dim 8 is not a multiple of 3 heads
  std::memcpy(b.data() + 12, &bad_heads, 4);
  WriteAll(bin, b);
  EXPECT_THAT(Msg(ConvertLlama2c({bin, tok, out})), HasSubstr("n_heads"));
  int32_t huge_vocab = -0x7fffffff;
  b = ck.model;
  std::memcpy(b.data() + 20, &huge_vocab, 4);
  WriteAll(bin, b);
  EXPECT_EQ(ConvertLlama2c({bin, tok, out}).code(), absl::StatusCode::kInvalidArgument);

  WriteAll(bin, ck.model);
  std::vector<uint8_t> t = ck.tokenizer;
  t.resize(t.size() - 3);
  WriteAll(tok, t);
  EXPECT_THAT(Msg(ConvertLlama2c({bin, tok, out})), HasSubstr("truncated"));
  t = ck.tokenizer;
  t.push_back(0);
  WriteAll(tok, t);
  EXPECT_THAT(Msg(ConvertLlama2c({bin, tok, out})), HasSubstr("do not match"));
  EXPECT_EQ(ConvertLlama2c({bin, TempPath("missing_tok.bin"), out}).code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(std::filesystem::exists(out));
}

// ---------------------------------------------------------------------------------------------
// Synthetic models

bool HaveVocab(const std::string& name) { return std::filesystem::exists(kVocabDir + "/" + name); }

class SynthStories15M : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!HaveVocab("ggml-vocab-llama-spm.gguf")) return;
    path_ = new std::string(TempPath("synth_stories15M_s1.gguf"));
    status_ =
        new absl::Status(Synthesize({"stories15M", DType::kF32, *path_, /*seed=*/1, kVocabDir}));
  }
  static void TearDownTestSuite() {
    if (path_ != nullptr) std::filesystem::remove(*path_);
    delete path_;
    delete status_;
    path_ = nullptr;
    status_ = nullptr;
  }
  void SetUp() override {
    if (path_ == nullptr) GTEST_SKIP() << "vocab files absent in " << kVocabDir;
    ASSERT_TRUE(status_->ok()) << *status_;
    auto f = GgufFile::Open(*path_);
    ASSERT_TRUE(f.ok()) << f.status();
    file_ = std::move(*f);
  }
  static std::string* path_;
  static absl::Status* status_;
  std::unique_ptr<GgufFile> file_;
};
std::string* SynthStories15M::path_ = nullptr;
absl::Status* SynthStories15M::status_ = nullptr;

TEST_F(SynthStories15M, DeterministicBySeed) {
  const std::string again = TempPath("synth_stories15M_s1_again.gguf");
  const std::string other = TempPath("synth_stories15M_s2.gguf");
  ASSERT_TRUE(Synthesize({"stories15M", DType::kF32, again, 1, kVocabDir}).ok());
  ASSERT_TRUE(Synthesize({"stories15M", DType::kF32, other, 2, kVocabDir}).ok());
  const auto a = ReadAll(*path_), b = ReadAll(again), c = ReadAll(other);
  EXPECT_GT(a.size(), 50u << 20);
  EXPECT_TRUE(a == b) << "same seed gave different bytes";
  ASSERT_EQ(a.size(), c.size());
  EXPECT_FALSE(a == c);
  // Different seeds differ in every weight tensor, not just the metadata.
  auto fc = GgufFile::Open(other);
  ASSERT_TRUE(fc.ok());
  for (const TensorInfo& t : file_->tensors()) {
    const TensorInfo* u = (*fc)->FindTensor(t.name);
    ASSERT_NE(u, nullptr);
    EXPECT_NE(0, std::memcmp(t.data, u->data, t.nbytes)) << t.name;
  }
  std::filesystem::remove(again);
  std::filesystem::remove(other);
}

TEST_F(SynthStories15M, ShapeMetadataAndTokenizer) {
  const GgufFile& g = *file_;
  EXPECT_EQ(*g.GetString("general.architecture"), "llama");
  EXPECT_THAT(std::string(*g.GetString("general.name")), HasSubstr("random weights"));
  EXPECT_EQ(*g.GetUInt("llama.embedding_length"), 288u);
  EXPECT_EQ(*g.GetUInt("llama.block_count"), 6u);
  EXPECT_EQ(*g.GetUInt("llama.attention.head_count"), 6u);
  EXPECT_EQ(*g.GetUInt("llama.attention.head_count_kv"), 6u);
  EXPECT_EQ(*g.GetUInt("llama.feed_forward_length"), 768u);
  EXPECT_EQ(*g.GetUInt("llama.context_length"), 256u);
  EXPECT_EQ(*g.GetUInt("llama.rope.dimension_count"), 48u);
  EXPECT_EQ(*g.GetFloat("llama.rope.freq_base"), 10000.0);
  EXPECT_NEAR(*g.GetFloat("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-10);
  EXPECT_EQ(*g.GetUInt("general.file_type"), 0u);

  // Every tokenizer key of the vocab file is copied unchanged.
  auto vocab = GgufFile::Open(kVocabDir + "/ggml-vocab-llama-spm.gguf");
  ASSERT_TRUE(vocab.ok());
  int copied = 0;
  for (const gguf::KeyValue& kv : (*vocab)->metadata()) {
    if (!kv.key.starts_with("tokenizer.")) continue;
    ++copied;
    const gguf::Value* v = g.Find(kv.key);
    ASSERT_NE(v, nullptr) << kv.key;
    EXPECT_EQ(v->type, kv.value.type) << kv.key;
  }
  EXPECT_GE(copied, 8);
  const auto tokens = *g.GetStringArray("tokenizer.ggml.tokens");
  const auto vocab_tokens = *(*vocab)->GetStringArray("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 32000u);
  EXPECT_TRUE(std::equal(tokens.begin(), tokens.end(), vocab_tokens.begin()));
  EXPECT_EQ(*g.GetF32Array("tokenizer.ggml.scores"),
            *(*vocab)->GetF32Array("tokenizer.ggml.scores"));
  EXPECT_EQ(*g.GetUInt("llama.vocab_size"), 32000u);

  EXPECT_EQ(g.tensors().size(), 3u + 9u * 6u);
  EXPECT_EQ(g.FindTensor("rope_freqs.weight"), nullptr);
  const TensorInfo* out = g.FindTensor("output.weight");
  ASSERT_NE(out, nullptr);
  EXPECT_EQ(out->dims, (std::vector<int64_t>{288, 32000}));
  const TensorInfo* down = g.FindTensor("blk.5.ffn_down.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->dims, (std::vector<int64_t>{768, 288}));
  for (const TensorInfo& t : g.tensors()) EXPECT_EQ(t.type, DType::kF32) << t.name;
}

double Mean(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += x;
  return s / v.size();
}
double Std(const std::vector<float>& v) {
  const double m = Mean(v);
  double s = 0;
  for (float x : v) s += (x - m) * (x - m);
  return std::sqrt(s / v.size());
}

TEST_F(SynthStories15M, WeightScales) {
  // The gains documented in Synthesize: W_q x2, layer-0 W_o x0.3, later W_o and W_down
  // x1/sqrt(6), embeddings 0.3/sqrt(dim).
  const GgufFile& g = *file_;
  auto std_of = [&](const char* name) { return Std(AllF32(*g.FindTensor(name))); };
  EXPECT_NEAR(std_of("blk.2.attn_q.weight"), 2 / std::sqrt(288.0), 2e-3);
  EXPECT_NEAR(std_of("blk.2.attn_k.weight"), 1 / std::sqrt(288.0), 1e-3);
  EXPECT_NEAR(std_of("blk.0.attn_output.weight"), 0.3 / std::sqrt(288.0), 1e-3);
  EXPECT_NEAR(std_of("blk.2.attn_output.weight"), 1 / std::sqrt(6 * 288.0), 1e-3);
  EXPECT_NEAR(std_of("blk.0.ffn_down.weight"), 1 / std::sqrt(768.0), 1e-3);
  EXPECT_NEAR(std_of("blk.2.ffn_down.weight"), 1 / std::sqrt(6 * 768.0), 1e-3);
  EXPECT_NEAR(std_of("token_embd.weight"), 0.3 / std::sqrt(288.0), 1e-3);
  EXPECT_NEAR(std_of("output.weight"), 1 / std::sqrt(288.0), 1e-3);
  EXPECT_NEAR(Mean(AllF32(*g.FindTensor("blk.2.attn_q.weight"))), 0.0, 1e-3);
  const auto norm = AllF32(*g.FindTensor("blk.0.attn_norm.weight"));
  EXPECT_NEAR(Mean(norm), 1.0, 0.02);
  EXPECT_NEAR(Std(norm), 0.05, 0.015);
  // Rows are independent streams: two rows of one tensor and the same row of two tensors
  // are uncorrelated.
  const TensorInfo& q = *g.FindTensor("blk.0.attn_q.weight");
  const TensorInfo& k = *g.FindTensor("blk.0.attn_k.weight");
  auto corr = [](const std::vector<float>& a, const std::vector<float>& b) {
    double ab = 0, aa = 0, bb = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      ab += a[i] * b[i];
      aa += a[i] * a[i];
      bb += b[i] * b[i];
    }
    return ab / std::sqrt(aa * bb);
  };
  EXPECT_LT(std::abs(corr(Row(q, 0), Row(q, 1))), 0.25);
  EXPECT_LT(std::abs(corr(Row(q, 7), Row(k, 7))), 0.25);
}

// A plain f32 llama forward pass (adjacent-pair rotary, GQA, SwiGLU), used to show the random
// model is numerically tame: activations stay bounded through the layers, attention is not
// one-hot, and the logits have a clear winner at every greedy step.
class ReferenceLlama {
 public:
  // tied: use token_embd as the output matrix even when output.weight exists.
  ReferenceLlama(const GgufFile& g, bool tied) : g_(g), tied_(tied) {
    dim_ = *g.GetUInt("llama.embedding_length");
    layers_ = *g.GetUInt("llama.block_count");
    heads_ = *g.GetUInt("llama.attention.head_count");
    kv_heads_ = *g.GetUInt("llama.attention.head_count_kv");
    ffn_ = *g.GetUInt("llama.feed_forward_length");
    eps_ = *g.GetFloat("llama.attention.layer_norm_rms_epsilon");
    base_ = *g.GetFloat("llama.rope.freq_base");
    hd_ = dim_ / heads_;
    kcache_.resize(layers_);
    vcache_.resize(layers_);
  }

  struct StepStats {
    std::vector<double> layer_rms;  // residual RMS after each layer
    double mean_max_attention = 0;  // over heads and layers
    std::vector<float> logits;
  };

  StepStats Step(int token, int pos) {
    StepStats st;
    std::vector<float> x = Row(*T("token_embd.weight"), token);
    double attn_max_sum = 0;
    for (int l = 0; l < layers_; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      auto xn = Norm(x, p + "attn_norm.weight");
      auto q = MatVec(p + "attn_q.weight", xn);
      auto k = MatVec(p + "attn_k.weight", xn);
      auto v = MatVec(p + "attn_v.weight", xn);
      Rope(q, pos);
      Rope(k, pos);
      kcache_[l].push_back(k);
      vcache_[l].push_back(v);
      std::vector<float> att(heads_ * hd_, 0.f);
      for (int h = 0; h < heads_; ++h) {
        const int kvh = h / (heads_ / kv_heads_);
        std::vector<double> w(pos + 1);
        double mx = -1e300;
        for (int t = 0; t <= pos; ++t) {
          double s = 0;
          for (int i = 0; i < hd_; ++i) s += q[h * hd_ + i] * kcache_[l][t][kvh * hd_ + i];
          w[t] = s / std::sqrt(static_cast<double>(hd_));
          mx = std::max(mx, w[t]);
        }
        double sum = 0;
        for (double& e : w) sum += (e = std::exp(e - mx));
        double wmax = 0;
        for (int t = 0; t <= pos; ++t) {
          w[t] /= sum;
          wmax = std::max(wmax, w[t]);
          for (int i = 0; i < hd_; ++i) att[h * hd_ + i] += w[t] * vcache_[l][t][kvh * hd_ + i];
        }
        attn_max_sum += wmax;
      }
      auto o = MatVec(p + "attn_output.weight", att);
      for (int i = 0; i < dim_; ++i) x[i] += o[i];
      xn = Norm(x, p + "ffn_norm.weight");
      auto gate = MatVec(p + "ffn_gate.weight", xn);
      auto up = MatVec(p + "ffn_up.weight", xn);
      for (int i = 0; i < ffn_; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
      auto down = MatVec(p + "ffn_down.weight", gate);
      for (int i = 0; i < dim_; ++i) x[i] += down[i];
      double ss = 0;
      for (float e : x) ss += e * e;
      st.layer_rms.push_back(std::sqrt(ss / dim_));
    }
    st.mean_max_attention = attn_max_sum / (layers_ * heads_);
    const bool has_out = g_.FindTensor("output.weight") != nullptr;
    st.logits = MatVec(has_out && !tied_ ? "output.weight" : "token_embd.weight",
                       Norm(x, "output_norm.weight"));
    return st;
  }

 private:
  const TensorInfo* T(const std::string& name) const {
    const TensorInfo* t = g_.FindTensor(name);
    EXPECT_NE(t, nullptr) << name;
    return t;
  }
  std::vector<float> Norm(const std::vector<float>& x, const std::string& w) const {
    double ss = 0;
    for (float e : x) ss += e * e;
    const double scale = 1.0 / std::sqrt(ss / x.size() + eps_);
    const auto g = Row(*T(w), 0);
    std::vector<float> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(x[i] * scale) * g[i];
    return out;
  }
  std::vector<float> MatVec(const std::string& name, const std::vector<float>& x) const {
    const TensorInfo& t = *T(name);
    EXPECT_EQ(static_cast<size_t>(t.dims[0]), x.size()) << name;
    std::vector<float> out(t.Rows());
    const float* w = reinterpret_cast<const float*>(t.data);  // f32 model
    for (int64_t r = 0; r < t.Rows(); ++r) {
      double s = 0;
      for (int64_t i = 0; i < t.dims[0]; ++i) s += w[r * t.dims[0] + i] * x[i];
      out[r] = static_cast<float>(s);
    }
    return out;
  }
  void Rope(std::vector<float>& v, int pos) const {
    for (size_t h = 0; h < v.size() / hd_; ++h) {
      for (int i = 0; i < hd_; i += 2) {
        const double theta = pos * std::pow(base_, -static_cast<double>(i) / hd_);
        const double c = std::cos(theta), s = std::sin(theta);
        float& a = v[h * hd_ + i];
        float& b = v[h * hd_ + i + 1];
        const double a0 = a, b0 = b;
        a = static_cast<float>(a0 * c - b0 * s);
        b = static_cast<float>(a0 * s + b0 * c);
      }
    }
  }

  const GgufFile& g_;
  bool tied_;
  int dim_, layers_, heads_, kv_heads_, ffn_, hd_;
  double eps_, base_;
  std::vector<std::vector<std::vector<float>>> kcache_, vcache_;
};

// Greedy decoding from `start` with the reference model; checks the properties engine
// comparisons rely on.
void CheckTameDecode(const GgufFile& file, bool tied, int start) {
  SCOPED_TRACE(std::string(tied ? "tied" : "untied") + " output, start token " +
               std::to_string(start));
  ReferenceLlama model(file, tied);
  int token = start;
  std::set<int> generated;
  std::vector<double> rel_gaps;
  double prev_winner_z = 0;
  int repeats = 0;
  constexpr int kSteps = 32;
  for (int pos = 0; pos < kSteps; ++pos) {
    const auto st = model.Step(token, pos);
    for (double rms : st.layer_rms) {
      ASSERT_TRUE(std::isfinite(rms));
      EXPECT_GT(rms, 0.1) << "pos " << pos;
      EXPECT_LT(rms, 5.0) << "pos " << pos;
    }
    // The residual stream grows gently, not exponentially.
    EXPECT_LT(st.layer_rms.back() / st.layer_rms.front(), 3.0);
    if (pos >= 4) {
      EXPECT_LT(st.mean_max_attention, 0.8) << "attention is near one-hot";
    }
    std::vector<float> sorted = st.logits;
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    const double sd = Std(st.logits), mean = Mean(st.logits);
    EXPECT_GT(sd, tied ? 0.1 : 0.3);
    EXPECT_LT(sd, 5.0);
    rel_gaps.push_back((sorted[0] - sorted[1]) / sd);
    if (pos > 0) prev_winner_z += (st.logits[token] - mean) / sd;
    const int next =
        static_cast<int>(std::max_element(st.logits.begin(), st.logits.end()) - st.logits.begin());
    repeats += next == token;
    token = next;
    generated.insert(token);
  }
  std::sort(rel_gaps.begin(), rel_gaps.end());
  // For Gaussian logits over 32k tokens the top-1/top-2 gap is ~0.2 sd; float rounding in a
  // 288-long dot product is ~1e-6 of it.
  EXPECT_GT(rel_gaps[kSteps / 2], 0.05);
  EXPECT_GT(rel_gaps.front(), 1e-5);
  // Decoding keeps moving: consecutive hidden states differ enough that the last winner is
  // not favoured (a context-averaging model scores it ~4 sd above the mean, and repeats it).
  EXPECT_LT(prev_winner_z / (kSteps - 1), 2.0);
  EXPECT_LE(repeats, 3);
  EXPECT_GE(generated.size(), 24u) << "greedy decoding collapsed onto a few tokens";
}

TEST_F(SynthStories15M, NumericallyTameWithClearGreedyWinners) {
  for (bool tied : {false, true}) {
    for (int start : {1, 500}) CheckTameDecode(*file_, tied, start);
  }
}

TEST(Synthesize, QuantizedWithF16FallbackForPartialBlocks) {
  if (!HaveVocab("ggml-vocab-llama-spm.gguf")) GTEST_SKIP() << "vocab files absent";
  const std::string path = TempPath("synth_q4k.gguf");
  ASSERT_TRUE(Synthesize({"stories15M", DType::kQ4_K, path, 3, kVocabDir}).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(*g.GetUInt("general.file_type"), 15u);
  // 288-wide rows are not a whole number of 256-element blocks; 768-wide rows are.
  EXPECT_EQ(g.FindTensor("blk.0.attn_q.weight")->type, DType::kF16);
  EXPECT_EQ(g.FindTensor("token_embd.weight")->type, DType::kF16);
  EXPECT_EQ(g.FindTensor("blk.0.ffn_down.weight")->type, DType::kQ4_K);
  EXPECT_EQ(g.FindTensor("blk.0.ffn_norm.weight")->type, DType::kF32);
  const auto fallback = *g.GetStringArray("tandem.synth.f16_fallback_tensors");
  EXPECT_EQ(fallback.size(), 2u + 6u * 6u);  // embedding, output and 6 matrices per layer
  EXPECT_NE(std::find(fallback.begin(), fallback.end(), "blk.3.ffn_up.weight"), fallback.end());
  // The quantised matrix holds the same random values as the f32 synthesis, up to Q4_K error.
  const std::string ref_path = TempPath("synth_q4k_ref.gguf");
  ASSERT_TRUE(Synthesize({"stories15M", DType::kF32, ref_path, 3, kVocabDir}).ok());
  auto ref = GgufFile::Open(ref_path);
  ASSERT_TRUE(ref.ok());
  const auto a = AllF32(*g.FindTensor("blk.1.ffn_down.weight"));
  const auto b = AllF32(*(*ref)->FindTensor("blk.1.ffn_down.weight"));
  double err = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  EXPECT_LT(std::sqrt(err / norm), 0.15);
  EXPECT_GT(std::sqrt(err / norm), 1e-3);
  std::filesystem::remove(path);
  std::filesystem::remove(ref_path);
}

TEST(Synthesize, Llama3RopeFactorsOfLlama32) {
  // Llama-3.2-1B: base 500000, head_dim 64, factor 32, low 1, high 4, original context 8192.
  // Wavelengths under 2048 keep factor 1, over 8192 get 32, and three lie in between.
  const auto f = Llama3RopeFactors({32.0, 1.0, 4.0, 8192}, 500000.0, 64);
  ASSERT_EQ(f.size(), 32u);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(f[i], 1.0f) << i;
  EXPECT_NEAR(f[15], 1.6513, 1e-4);
  EXPECT_NEAR(f[16], 3.2923, 1e-4);
  EXPECT_NEAR(f[17], 9.6667, 1e-4);
  for (int i = 18; i < 32; ++i) EXPECT_EQ(f[i], 32.0f) << i;
  // Llama 3.1 (factor 8, head_dim 128): the blend region moves but stays monotone.
  const auto g = Llama3RopeFactors({8.0, 1.0, 4.0, 8192}, 500000.0, 128);
  ASSERT_EQ(g.size(), 64u);
  EXPECT_EQ(g.front(), 1.0f);
  EXPECT_EQ(g.back(), 8.0f);
  EXPECT_TRUE(std::is_sorted(g.begin(), g.end()));
}

TEST(Synthesize, BadOptions) {
  const std::string out = TempPath("synth_bad.gguf");
  EXPECT_THAT(Msg(Synthesize({"gpt-7", DType::kF32, out, 0, kVocabDir})), HasSubstr("stories15M"));
  EXPECT_EQ(Synthesize({"stories15M", DType::kQ8_K, out, 0, kVocabDir}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Synthesize({"stories15M", DType::kF32, out, 0, ""}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Synthesize({"stories15M", DType::kF32, out, 0, "/nonexistent"}).code(),
            absl::StatusCode::kNotFound);
  EXPECT_THAT(SynthShapeNames(),
              ::testing::ElementsAre("stories15M", "llama-1b", "qwen2-0.5b", "qwen3-0.6b",
                                     "qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-mini",
                                     "qwen3moe-test", "qwen2moe-test", "mixtral-test",
                                     "gpt-oss-20b", "gpt-oss-test"));
}

// MoE shapes: experts as 3-D stacks with the keys llama.cpp reads; the router stays F32
// whatever the type, and requantisation converts the stacks but not the router.
TEST(Synthesize, MoeShapesStackTheirExperts) {
  if (!HaveVocab("ggml-vocab-qwen2.gguf")) GTEST_SKIP() << "vocab files absent";
  const std::string path = TempPath("synth_qwen2moe.gguf");
  ASSERT_TRUE(Synthesize({"qwen2moe-test", DType::kQ8_0, path, 2, kVocabDir}).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(*g.GetString("general.architecture"), "qwen2moe");
  EXPECT_EQ(*g.GetUInt("qwen2moe.expert_count"), 16u);
  EXPECT_EQ(*g.GetUInt("qwen2moe.expert_used_count"), 4u);
  EXPECT_EQ(*g.GetUInt("qwen2moe.expert_feed_forward_length"), 256u);
  EXPECT_EQ(*g.GetUInt("qwen2moe.expert_shared_feed_forward_length"), 512u);
  const gguf::TensorInfo* up = g.FindTensor("blk.3.ffn_up_exps.weight");
  ASSERT_NE(up, nullptr);
  EXPECT_EQ(up->dims, (std::vector<int64_t>{256, 256, 16}));
  EXPECT_EQ(up->type, DType::kQ8_0);
  EXPECT_EQ(g.FindTensor("blk.3.ffn_down_exps.weight")->dims, (std::vector<int64_t>{256, 256, 16}));
  EXPECT_EQ(g.FindTensor("blk.3.ffn_gate_inp.weight")->type, DType::kF32);
  EXPECT_EQ(g.FindTensor("blk.3.ffn_gate_inp_shexp.weight")->dims, (std::vector<int64_t>{256}));
  EXPECT_EQ(g.FindTensor("blk.3.ffn_down_shexp.weight")->dims, (std::vector<int64_t>{512, 256}));
  EXPECT_EQ(g.FindTensor("blk.0.ffn_gate.weight"), nullptr);
  // Expert slabs are distinct random matrices, not copies of one.
  const std::vector<float> all = AllF32(*up);
  const size_t slab = 256 * 256;
  double diff = 0;
  for (size_t i = 0; i < slab; ++i) diff += std::fabs(all[i] - all[slab + i]);
  EXPECT_GT(diff / slab, 0.01);

  const std::string q = TempPath("synth_qwen2moe_q4k.gguf");
  ASSERT_TRUE(QuantizeModel(path, q, DType::kQ4_K).ok());
  auto qf = GgufFile::Open(q);
  ASSERT_TRUE(qf.ok());
  EXPECT_EQ((*qf)->FindTensor("blk.3.ffn_up_exps.weight")->type, DType::kQ4_K);
  EXPECT_EQ((*qf)->FindTensor("blk.3.ffn_up_exps.weight")->dims, up->dims);
  EXPECT_EQ((*qf)->FindTensor("blk.3.ffn_gate_inp.weight")->type, DType::kF32);
  std::filesystem::remove(path);
  std::filesystem::remove(q);
}

// ---------------------------------------------------------------------------------------------
// Requantisation

// A small model-like source: matrices of several widths, 1D tensors and a 2D non-weight.
std::string MakeQuantSource(const std::string& name, uint32_t alignment) {
  gguf::GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetU32("general.file_type", 0);
  w.SetStringArray("tokenizer.ggml.tokens", {"a", "b"});
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto add = [&](const std::string& n, std::vector<int64_t> dims, float scale) {
    int64_t count = 1;
    for (int64_t d : dims) count *= d;
    std::vector<float> v(count);
    for (float& x : v) x = nd(rng) * scale;
    // A few outliers, as real weights have.
    for (int64_t i = 0; i < count; i += 97) v[i] *= 4.f;
    EXPECT_TRUE(w.AddTensor(n, dims, DType::kF32,
                            {reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4})
                    .ok());
  };
  add("token_embd.weight", {256, 16}, 0.05f);
  add("blk.0.attn_q.weight", {256, 8}, 0.06f);
  add("blk.0.ffn_down.weight", {512, 4}, 0.04f);
  add("blk.0.odd.weight", {96, 3}, 0.1f);  // a whole number of 32-blocks, not of 256-blocks
  add("blk.0.attn_norm.weight", {256}, 1.f);
  add("blk.0.attn_q.bias", {256}, 0.1f);
  add("blk.0.mixer.scale", {32, 2}, 1.f);  // 2D but not a .weight: left alone
  const std::string path = TempPath(name);
  EXPECT_TRUE(w.Write(path, alignment).ok());
  return path;
}

struct QuantCase {
  DType type;
  uint32_t file_type;
  double max_rel_rms;  // bound on ||dequant - orig|| / ||orig|| over a matrix
};

class QuantizeModelTest : public ::testing::TestWithParam<QuantCase> {};

TEST_P(QuantizeModelTest, MatricesConvertWithinBound) {
  const QuantCase qc = GetParam();
  const std::string src_path = MakeQuantSource("quant_src.gguf", 64);
  const std::string dst_path =
      TempPath(std::string("quant_") + std::string(kernels::Traits(qc.type).name) + ".gguf");
  ASSERT_TRUE(QuantizeModel(src_path, dst_path, qc.type).ok());
  auto src = GgufFile::Open(src_path);
  auto dst = GgufFile::Open(dst_path);
  ASSERT_TRUE(src.ok() && dst.ok());
  const GgufFile& s = **src;
  const GgufFile& d = **dst;
  EXPECT_EQ(*d.GetUInt("general.file_type"), qc.file_type);
  EXPECT_EQ(d.alignment(), 64u);
  EXPECT_THAT(*d.GetStringArray("tokenizer.ggml.tokens"), ::testing::ElementsAre("a", "b"));
  ASSERT_EQ(d.tensors().size(), s.tensors().size());
  const int64_t block = kernels::Traits(qc.type).block_elems;
  for (const TensorInfo& st : s.tensors()) {
    const TensorInfo* dt = d.FindTensor(st.name);
    ASSERT_NE(dt, nullptr) << st.name;
    EXPECT_EQ(dt->dims, st.dims);
    const bool matrix = st.dims.size() == 2 && st.name.ends_with(".weight");
    if (!matrix) {
      EXPECT_EQ(dt->type, DType::kF32) << st.name;
      ASSERT_EQ(dt->nbytes, st.nbytes);
      EXPECT_EQ(0, std::memcmp(dt->data, st.data, st.nbytes)) << st.name;
      continue;
    }
    const DType want = st.dims[0] % block == 0 ? qc.type : DType::kF16;
    EXPECT_EQ(dt->type, want) << st.name;
    const auto a = AllF32(st), b = AllF32(*dt);
    double err = 0, norm = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      err += (a[i] - b[i]) * (a[i] - b[i]);
      norm += a[i] * a[i];
    }
    const double rel = std::sqrt(err / norm);
    const double bound = want == qc.type ? qc.max_rel_rms : 1e-3;
    EXPECT_LT(rel, bound) << st.name;
    EXPECT_GT(rel, 0.0) << st.name << " was not converted";
  }
  if (block > 32) {
    EXPECT_THAT(*d.GetStringArray("tandem.quantize.f16_fallback_tensors"),
                ::testing::ElementsAre("blk.0.odd.weight"));
  } else {
    EXPECT_EQ(d.Find("tandem.quantize.f16_fallback_tensors"), nullptr);
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllTypes, QuantizeModelTest,
    // Bounds sit ~1.3x above what these formats give on Gaussian weights with outliers.
    ::testing::Values(QuantCase{DType::kF16, 1, 5e-4}, QuantCase{DType::kBF16, 32, 3e-3},
                      QuantCase{DType::kQ8_0, 7, 1e-2}, QuantCase{DType::kQ6_K, 18, 3e-2},
                      QuantCase{DType::kQ4_K, 15, 0.11}, QuantCase{DType::kQ4_0, 2, 0.14},
                      QuantCase{DType::kMXFP4, 38, 0.18}),
    [](const auto& info) { return std::string(kernels::Traits(info.param.type).name); });

TEST(QuantizeModel, DequantisesQuantisedSources) {
  // q4_0 -> f32 must give exactly the q4_0 values; q4_0 -> q8_0 stays close to them.
  const std::string src = MakeQuantSource("chain_src.gguf", 32);
  const std::string q4 = TempPath("chain_q4.gguf"), f32 = TempPath("chain_f32.gguf"),
                    q8 = TempPath("chain_q8.gguf");
  ASSERT_TRUE(QuantizeModel(src, q4, DType::kQ4_0).ok());
  ASSERT_TRUE(QuantizeModel(q4, f32, DType::kF32).ok());
  ASSERT_TRUE(QuantizeModel(q4, q8, DType::kQ8_0).ok());
  auto g4 = GgufFile::Open(q4), g32 = GgufFile::Open(f32), g8 = GgufFile::Open(q8);
  ASSERT_TRUE(g4.ok() && g32.ok() && g8.ok());
  EXPECT_EQ(*(*g32)->GetUInt("general.file_type"), 0u);
  EXPECT_EQ((*g32)->Find("general.quantization_version") != nullptr, true);  // copied
  const TensorInfo* a = (*g4)->FindTensor("blk.0.attn_q.weight");
  const TensorInfo* b = (*g32)->FindTensor("blk.0.attn_q.weight");
  const TensorInfo* c = (*g8)->FindTensor("blk.0.attn_q.weight");
  ASSERT_EQ(a->type, DType::kQ4_0);
  ASSERT_EQ(b->type, DType::kF32);
  ASSERT_EQ(c->type, DType::kQ8_0);
  EXPECT_EQ(AllF32(*a), AllF32(*b));
  const auto va = AllF32(*a), vc = AllF32(*c);
  double err = 0, norm = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    err += (va[i] - vc[i]) * (va[i] - vc[i]);
    norm += va[i] * va[i];
  }
  EXPECT_LT(std::sqrt(err / norm), 1.2e-2);
}

TEST(QuantizeModel, Errors) {
  const std::string out = TempPath("qerr.gguf");
  EXPECT_EQ(QuantizeModel(TempPath("nope.gguf"), out, DType::kQ8_0).code(),
            absl::StatusCode::kNotFound);
  const std::string src = MakeQuantSource("qerr_src.gguf", 32);
  EXPECT_EQ(QuantizeModel(src, out, DType::kQ8_K).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(out));
  EXPECT_EQ(FileTypeFor(DType::kQ4_K), 15u);
  EXPECT_EQ(FileTypeFor(DType::kMXFP4), 38u);
}

}  // namespace
}  // namespace tandem::tools
