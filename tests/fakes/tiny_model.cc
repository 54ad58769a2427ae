#include "tests/fakes/tiny_model.h"

#include <cmath>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/gguf/gguf.h"
#include "tandem/kernels/quant.h"

namespace tandem::testing {
namespace {

class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double Uniform() { return (Next() >> 11) * (1.0 / 9007199254740992.0); }
  double Normal() {
    const double u1 = Uniform() + 1e-300, u2 = Uniform();
    return std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2);
  }

 private:
  uint64_t s_;
};

absl::Status AddMatrix(gguf::GgufWriter& w, Rng& rng, const std::string& name, int64_t cols,
                       int64_t rows, kernels::DType type, double stddev) {
  std::vector<float> row(cols);
  std::vector<uint8_t> bytes(kernels::RowBytes(type, cols) * rows);
  const size_t rb = kernels::RowBytes(type, cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (auto& x : row) x = static_cast<float>(rng.Normal() * stddev);
    absl::Status st = kernels::QuantizeRow(type, row.data(), bytes.data() + r * rb, cols);
    if (!st.ok()) return st;
  }
  return w.AddTensor(name, {cols, rows}, type, bytes);
}

// n stacked random matrices of cols x rows: a 3-D expert tensor {cols, rows, n}.
absl::Status AddExperts(gguf::GgufWriter& w, Rng& rng, const std::string& name, int64_t cols,
                        int64_t rows, int64_t n, kernels::DType type, double stddev) {
  std::vector<float> row(cols);
  const size_t rb = kernels::RowBytes(type, cols);
  std::vector<uint8_t> bytes(rb * rows * n);
  for (int64_t r = 0; r < rows * n; ++r) {
    for (auto& x : row) x = static_cast<float>(rng.Normal() * stddev);
    absl::Status st = kernels::QuantizeRow(type, row.data(), bytes.data() + r * rb, cols);
    if (!st.ok()) return st;
  }
  return w.AddTensor(name, {cols, rows, n}, type, bytes);
}

absl::Status AddVector(gguf::GgufWriter& w, Rng& rng, const std::string& name, int64_t n,
                       double mean, double stddev) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(mean + rng.Normal() * stddev);
  return w.AddTensor(name, {n}, kernels::DType::kF32,
                     {reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4});
}

}  // namespace

