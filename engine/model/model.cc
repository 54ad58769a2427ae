#include "engine/model/model.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <cstdlib>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"
#include "tandem/kernels/matmul.h"
#include "tandem/kernels/quant.h"

namespace tandem::engine {
namespace {

absl::StatusOr<int32_t> GetDim(const gguf::GgufFile& f, const std::string& key,
                               std::optional<uint64_t> def = std::nullopt) {
  absl::StatusOr<uint64_t> v = def ? f.GetUIntOr(key, *def) : f.GetUInt(key);
  if (!v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model key ", key, ": ", v.status().message()));
  }
  if (*v == 0 || *v > (1u << 24)) {
    return absl::InvalidArgumentError(absl::StrCat("model key ", key, " out of range: ", *v));
  }
  return static_cast<int32_t>(*v);
}

// Reads a 1-D float tensor (norm weight or bias) of n elements, converting to f32.
absl::StatusOr<std::vector<float>> LoadVector(const gguf::GgufFile& f, const std::string& name,
                                              int64_t n) {
  const gguf::TensorInfo* t = f.FindTensor(name);
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor ", name));
  if (t->NumElements() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, " has ", t->NumElements(), " elements, expected ", n));
  }
  std::vector<float> out(n);
  kernels::DequantizeRow(t->type, t->data, out.data(), n);
  return out;
}

// The MoE keys llama.cpp reads for these architectures. Mixtral (llama) sizes its experts by
// feed_forward_length; qwen2moe and qwen3moe by expert_feed_forward_length, else
// feed_forward_length / expert_used_count; qwen2moe's shared expert by
// expert_shared_feed_forward_length, else feed_forward_length.
absl::Status ReadExperts(const gguf::GgufFile& f, const std::string& p, int64_t n_expert,
                         ModelConfig& c) {
  if (n_expert > 512) {
    return absl::InvalidArgumentError(absl::StrCat(p, "expert_count out of range: ", n_expert));
  }
  c.n_expert = static_cast<int32_t>(n_expert);
  TANDEM_ASSIGN_OR_RETURN(c.n_expert_used, GetDim(f, p + "expert_used_count"));
  if (c.n_expert_used > c.n_expert) {
    return absl::InvalidArgumentError(absl::StrCat(p, "expert_used_count ", c.n_expert_used,
                                                   " exceeds expert_count ", c.n_expert));
  }
  const bool has_ff = f.Find(p + "feed_forward_length") != nullptr;
  if (has_ff) {
    TANDEM_ASSIGN_OR_RETURN(c.n_ff, GetDim(f, p + "feed_forward_length"));
  }
  if (c.arch == Arch::kLlama) {
    if (!has_ff) {
      return absl::InvalidArgumentError(absl::StrCat("missing key ", p, "feed_forward_length"));
    }
    c.n_ff_exp = c.n_ff;
  } else if (f.Find(p + "expert_feed_forward_length") != nullptr) {
    TANDEM_ASSIGN_OR_RETURN(c.n_ff_exp, GetDim(f, p + "expert_feed_forward_length"));
  } else if (has_ff && c.n_ff % c.n_expert_used == 0) {
    c.n_ff_exp = c.n_ff / c.n_expert_used;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(p, "expert_feed_forward_length is missing and feed_forward_length does "
                        "not divide by expert_used_count"));
  }
  if (c.arch == Arch::kQwen2Moe) {
    if (f.Find(p + "expert_shared_feed_forward_length") != nullptr) {
      TANDEM_ASSIGN_OR_RETURN(c.n_ff_shexp, GetDim(f, p + "expert_shared_feed_forward_length"));
    } else if (has_ff) {
      c.n_ff_shexp = c.n_ff;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("missing key ", p, "expert_shared_feed_forward_length"));
    }
  }
  // Mixtral and qwen3moe renormalise the chosen experts' weights; qwen2moe does not; gpt-oss
  // takes a softmax over the chosen logits, which sums to 1 already.
  c.expert_weights_norm = c.arch == Arch::kLlama || c.arch == Arch::kQwen3Moe;
  if (c.arch == Arch::kGptOss) {
    c.expert_gating = ExpertGating::kSoftmaxWeight;
    c.swiglu_oai = true;
  }
  return absl::OkStatus();
}

