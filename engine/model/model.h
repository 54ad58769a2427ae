// A loaded model: hyperparameters from GGUF keys, weight views into the memory-mapped file,
// and the tokenizer. Supported architectures: llama (Llama 2/3, TinyLlama, SmolLM, Mistral, and
// Mixtral: llama with expert tensors), qwen2 (llama plus q/k/v biases and neox rope), qwen3
// (neox rope, per-head q/k norms), qwen2moe (qwen2 with routed experts plus a gated shared
// expert), qwen3moe (qwen3 with routed experts) and gpt-oss (routed experts with biases and a
// clamped SwiGLU, attention sinks, a sliding window on alternate layers, YaRN rope).
//
// Load validates every tensor the forward pass will touch (presence, type, shape), so a bad
// file fails here with a message naming the tensor, never mid-generation. After Load the Model
// is immutable and shared by engines on any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/gguf/gguf.h"
#include "engine/tokenizer/tokenizer.h"
#include "tandem/kernels/dtype.h"
#include "tandem/kernels/rope.h"

namespace tandem::engine {

enum class Arch { kLlama, kQwen2, kQwen3, kQwen2Moe, kQwen3Moe, kGptOss };

// How a token's router logits become its experts and their weights.
enum class ExpertGating {
  kSoftmax,        // softmax over all experts, then the top k (their probabilities as weights)
  kSoftmaxWeight,  // the top k logits, then a softmax over those k (gpt-oss)
};

struct ModelConfig {
  Arch arch = Arch::kLlama;
  std::string arch_name;
  std::string name;
  int32_t n_embd = 0;
  int32_t n_layer = 0;
  int32_t n_head = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;
  int32_t n_ff = 0;
  int32_t n_vocab = 0;
  int32_t n_ctx_train = 0;
  int32_t n_rot = 0;
  float norm_eps = 1e-5f;
  float rope_base = 10000.0f;
  float rope_freq_scale = 1.0f;
  float rope_base_swa = 10000.0f;  // sliding-window layers' base (rope.freq_base_swa)
  // YaRN (rope.scaling.type yarn): ext_factor 1, the magnitude factor, and the original
  // context the correction dims are computed over (kernels::RopeParams).
  float rope_ext_factor = 0.0f;
  float rope_attn_factor = 1.0f;
  int32_t rope_ctx_orig = 0;
  kernels::RopeMode rope_mode = kernels::RopeMode::kNormal;
  bool qkv_bias = false;  // q/k/v biases required (qwen2); other archs load them if present
  bool qk_norm = false;   // per-head RMSNorm of q and k before rope (qwen3, qwen3moe)

  // Mixture of experts (n_expert > 0): each token's FFN is the weighted sum of the
  // n_expert_used experts its router scores highest (softmax over all experts' logits; the
  // chosen weights renormalised to sum 1 when expert_weights_norm), plus, with a shared
  // expert, one dense FFN scaled by sigmoid(ffn_gate_inp_shexp . x).
  int32_t n_expert = 0;
  int32_t n_expert_used = 0;
  int32_t n_ff_exp = 0;    // rows of each expert's gate/up matrices
  int32_t n_ff_shexp = 0;  // the shared expert's, 0 without one
  bool expert_weights_norm = false;
  ExpertGating expert_gating = ExpertGating::kSoftmax;
  // gpt-oss's expert activation: x = min(gate, 7), y = clamp(up, -7, 7),
  // out = x * sigmoid(1.702 x) * (y + 1); otherwise SwiGLU.
  bool swiglu_oai = false;

  // Sliding-window attention (n_swa > 0): layer l attends to its last n_swa positions when
  // l % swa_period < swa_period - 1 (gpt-oss: every even layer), to the whole prefix otherwise.
  int32_t n_swa = 0;
  int32_t swa_period = 0;
  bool attn_sinks = false;  // one extra softmax logit per head (attn_sinks.weight)

  bool is_moe() const { return n_expert > 0; }
  bool is_swa_layer(int32_t l) const {
    return n_swa > 0 && (swa_period == 0 || l % swa_period < swa_period - 1);
  }
  // Weight elements of one layer's FFN that one token multiplies by (its router, its chosen
  // experts and the shared expert, or the dense FFN).
  double ffn_params_per_token() const;