absl::Status WriteTinyModel(const TinyModelOptions& o, const std::string& path) {
  gguf::GgufWriter w;
  const std::string a = o.arch == "mixtral" ? "llama" : o.arch;
  const bool gpt_oss = o.arch == "gpt-oss";
  const bool moe = o.arch == "mixtral" || o.arch == "qwen2moe" || o.arch == "qwen3moe" || gpt_oss;
  const bool qk_norm = o.arch == "qwen3" || o.arch == "qwen3moe";
  const bool biases = o.arch == "qwen2" || o.arch == "qwen2moe" || gpt_oss;
  w.SetString("general.architecture", a);
  w.SetString("general.name", "tiny random test model");
  w.SetU32(a + ".context_length", o.n_ctx);
  w.SetU32(a + ".embedding_length", o.n_embd);
  w.SetU32(a + ".block_count", o.n_layer);
  w.SetU32(a + ".feed_forward_length", o.n_ff);
  if (moe) {
    w.SetU32(a + ".expert_count", o.n_expert);
    w.SetU32(a + ".expert_used_count", o.n_expert_used);
    if (a != "llama") w.SetU32(a + ".expert_feed_forward_length", o.n_ff);
    if (a == "qwen2moe") w.SetU32(a + ".expert_shared_feed_forward_length", 2 * o.n_ff);
  }
  if (gpt_oss) {
    // A window shorter than the tests' prompts, and YaRN over a short original context, so
    // both change the output.
    w.SetU32(a + ".attention.sliding_window", 6);
    w.SetString(a + ".rope.scaling.type", "yarn");
    w.SetF32(a + ".rope.scaling.factor", 4.0f);
    w.SetU32(a + ".rope.scaling.original_context_length", 64);
  }
  w.SetU32(a + ".attention.head_count", o.n_head);
  w.SetU32(a + ".attention.head_count_kv", o.n_head_kv);
  w.SetU32(a + ".rope.dimension_count", o.n_embd / o.n_head);
  w.SetF32(a + ".attention.layer_norm_rms_epsilon", 1e-5f);
  w.SetF32(a + ".rope.freq_base", 10000.0f);

  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<float> scores = {0, 0, 0};
  std::vector<int32_t> types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(absl::StrFormat("<0x%02X>", b));
    scores.push_back(0);
    types.push_back(6);
  }
  const char* words[] = {"\xe2\x96\x81", "e", "t", "a", "o", "\xe2\x96\x81" "t", "he",
                         "\xe2\x96\x81" "the", "in", "\xe2\x96\x81" "a", "an", "on", "er"};
  float score = -1;
  for (const char* wd : words) {
    tokens.push_back(wd);
    scores.push_back(score);
    score -= 1;
    types.push_back(1);
  }
  const int64_t vocab = static_cast<int64_t>(tokens.size());
  w.SetString("tokenizer.ggml.model", "llama");
  w.SetStringArray("tokenizer.ggml.tokens", tokens);
  w.SetF32Array("tokenizer.ggml.scores", scores);
  w.SetI32Array("tokenizer.ggml.token_type", types);
  w.SetU32("tokenizer.ggml.bos_token_id", 1);
  w.SetU32("tokenizer.ggml.eos_token_id", 2);
  w.SetU32("tokenizer.ggml.unknown_token_id", 0);
  w.SetBool("tokenizer.ggml.add_bos_token", true);

  Rng rng(o.seed);
  const int64_t d = o.n_embd, hd = o.n_embd / o.n_head;
  const int64_t qd = o.n_head * hd, kvd = o.n_head_kv * hd;
  const double s_in = 1.0 / std::sqrt(static_cast<double>(d));
  absl::Status st = AddMatrix(w, rng, "token_embd.weight", d, vocab, o.type, 1.0);
  if (st.ok()) st = AddVector(w, rng, "output_norm.weight", d, 1.0, 0.1);
  if (st.ok() && !o.tied_output) st = AddMatrix(w, rng, "output.weight", d, vocab, o.type, s_in * 4);
  for (int32_t l = 0; l < o.n_layer && st.ok(); ++l) {
    const std::string b = absl::StrCat("blk.", l, ".");
    st = AddVector(w, rng, b + "attn_norm.weight", d, 1.0, 0.1);
    if (st.ok()) {
      const char* ffn_norm = gpt_oss ? "post_attention_norm.weight" : "ffn_norm.weight";
      st = AddVector(w, rng, b + ffn_norm, d, 1.0, 0.1);
    }
    if (st.ok()) st = AddMatrix(w, rng, b + "attn_q.weight", d, qd, o.type, s_in * 2);
    if (st.ok()) st = AddMatrix(w, rng, b + "attn_k.weight", d, kvd, o.type, s_in * 2);
    if (st.ok()) st = AddMatrix(w, rng, b + "attn_v.weight", d, kvd, o.type, s_in);
    if (st.ok()) st = AddMatrix(w, rng, b + "attn_output.weight", qd, d, o.type, s_in);
    const double s_ff = 1.0 / std::sqrt(static_cast<double>(o.n_ff));
    if (!moe) {
      if (st.ok()) st = AddMatrix(w, rng, b + "ffn_gate.weight", d, o.n_ff, o.type, s_in);
      if (st.ok()) st = AddMatrix(w, rng, b + "ffn_up.weight", d, o.n_ff, o.type, s_in);
      if (st.ok()) st = AddMatrix(w, rng, b + "ffn_down.weight", o.n_ff, d, o.type, s_ff);
    } else {
      // The router in F32 (as converters write it); logits of a few units, so routing is
      // decisive but not one-hot.
      const int64_t ne = o.n_expert;
      if (st.ok()) {
        st = AddMatrix(w, rng, b + "ffn_gate_inp.weight", d, ne, kernels::DType::kF32, s_in * 2);
      }
      if (st.ok()) st = AddExperts(w, rng, b + "ffn_gate_exps.weight", d, o.n_ff, ne, o.type, s_in);
      if (st.ok()) st = AddExperts(w, rng, b + "ffn_up_exps.weight", d, o.n_ff, ne, o.type, s_in);
      if (st.ok()) st = AddExperts(w, rng, b + "ffn_down_exps.weight", o.n_ff, d, ne, o.type, s_ff);
      if (st.ok() && gpt_oss) {
        st = AddVector(w, rng, b + "ffn_gate_inp.bias", ne, 0.0, 0.5);
        std::vector<float> bias(size_t(o.n_ff) * ne);
        for (const char* name : {"ffn_gate_exps.bias", "ffn_up_exps.bias"}) {
          for (float& x : bias) x = static_cast<float>(rng.Normal() * 0.3);
          if (st.ok()) {
            st = w.AddTensor(b + name, {o.n_ff, ne}, kernels::DType::kF32,
                             {reinterpret_cast<const uint8_t*>(bias.data()), bias.size() * 4});
          }
        }
        std::vector<float> down(size_t(d) * ne);
        for (float& x : down) x = static_cast<float>(rng.Normal() * 0.1);
        if (st.ok()) {
          st = w.AddTensor(b + "ffn_down_exps.bias", {d, ne}, kernels::DType::kF32,
                           {reinterpret_cast<const uint8_t*>(down.data()), down.size() * 4});
        }
        if (st.ok()) st = AddVector(w, rng, b + "attn_output.bias", d, 0.0, 0.1);
        if (st.ok()) st = AddVector(w, rng, b + "attn_sinks.weight", o.n_head, 0.0, 1.0);
      }
      if (st.ok() && a == "qwen2moe") {
        const int64_t sff = 2 * o.n_ff;
        st = AddVector(w, rng, b + "ffn_gate_inp_shexp.weight", d, 0.0, s_in * 2);
        if (st.ok()) st = AddMatrix(w, rng, b + "ffn_gate_shexp.weight", d, sff, o.type, s_in);
        if (st.ok()) st = AddMatrix(w, rng, b + "ffn_up_shexp.weight", d, sff, o.type, s_in);
        if (st.ok()) {
          st = AddMatrix(w, rng, b + "ffn_down_shexp.weight", sff, d, o.type,
                         1.0 / std::sqrt(static_cast<double>(sff)));
        }
      }
    }
    if (st.ok() && qk_norm) {
      st = AddVector(w, rng, b + "attn_q_norm.weight", hd, 1.0, 0.1);
      if (st.ok()) st = AddVector(w, rng, b + "attn_k_norm.weight", hd, 1.0, 0.1);
    }
    if (st.ok() && biases) {
      st = AddVector(w, rng, b + "attn_q.bias", qd, 0.0, 0.1);
      if (st.ok()) st = AddVector(w, rng, b + "attn_k.bias", kvd, 0.0, 0.1);
      if (st.ok()) st = AddVector(w, rng, b + "attn_v.bias", kvd, 0.0, 0.1);
    }
  }
  if (!st.ok()) return st;
  return w.Write(path);
}

std::vector<int32_t> RandomTokens(int n, int32_t vocab, uint32_t seed) {
  std::vector<int32_t> t(n);
  for (auto& x : t) {
    seed = seed * 1664525u + 1013904223u;
    x = 3 + static_cast<int32_t>((seed >> 8) % static_cast<uint32_t>(vocab - 3));
  }
  return t;
}

}  // namespace tandem::testing