// YaRN, as llama.cpp's context sets it up: ext_factor 1; the magnitude factor is
// mscale(factor, 1) / mscale(factor, yarn_log_multiplier) when that key is set, else
// mscale(factor, 1), divided by 1 + 0.1 ln(factor) (ggml's rope multiplies that back in), times
// rope.scaling.attn_factor; mscale(s, m) = 1 + 0.1 m ln s for s > 1. The correction dims come
// from the original context (rope.scaling.original_context_length, else context_length).
absl::Status ReadYarn(const gguf::GgufFile& f, const std::string& p, ModelConfig& c) {
  const float factor = 1.0f / c.rope_freq_scale;
  auto mscale = [](float s, float m) { return s <= 1.0f ? 1.0f : 0.1f * m * std::log(s) + 1.0f; };
  TANDEM_ASSIGN_OR_RETURN(double log_mul,
                          f.GetFloatOr(p + "rope.scaling.yarn_log_multiplier", 0.0));
  TANDEM_ASSIGN_OR_RETURN(double attn, f.GetFloatOr(p + "rope.scaling.attn_factor", 1.0));
  float a = log_mul != 0.0 ? mscale(factor, 1.0f) / mscale(factor, static_cast<float>(log_mul))
                           : mscale(factor, 1.0f);
  a *= 1.0f / (1.0f + 0.1f * std::log(factor));
  c.rope_ext_factor = 1.0f;
  c.rope_attn_factor = a * static_cast<float>(attn);
  TANDEM_ASSIGN_OR_RETURN(c.rope_ctx_orig,
                          GetDim(f, p + "rope.scaling.original_context_length", c.n_ctx_train));
  return absl::OkStatus();
}

// Views of the n stacked expert matrices of a 3-D tensor {cols, rows, n}.
absl::StatusOr<std::vector<WeightView>> LoadExperts(const gguf::GgufFile& f,
                                                    const std::string& name, int64_t cols,
                                                    int64_t rows, int64_t n) {
  const gguf::TensorInfo* t = f.FindTensor(name);
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor ", name));
  if (t->dims.size() != 3 || t->dims[0] != cols || t->dims[1] != rows || t->dims[2] != n) {
    std::string dims;
    for (int64_t d : t->dims) absl::StrAppend(&dims, dims.empty() ? "" : "x", d);
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has shape ", dims,
                                                   ", expected ", cols, "x", rows, "x", n));
  }
  if (!IsWeightType(t->type)) {
    return absl::UnimplementedError(absl::StrCat("tensor ", name, " has type ",
                                                 std::string(kernels::Traits(t->type).name),
                                                 ", which tandem cannot use as a weight"));
  }
  const uint64_t slab = kernels::RowBytes(t->type, cols) * static_cast<uint64_t>(rows);
  std::vector<WeightView> out;
  for (int64_t e = 0; e < n; ++e) {
    out.push_back(WeightView{t->type, t->data + e * slab, rows, cols});
  }
  return out;
}

}  // namespace

double ModelConfig::ffn_params_per_token() const {
  const double d = n_embd;
  if (!is_moe()) return 3 * d * n_ff;
  return d * n_expert + 3 * d * n_ff_exp * n_expert_used +
         (n_ff_shexp > 0 ? 3 * d * n_ff_shexp + d : 0);
}

bool IsWeightType(kernels::DType t) {
  switch (t) {
    case kernels::DType::kF32:
    case kernels::DType::kF16:
    case kernels::DType::kBF16:
    case kernels::DType::kQ8_0:
    case kernels::DType::kQ4_0:
    case kernels::DType::kQ4_K:
    case kernels::DType::kQ6_K:
    case kernels::DType::kMXFP4:
      return true;
    default:
      return false;
  }
}