  static absl::StatusOr<ModelConfig> FromGguf(const gguf::GgufFile& f);
};

// A weight matrix view: rows of `cols` elements of `type`, in the mapped file, or in the
// model's packed copy (kernels::PackWeights' layout) when `packed`.
struct WeightView {
  kernels::DType type = kernels::DType::kF32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  bool packed = false;
};

// Whether matrices of this type can be used (and written by ModelLoadOptions::matrix_type).
bool IsWeightType(kernels::DType t);
inline constexpr const char* kWeightTypes = "f32, f16, bf16, q8_0, q4_0, q4_K, q6_K or mxfp4";

struct ModelLoadOptions {
  // Repack the matrices the forward pass multiplies by into the layout of this CPU's fastest
  // matmul kernel (kernels::PackedWeightBytes > 0), in one huge-page-backed buffer; the mapped
  // file's pages of those tensors are then given back. The embedding table stays as it is.
  bool pack_weights = true;
  // Converts every matrix the forward pass multiplies by (not the embedding table) to this type
  // first, through f32 rows, as `tandem quantize` would; a matrix whose row length is not a
  // whole number of the type's blocks keeps its own type. The self-draft of speculative
  // decoding is the target loaded this way (engine/runtime/draft_proposer.h).
  std::optional<kernels::DType> matrix_type;
  // Expert parallelism: whether this process holds expert `expert` of layer `layer` (empty:
  // every expert). Experts it does not hold are neither converted nor packed, and their
  // mapped pages are never touched, so a rank's memory grows with its share of the experts.
  std::function<bool(int32_t layer, int32_t expert)> holds_expert;
  // An expert-only rank of an EP group: nothing but the experts is converted or packed (the
  // rest stays as mapped, unread).
  bool experts_only = false;
};

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;  // n_embd
  std::vector<float> bq, bk, bv;           // empty without qkv bias
  std::vector<float> q_norm, k_norm;       // head_dim; empty without qk_norm
  std::vector<float> bo;                   // n_embd: attention output bias (gpt-oss)
  std::vector<float> sinks;                // n_head: attention sink logits (gpt-oss)
  WeightView wq, wk, wv, wo;
  WeightView w_gate, w_up, w_down;  // dense FFN; unset in MoE layers
  // MoE: the router (n_expert rows), and each expert's matrices as views into the stacked
  // 3-D tensors (expert e is the e-th slab of rows).
  WeightView ffn_gate_inp;
  std::vector<float> gate_inp_b;  // n_expert router bias, or empty
  std::vector<WeightView> exp_gate, exp_up, exp_down;
  // Expert biases, [expert][n_ff_exp] for gate and up, [expert][n_embd] for down; or empty.
  std::vector<float> exp_gate_b, exp_up_b, exp_down_b;
  WeightView sh_gate, sh_up, sh_down;  // shared expert; unset without one
  std::vector<float> sh_gate_inp;      // n_embd: the shared expert's scalar gate
};

class Model {
 public:
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& path,
                                                     const ModelLoadOptions& options = {});

  const ModelConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const gguf::GgufFile& file() const { return *file_; }

  const WeightView& token_embd() const { return token_embd_; }
  const WeightView& output() const { return output_; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  const std::vector<float>& rope_freqs() const { return rope_freqs_; }  // empty if none
  const LayerWeights& layer(int32_t i) const { return layers_[i]; }
  // Bytes of weights one token's decode step reads: all matrices but the embedding table,
  // and of each MoE layer's experts only the n_expert_used a token is routed to.
  uint64_t weight_bytes_per_token() const;

 private:
  Model() = default;
  absl::Status Bind();
  // The matrices PackWeights and ConvertMatrices rewrite: output, then each layer's (its
  // experts one by one). The MoE router keeps its type (as llama.cpp's quantizer does).
  std::vector<WeightView*> MatrixViews(bool with_router = false);
  absl::Status ConvertMatrices(kernels::DType type);
  void PackWeights();

  struct FreeDeleter {
    void operator()(uint8_t* p) const;
  };

  std::unique_ptr<gguf::GgufFile> file_;
  std::unique_ptr<Tokenizer> tokenizer_;
  ModelConfig config_;
  WeightView token_embd_, output_;
  std::vector<float> output_norm_, rope_freqs_;
  std::vector<LayerWeights> layers_;
  std::unique_ptr<uint8_t, FreeDeleter> packed_;  // every packed matrix, back to back
  std::unique_ptr<uint8_t, FreeDeleter> converted_;  // ConvertMatrices' output, until packed
  std::function<bool(int32_t, int32_t)> holds_expert_;  // ModelLoadOptions's
  bool experts_only_ = false;
};

}  // namespace tandem::engine