namespace {

absl::StatusOr<WeightView> LoadMatrix(const gguf::GgufFile& f, const std::string& name,
                                      int64_t cols, int64_t rows) {
  const gguf::TensorInfo* t = f.FindTensor(name);
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor ", name));
  if (t->dims.size() != 2 || t->dims[0] != cols || t->dims[1] != rows) {
    std::string dims;
    for (int64_t d : t->dims) absl::StrAppend(&dims, dims.empty() ? "" : "x", d);
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has shape ", dims,
                                                   ", expected ", cols, "x", rows));
  }
  if (!IsWeightType(t->type)) {
    return absl::UnimplementedError(absl::StrCat("tensor ", name, " has type ",
                                                 std::string(kernels::Traits(t->type).name),
                                                 ", which tandem cannot use as a weight"));
  }
  return WeightView{t->type, t->data, rows, cols};
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::FromGguf(const gguf::GgufFile& f) {
  ModelConfig c;
  TANDEM_ASSIGN_OR_RETURN(std::string_view arch, f.GetString("general.architecture"));
  c.arch_name = std::string(arch);
  if (arch == "llama") {
    c.arch = Arch::kLlama;
    c.rope_mode = kernels::RopeMode::kNormal;
  } else if (arch == "qwen2") {
    c.arch = Arch::kQwen2;
    c.rope_mode = kernels::RopeMode::kNeox;
    c.qkv_bias = true;
  } else if (arch == "qwen3") {
    c.arch = Arch::kQwen3;
    c.rope_mode = kernels::RopeMode::kNeox;
    c.qk_norm = true;
  } else if (arch == "qwen2moe") {
    c.arch = Arch::kQwen2Moe;
    c.rope_mode = kernels::RopeMode::kNeox;
  } else if (arch == "qwen3moe") {
    c.arch = Arch::kQwen3Moe;
    c.rope_mode = kernels::RopeMode::kNeox;
    c.qk_norm = true;
  } else if (arch == "gpt-oss") {
    c.arch = Arch::kGptOss;
    c.rope_mode = kernels::RopeMode::kNeox;
    c.attn_sinks = true;
  } else {
    return absl::UnimplementedError(
        absl::StrCat("model architecture '", std::string(arch),
                     "' is not supported (llama, qwen2, qwen3, qwen2moe, qwen3moe, gpt-oss)"));
  }
  TANDEM_ASSIGN_OR_RETURN(std::string_view name, f.GetStringOr("general.name", ""));
  c.name = std::string(name);
  const std::string p = c.arch_name + ".";
  TANDEM_ASSIGN_OR_RETURN(c.n_embd, GetDim(f, p + "embedding_length"));
  TANDEM_ASSIGN_OR_RETURN(c.n_layer, GetDim(f, p + "block_count"));
  TANDEM_ASSIGN_OR_RETURN(c.n_head, GetDim(f, p + "attention.head_count"));
  TANDEM_ASSIGN_OR_RETURN(c.n_head_kv, GetDim(f, p + "attention.head_count_kv", c.n_head));
  TANDEM_ASSIGN_OR_RETURN(uint64_t n_expert, f.GetUIntOr(p + "expert_count", 0));
  const bool moe_arch =
      c.arch == Arch::kQwen2Moe || c.arch == Arch::kQwen3Moe || c.arch == Arch::kGptOss;
  if (moe_arch && n_expert == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(p, "expert_count must be > 0 for ", c.arch_name));
  }
  if (n_expert > 0 && c.arch != Arch::kLlama && !moe_arch) {
    return absl::UnimplementedError(
        absl::StrCat("experts in a ", c.arch_name, " model are not supported"));
  }
  if (n_expert > 0) TANDEM_RETURN_IF_ERROR(ReadExperts(f, p, static_cast<int64_t>(n_expert), c));
  if (!moe_arch) {
    TANDEM_ASSIGN_OR_RETURN(c.n_ff, GetDim(f, p + "feed_forward_length"));
  }
  TANDEM_ASSIGN_OR_RETURN(c.n_ctx_train, GetDim(f, p + "context_length", 2048));
  if (c.n_embd % c.n_head != 0) {
    return absl::InvalidArgumentError(absl::StrCat("embedding_length ", c.n_embd,
                                                   " is not a multiple of head_count ", c.n_head));
  }
  TANDEM_ASSIGN_OR_RETURN(c.head_dim, GetDim(f, p + "attention.key_length", c.n_embd / c.n_head));
  TANDEM_ASSIGN_OR_RETURN(int32_t vdim, GetDim(f, p + "attention.value_length", c.head_dim));
  if (vdim != c.head_dim) {
    return absl::UnimplementedError("attention.value_length different from key_length");
  }
  if (c.n_head % c.n_head_kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("head_count ", c.n_head,
                                                   " is not a multiple of head_count_kv ",
                                                   c.n_head_kv));
  }
  TANDEM_ASSIGN_OR_RETURN(c.n_rot, GetDim(f, p + "rope.dimension_count", c.head_dim));
  if (c.n_rot > c.head_dim || c.n_rot % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("rope.dimension_count ", c.n_rot,
                                                   " must be even and <= head dim ", c.head_dim));
  }
  TANDEM_ASSIGN_OR_RETURN(double eps, f.GetFloatOr(p + "attention.layer_norm_rms_epsilon", 1e-5));
  TANDEM_ASSIGN_OR_RETURN(double base, f.GetFloatOr(p + "rope.freq_base", 10000.0));
  if (!(eps > 0) || !(base > 0)) {
    return absl::InvalidArgumentError("rms epsilon and rope.freq_base must be positive");
  }
  c.norm_eps = static_cast<float>(eps);
  c.rope_base = static_cast<float>(base);
  TANDEM_ASSIGN_OR_RETURN(double base_swa, f.GetFloatOr(p + "rope.freq_base_swa", base));
  if (!(base_swa > 0)) return absl::InvalidArgumentError("rope.freq_base_swa must be positive");
  c.rope_base_swa = static_cast<float>(base_swa);
  TANDEM_ASSIGN_OR_RETURN(std::string_view scaling, f.GetStringOr(p + "rope.scaling.type", "none"));
  if (scaling == "linear" || scaling == "yarn") {
    TANDEM_ASSIGN_OR_RETURN(double factor, f.GetFloatOr(p + "rope.scaling.factor", 1.0));
    if (!(factor > 0)) return absl::InvalidArgumentError("rope.scaling.factor must be positive");
    c.rope_freq_scale = static_cast<float>(1.0 / factor);
  } else if (scaling != "none" && scaling != "llama3") {
    return absl::UnimplementedError(absl::StrCat("rope scaling '", std::string(scaling), "' is not supported"));
  }
  if (scaling == "yarn") TANDEM_RETURN_IF_ERROR(ReadYarn(f, p, c));
  if (c.arch == Arch::kGptOss) {
    TANDEM_ASSIGN_OR_RETURN(c.n_swa, GetDim(f, p + "attention.sliding_window"));
    TANDEM_ASSIGN_OR_RETURN(c.swa_period, GetDim(f, p + "attention.sliding_window_pattern", 2));
  }
  return c;
}

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& path,
                                                   const ModelLoadOptions& options) {
  std::unique_ptr<Model> m(new Model());
  TANDEM_ASSIGN_OR_RETURN(m->file_, gguf::GgufFile::Open(path));
  TANDEM_ASSIGN_OR_RETURN(m->config_, ModelConfig::FromGguf(*m->file_));
  TANDEM_ASSIGN_OR_RETURN(m->tokenizer_, Tokenizer::FromGguf(*m->file_));
  TANDEM_RETURN_IF_ERROR(m->Bind());
  m->holds_expert_ = options.holds_expert;
  m->experts_only_ = options.experts_only;
  if (!m->holds_expert_) m->file_->Prefault();
  if (options.matrix_type) TANDEM_RETURN_IF_ERROR(m->ConvertMatrices(*options.matrix_type));
  if (options.pack_weights) m->PackWeights();
  return m;
}

void Model::FreeDeleter::operator()(uint8_t* p) const { std::free(p); }

std::vector<WeightView*> Model::MatrixViews(bool with_router) {
  std::vector<WeightView*> views;
  if (!experts_only_) views.push_back(&output_);
  for (int32_t i = 0; i < static_cast<int32_t>(layers_.size()); ++i) {
    LayerWeights& l = layers_[i];
    if (!experts_only_) {
      for (WeightView* v : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down,
                            &l.sh_gate, &l.sh_up, &l.sh_down}) {
        if (v->data != nullptr) views.push_back(v);
      }
      if (with_router && l.ffn_gate_inp.data != nullptr) views.push_back(&l.ffn_gate_inp);
    }
    for (std::vector<WeightView>* experts : {&l.exp_gate, &l.exp_up, &l.exp_down}) {
      for (int32_t e = 0; e < static_cast<int32_t>(experts->size()); ++e) {
        if (!holds_expert_ || holds_expert_(i, e)) views.push_back(&(*experts)[e]);
      }
    }
  }
  return views;
}

namespace {

// Runs work(i) for i in [0, n) on every core, each thread taking the next index.
void ForEachOnAllCores(size_t n, const std::function<void(size_t)>& work) {
  std::atomic<size_t> next{0};
  auto loop = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) work(i);
  };
  std::vector<std::thread> threads;
  const unsigned n_threads = std::max(1u, std::thread::hardware_concurrency());
  for (unsigned t = 1; t < n_threads; ++t) threads.emplace_back(loop);
  loop();
  for (std::thread& t : threads) t.join();
}

}  // namespace

absl::Status Model::ConvertMatrices(kernels::DType type) {
  if (!IsWeightType(type)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot convert weights to ", std::string(kernels::Traits(type).name), " (", kWeightTypes,
        ")"));
  }
  std::vector<WeightView*> views;
  std::vector<size_t> offsets;
  size_t total = 0;
  for (WeightView* v : MatrixViews()) {
    if (v->type == type || v->cols % kernels::Traits(type).block_elems != 0) continue;
    views.push_back(v);
    offsets.push_back(total);
    total += kernels::RowBytes(type, v->cols) * static_cast<size_t>(v->rows);
  }
  if (views.empty()) return absl::OkStatus();
  converted_.reset(static_cast<uint8_t*>(std::malloc(total)));
  if (converted_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", total,
                                                     " bytes for the converted weights"));
  }
  // One task per block of rows, so the work spreads even over few large matrices.
  constexpr int64_t kRows = 256;
  std::vector<std::pair<size_t, int64_t>> tasks;
  for (size_t i = 0; i < views.size(); ++i) {
    for (int64_t r = 0; r < views[i]->rows; r += kRows) tasks.emplace_back(i, r);
  }
  std::atomic<bool> failed{false};
  ForEachOnAllCores(tasks.size(), [&](size_t t) {
    const auto [i, r0] = tasks[t];
    const WeightView& v = *views[i];
    const uint64_t src_row = kernels::RowBytes(v.type, v.cols);
    const uint64_t dst_row = kernels::RowBytes(type, v.cols);
    std::vector<float> row(v.cols);
    for (int64_t r = r0; r < std::min(v.rows, r0 + kRows); ++r) {
      kernels::DequantizeRow(v.type, static_cast<const uint8_t*>(v.data) + r * src_row, row.data(),
                             v.cols);
      if (!kernels::QuantizeRow(type, row.data(), converted_.get() + offsets[i] + r * dst_row,
                                v.cols)
               .ok()) {
        failed = true;
      }
    }
  });
  if (failed) return absl::InternalError("weight conversion failed");
  for (size_t i = 0; i < views.size(); ++i) {
    WeightView& v = *views[i];
    if (v.data != token_embd_.data) {
      file_->Release(v.data, kernels::RowBytes(v.type, v.cols) * static_cast<uint64_t>(v.rows));
    }
    v.data = converted_.get() + offsets[i];
    v.type = type;
  }
  return absl::OkStatus();
}

void Model::PackWeights() {
  std::vector<WeightView*> views = MatrixViews(/*with_router=*/true);
  constexpr size_t kHugePage = size_t{2} << 20;
  size_t total = 0;
  std::vector<size_t> sizes;
  for (const WeightView* v : views) {
    sizes.push_back(kernels::PackedWeightBytes(v->type, v->rows, v->cols));
    total += sizes.back();
  }
  if (total == 0) return;
  total = (total + kHugePage - 1) / kHugePage * kHugePage;
  auto* buffer = static_cast<uint8_t*>(std::aligned_alloc(kHugePage, total));
  if (buffer == nullptr) return;  // keep the mapped rows: slower, still correct
  // Best effort: without transparent huge pages the buffer is just slower to walk.
  (void)::madvise(buffer, total, MADV_HUGEPAGE);
  packed_.reset(buffer);
  std::vector<size_t> offsets(views.size());
  for (size_t i = 1; i < views.size(); ++i) offsets[i] = offsets[i - 1] + sizes[i - 1];
  // Matrices are packed by every core (about a second for a 1B model on one), each thread
  // taking the next matrix.
  ForEachOnAllCores(views.size(), [&](size_t i) {
    const WeightView& v = *views[i];
    if (sizes[i] != 0) kernels::PackWeights(v.type, v.data, v.rows, v.cols, buffer + offsets[i]);
  });
  bool all_packed = true;
  for (size_t i = 0; i < views.size(); ++i) {
    WeightView& v = *views[i];
    if (sizes[i] == 0) {
      all_packed = false;
      continue;
    }
    // The mapped rows are not read again unless the embedding table shares them (tied output).
    if (v.data != token_embd_.data) {
      file_->Release(v.data, kernels::RowBytes(v.type, v.cols) * static_cast<uint64_t>(v.rows));
    }
    v.data = buffer + offsets[i];
    v.packed = true;
  }
  if (all_packed) converted_.reset();
}

absl::Status Model::Bind() {
  const gguf::GgufFile& f = *file_;
  ModelConfig& c = config_;
  const gguf::TensorInfo* emb = f.FindTensor("token_embd.weight");
  if (emb == nullptr) return absl::InvalidArgumentError("missing tensor token_embd.weight");
  if (emb->dims.size() != 2) return absl::InvalidArgumentError("token_embd.weight must be 2-D");
  c.n_vocab = static_cast<int32_t>(emb->dims[1]);
  if (c.n_vocab != tokenizer_->vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat("token_embd.weight has ", c.n_vocab,
                                                   " rows but the tokenizer has ",
                                                   tokenizer_->vocab_size(), " tokens"));
  }
  TANDEM_ASSIGN_OR_RETURN(token_embd_, LoadMatrix(f, "token_embd.weight", c.n_embd, c.n_vocab));
  if (f.FindTensor("output.weight") != nullptr) {
    TANDEM_ASSIGN_OR_RETURN(output_, LoadMatrix(f, "output.weight", c.n_embd, c.n_vocab));
  } else {
    output_ = token_embd_;  // tied embeddings
  }
  TANDEM_ASSIGN_OR_RETURN(output_norm_, LoadVector(f, "output_norm.weight", c.n_embd));
  if (f.FindTensor("rope_freqs.weight") != nullptr) {
    TANDEM_ASSIGN_OR_RETURN(rope_freqs_, LoadVector(f, "rope_freqs.weight", c.n_rot / 2));
  }
  const int64_t q_dim = int64_t{c.n_head} * c.head_dim;
  const int64_t kv_dim = int64_t{c.n_head_kv} * c.head_dim;
  layers_.resize(c.n_layer);
  for (int32_t i = 0; i < c.n_layer; ++i) {
    LayerWeights& l = layers_[i];
    const std::string b = absl::StrCat("blk.", i, ".");
    TANDEM_ASSIGN_OR_RETURN(l.attn_norm, LoadVector(f, b + "attn_norm.weight", c.n_embd));
    // gpt-oss names its FFN's input norm post_attention_norm.
    const std::string ffn_norm =
        c.arch == Arch::kGptOss ? "post_attention_norm.weight" : "ffn_norm.weight";
    TANDEM_ASSIGN_OR_RETURN(l.ffn_norm, LoadVector(f, b + ffn_norm, c.n_embd));
    TANDEM_ASSIGN_OR_RETURN(l.wq, LoadMatrix(f, b + "attn_q.weight", c.n_embd, q_dim));
    TANDEM_ASSIGN_OR_RETURN(l.wk, LoadMatrix(f, b + "attn_k.weight", c.n_embd, kv_dim));
    TANDEM_ASSIGN_OR_RETURN(l.wv, LoadMatrix(f, b + "attn_v.weight", c.n_embd, kv_dim));
    TANDEM_ASSIGN_OR_RETURN(l.wo, LoadMatrix(f, b + "attn_output.weight", q_dim, c.n_embd));
    if (!c.is_moe()) {
      TANDEM_ASSIGN_OR_RETURN(l.w_gate, LoadMatrix(f, b + "ffn_gate.weight", c.n_embd, c.n_ff));
      TANDEM_ASSIGN_OR_RETURN(l.w_up, LoadMatrix(f, b + "ffn_up.weight", c.n_embd, c.n_ff));
      TANDEM_ASSIGN_OR_RETURN(l.w_down, LoadMatrix(f, b + "ffn_down.weight", c.n_ff, c.n_embd));
    } else {
      const int64_t ne = c.n_expert, ff = c.n_ff_exp;
      TANDEM_ASSIGN_OR_RETURN(l.ffn_gate_inp,
                              LoadMatrix(f, b + "ffn_gate_inp.weight", c.n_embd, ne));
      TANDEM_ASSIGN_OR_RETURN(l.exp_gate,
                              LoadExperts(f, b + "ffn_gate_exps.weight", c.n_embd, ff, ne));
      TANDEM_ASSIGN_OR_RETURN(l.exp_up, LoadExperts(f, b + "ffn_up_exps.weight", c.n_embd, ff, ne));
      TANDEM_ASSIGN_OR_RETURN(l.exp_down,
                              LoadExperts(f, b + "ffn_down_exps.weight", ff, c.n_embd, ne));
      if (c.arch == Arch::kGptOss) {
        TANDEM_ASSIGN_OR_RETURN(l.gate_inp_b, LoadVector(f, b + "ffn_gate_inp.bias", ne));
        TANDEM_ASSIGN_OR_RETURN(l.exp_gate_b, LoadVector(f, b + "ffn_gate_exps.bias", ff * ne));
        TANDEM_ASSIGN_OR_RETURN(l.exp_up_b, LoadVector(f, b + "ffn_up_exps.bias", ff * ne));
        TANDEM_ASSIGN_OR_RETURN(l.exp_down_b,
                                LoadVector(f, b + "ffn_down_exps.bias", c.n_embd * ne));
      }
      if (c.n_ff_shexp > 0) {
        const int64_t sff = c.n_ff_shexp;
        TANDEM_ASSIGN_OR_RETURN(l.sh_gate_inp,
                                LoadVector(f, b + "ffn_gate_inp_shexp.weight", c.n_embd));
        TANDEM_ASSIGN_OR_RETURN(l.sh_gate,
                                LoadMatrix(f, b + "ffn_gate_shexp.weight", c.n_embd, sff));
        TANDEM_ASSIGN_OR_RETURN(l.sh_up, LoadMatrix(f, b + "ffn_up_shexp.weight", c.n_embd, sff));
        TANDEM_ASSIGN_OR_RETURN(l.sh_down,
                                LoadMatrix(f, b + "ffn_down_shexp.weight", sff, c.n_embd));
      }
    }
    // Biases: required for qwen2, loaded when present otherwise (as llama.cpp does).
    const bool biases = c.qkv_bias || f.FindTensor(b + "attn_q.bias") != nullptr;
    if (biases) {
      TANDEM_ASSIGN_OR_RETURN(l.bq, LoadVector(f, b + "attn_q.bias", q_dim));
      TANDEM_ASSIGN_OR_RETURN(l.bk, LoadVector(f, b + "attn_k.bias", kv_dim));
      TANDEM_ASSIGN_OR_RETURN(l.bv, LoadVector(f, b + "attn_v.bias", kv_dim));
    }
    if (c.arch == Arch::kGptOss) {
      TANDEM_ASSIGN_OR_RETURN(l.bo, LoadVector(f, b + "attn_output.bias", c.n_embd));
      TANDEM_ASSIGN_OR_RETURN(l.sinks, LoadVector(f, b + "attn_sinks.weight", c.n_head));
    }
    if (c.qk_norm) {
      TANDEM_ASSIGN_OR_RETURN(l.q_norm, LoadVector(f, b + "attn_q_norm.weight", c.head_dim));
      TANDEM_ASSIGN_OR_RETURN(l.k_norm, LoadVector(f, b + "attn_k_norm.weight", c.head_dim));
    }
  }
  return absl::OkStatus();
}

uint64_t Model::weight_bytes_per_token() const {
  auto bytes = [](const WeightView& w) {
    return kernels::RowBytes(w.type, w.cols) * static_cast<uint64_t>(w.rows);
  };
  uint64_t total = bytes(output_);
  for (const LayerWeights& l : layers_) {
    total += bytes(l.wq) + bytes(l.wk) + bytes(l.wv) + bytes(l.wo) + bytes(l.w_gate) +
             bytes(l.w_up) + bytes(l.w_down) + bytes(l.ffn_gate_inp) + bytes(l.sh_gate) +
             bytes(l.sh_up) + bytes(l.sh_down);
    if (!l.exp_gate.empty()) {
      const uint64_t expert = bytes(l.exp_gate[0]) + bytes(l.exp_up[0]) + bytes(l.exp_down[0]);
      total += expert * static_cast<uint64_t>(config_.n_expert_used);
    }
  }
  return total;
}

}  // namespace tandem::engine
