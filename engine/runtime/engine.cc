#include "engine/runtime/engine.h"

#include <chrono>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/trace/trace.h"
#include "common/util/status_util.h"
#include "engine/runtime/device_forward.h"
#include "engine/runtime/weight_matmul.h"
#include "tandem/kernels/activation.h"
#include "tandem/kernels/attention.h"
#include "tandem/kernels/matmul.h"
#include "tandem/kernels/norm.h"
#include "tandem/kernels/rope.h"

#if defined(TANDEM_HAVE_CUDA)
#include "engine/runtime/cuda/cuda_forward.h"
#endif

namespace tandem::engine {
namespace {

void Grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

void AddBias(float* rows, const std::vector<float>& bias, int64_t n_rows) {
  if (bias.empty()) return;
  const int64_t n = static_cast<int64_t>(bias.size());
  for (int64_t r = 0; r < n_rows; ++r) kernels::AddInPlace(rows + r * n, bias.data(), n);
}

}  // namespace

namespace {

absl::StatusOr<EngineOptions> ResolveOptions(const Model& model, const EngineOptions& opts) {
  EngineOptions o = opts;
  const ModelConfig& c = model.config();
  if (o.threads < 1) return absl::InvalidArgumentError("threads must be >= 1");
  if (o.ctx_size < 0) return absl::InvalidArgumentError("ctx_size must be >= 0");
  if (o.ctx_size == 0) o.ctx_size = std::min(c.n_ctx_train, 4096);
  if (o.block_size < 1 || o.max_seqs < 1 || o.max_batch_tokens < 1 || o.kv_blocks < 0) {
    return absl::InvalidArgumentError(
        "block_size, max_seqs and max_batch_tokens must be >= 1, kv_blocks >= 0");
  }
  if (o.kv_blocks == 0) {
    o.kv_blocks = o.max_seqs * ((o.ctx_size + o.block_size - 1) / o.block_size);
  }
  return o;
}

KvCacheOptions KvOptions(const Model& model, const EngineOptions& o) {
  const ModelConfig& c = model.config();
  KvCacheOptions ko;
  ko.num_layers = c.n_layer;
  ko.num_kv_heads = c.n_head_kv;
  ko.head_dim = c.head_dim;
  ko.block_size = o.block_size;
  ko.num_blocks = o.kv_blocks;
  ko.type = o.kv_type;
  ko.external_memory = o.kv_memory;
  ko.external_bytes = o.kv_memory_bytes;
  return ko;
}

}  // namespace

const char* DeviceName(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }

std::optional<Device> DeviceFromName(std::string_view name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") return Device::kCuda;
  return std::nullopt;
}

namespace {
constexpr char kBuiltWithoutCuda[] =
    "device cuda: this tandem was built without CUDA (nvcc was not found at configure time, or "
    "TANDEM_ENABLE_CUDA is OFF); rebuild with the CUDA toolkit, or use device cpu";
}  // namespace

absl::Status CheckDeviceAvailable(Device d) {
  if (d == Device::kCpu) return absl::OkStatus();
#if defined(TANDEM_HAVE_CUDA)
  return CudaDeviceAvailable();
#else
  return absl::FailedPreconditionError(kBuiltWithoutCuda);
#endif
}

absl::StatusOr<uint64_t> Engine::KvBytes(const Model& model, const EngineOptions& opts) {
  TANDEM_ASSIGN_OR_RETURN(EngineOptions o, ResolveOptions(model, opts));
  return KvCache::RequiredBytes(KvOptions(model, o));
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(std::shared_ptr<const Model> model,
                                                       const EngineOptions& opts) {
  TANDEM_ASSIGN_OR_RETURN(EngineOptions o, ResolveOptions(*model, opts));
  if (o.expert_peers != nullptr && (!model->config().is_moe() || o.device != Device::kCpu)) {
    return absl::InvalidArgumentError(
        "expert parallelism needs an MoE model on the CPU (ranks > 1 given for a dense model, "
        "or with --device cuda)");
  }
  KvCacheOptions ko = KvOptions(*model, o);
  std::unique_ptr<DeviceForward> device;
  if (o.device == Device::kCuda) {
#if defined(TANDEM_HAVE_CUDA)
    TANDEM_ASSIGN_OR_RETURN(device, CreateCudaForward(model, o, KvCache::RequiredBytes(ko)));
    if (ko.external_memory == nullptr) {
      ko.external_memory = device->kv_memory();
      ko.external_bytes = KvCache::RequiredBytes(ko);
    }
    ko.device_memory = true;
#else
    return absl::FailedPreconditionError(kBuiltWithoutCuda);
#endif
  }
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> kv, KvCache::Create(ko));
  return std::unique_ptr<Engine>(new Engine(std::move(model), o, std::move(device), std::move(kv)));
}

Engine::Engine(std::shared_ptr<const Model> model, const EngineOptions& o,
               std::unique_ptr<DeviceForward> device, std::unique_ptr<KvCache> kv)
    : model_(std::move(model)),
      o_(o),
      device_(std::move(device)),
      kv_(std::move(kv)),
      pool_(o.threads),
      kv_bytes_per_position_(2 * int64_t{kv_->options().num_layers} *
                             static_cast<int64_t>(kv_->slot_bytes())),
      expert_tokens_(size_t(model_->config().n_layer) * model_->config().n_expert, 0) {}

Engine::~Engine() = default;

absl::Status Engine::Validate(std::span<const SeqChunk> chunks, int64_t* n_tokens) const {
  const int32_t vocab = model_->config().n_vocab;
  int64_t total = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const SeqChunk& ch = chunks[i];
    if (ch.tokens.empty()) return absl::InvalidArgumentError(absl::StrCat("chunk ", i, " is empty"));
    for (int32_t t : ch.tokens) {
      if (t < 0 || t >= vocab) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", t, " is outside the vocabulary [0, ", vocab, ")"));
      }
    }
    const int64_t end = int64_t{ch.start_pos} + static_cast<int64_t>(ch.tokens.size());
    if (ch.start_pos < 0 || end > o_.ctx_size) {
      return absl::InvalidArgumentError(absl::StrCat("positions [", ch.start_pos, ", ", end,
                                                     ") exceed the context size ", o_.ctx_size));
    }
    const int64_t need = (end + o_.block_size - 1) / o_.block_size;
    if (static_cast<int64_t>(ch.block_table.size()) < need) {
      return absl::InvalidArgumentError(absl::StrCat("block table has ", ch.block_table.size(),
                                                     " blocks, positions need ", need));
    }
    for (int32_t b : ch.block_table) {
      if (b < 0 || b >= kv_->pool().num_blocks()) {
        return absl::InvalidArgumentError(absl::StrCat("block id ", b, " out of range"));
      }
    }
    if (ch.want_logits && (ch.n_logits < 1 || ch.n_logits > static_cast<int64_t>(ch.tokens.size()))) {
      return absl::InvalidArgumentError(absl::StrCat("chunk ", i, " asks for ", ch.n_logits,
                                                     " logit rows of ", ch.tokens.size(),
                                                     " tokens"));
    }
    total += static_cast<int64_t>(ch.tokens.size());
  }
  if (total > o_.max_batch_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("step has ", total,
                                                   " tokens, max_batch_tokens is ",
                                                   o_.max_batch_tokens));
  }
  *n_tokens = total;
  return absl::OkStatus();
}

absl::Status Engine::Step(std::span<const SeqChunk> chunks, std::vector<float>* logits,
                          const std::function<void(int32_t layer)>& on_layer_done) {
  int64_t T = 0;
  TANDEM_RETURN_IF_ERROR(Validate(chunks, &T));
  const auto t0 = std::chrono::steady_clock::now();
  // Nsight Systems sees each step beside its kernels (a worker's --trace records it too).
  const trace::NvtxRange range("step");
  const absl::Status st = device_ != nullptr
                              ? device_->Step(chunks, T, *kv_, logits, on_layer_done)
                              : CpuStep(chunks, T, logits, on_layer_done);
  if (!st.ok()) return st;
  // What the step did and took: the cost model's sample, and the work MBU and MFU divide.
  last_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  last_.shape = ShapeOf(chunks);
  last_.work = WorkOf(*model_, kv_bytes_per_position_, chunks);
  ++steps_;
  cost_.Observe(last_.shape, last_.seconds);
  return st;
}

absl::Status Engine::CpuStep(std::span<const SeqChunk> chunks, int64_t T,
                             std::vector<float>* logits,
                             const std::function<void(int32_t layer)>& on_layer_done) {
  const ModelConfig& c = model_->config();
  const int64_t d = c.n_embd;
  const int64_t q_dim = int64_t{c.n_head} * c.head_dim;
  const int64_t kv_dim = int64_t{c.n_head_kv} * c.head_dim;
  Grow(x_, T * d);
  Grow(xn_, T * d);
  Grow(q_, T * q_dim);
  Grow(k_, T * kv_dim);
  Grow(v_, T * kv_dim);
  Grow(attn_, T * q_dim);
  Grow(gate_, T * c.n_ff);
  Grow(up_, T * c.n_ff);
  Grow(tmp_, T * d);
  pos_.resize(T);

  // Token rows of the batch: chunk after chunk. row_chunk maps a row to its chunk.
  std::vector<int32_t> row_chunk(T);
  {
    int64_t r = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      for (size_t j = 0; j < chunks[i].tokens.size(); ++j, ++r) {
        pos_[r] = chunks[i].start_pos + static_cast<int32_t>(j);
        row_chunk[r] = static_cast<int32_t>(i);
        kernels::GetRow(model_->token_embd().type, model_->token_embd().data, d,
                        chunks[i].tokens[j], x_.data() + r * d);
      }
    }
  }

  kernels::RopeParams rope;
  rope.mode = c.rope_mode;
  rope.head_dim = c.head_dim;
  rope.n_rot = c.n_rot;
  rope.freq_base = c.rope_base;
  rope.freq_scale = c.rope_freq_scale;
  rope.freq_factors = model_->rope_freqs().empty() ? nullptr : model_->rope_freqs().data();
  rope.ext_factor = c.rope_ext_factor;
  rope.attn_factor = c.rope_attn_factor;
  // Sliding-window layers may turn at another base (gpt-oss: the same one).
  kernels::RopeParams rope_swa = rope;
  rope_swa.freq_base = c.rope_base_swa;
  if (c.rope_ext_factor != 0.0f) {
    kernels::YarnCorrDims(c.n_rot, c.rope_ctx_orig, rope.freq_base, 32.0f, 1.0f, rope.corr_dims);
    kernels::YarnCorrDims(c.n_rot, c.rope_ctx_orig, rope_swa.freq_base, 32.0f, 1.0f,
                          rope_swa.corr_dims);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  util::ThreadPool* pool = &pool_;
  // Small per-row work (norms, rope) only pays for threads when there are many rows.
  const int64_t row_grain = 8;

  for (int32_t l = 0; l < c.n_layer; ++l) {
    const LayerWeights& w = model_->layer(l);
    const bool swa = c.is_swa_layer(l);
    const kernels::RopeParams& layer_rope = swa ? rope_swa : rope;
    pool->ParallelFor(T, [&](int64_t b, int64_t e, int) {
      for (int64_t r = b; r < e; ++r) {
        kernels::RmsNorm(x_.data() + r * d, w.attn_norm.data(), xn_.data() + r * d, d, c.norm_eps);
      }
    }, row_grain);
    const Projection qkv[] = {{&w.wq, q_.data()}, {&w.wk, k_.data()}, {&w.wv, v_.data()}};
    MatmulSameInput(qkv, xn_.data(), T, pool);
    AddBias(q_.data(), w.bq, T);
    AddBias(k_.data(), w.bk, T);
    AddBias(v_.data(), w.bv, T);
    if (c.qk_norm) {
      // Per-head RMSNorm of q and k, before rope (qwen3).
      pool->ParallelFor(T, [&](int64_t b, int64_t e, int) {
        for (int64_t r = b; r < e; ++r) {
          for (int32_t h = 0; h < c.n_head; ++h) {
            float* q = q_.data() + r * q_dim + int64_t{h} * c.head_dim;
            kernels::RmsNorm(q, w.q_norm.data(), q, c.head_dim, c.norm_eps);
          }
          for (int32_t h = 0; h < c.n_head_kv; ++h) {
            float* k = k_.data() + r * kv_dim + int64_t{h} * c.head_dim;
            kernels::RmsNorm(k, w.k_norm.data(), k, c.head_dim, c.norm_eps);
          }
        }
      }, row_grain);
    }
    pool->ParallelFor(T, [&](int64_t b, int64_t e, int) {
      for (int64_t r = b; r < e; ++r) {
        kernels::Rope(layer_rope, q_.data() + r * q_dim, c.n_head, pos_[r]);
        kernels::Rope(layer_rope, k_.data() + r * kv_dim, c.n_head_kv, pos_[r]);
        kv_->Write(l, chunks[row_chunk[r]].block_table, pos_[r], k_.data() + r * kv_dim,
                   v_.data() + r * kv_dim);
      }
    }, row_grain);
    if (on_layer_done) on_layer_done(l);

    int64_t row = 0;
    attn_params_.clear();
    for (const SeqChunk& ch : chunks) {
      const int64_t n = static_cast<int64_t>(ch.tokens.size());
      kernels::PagedAttentionParams ap;
      ap.q = q_.data() + row * q_dim;
      ap.q_stride = q_dim;
      ap.n_q = n;
      ap.q_pos = pos_.data() + row;
      ap.n_head = c.n_head;
      ap.n_kv_head = c.n_head_kv;
      ap.head_dim = c.head_dim;
      ap.scale = scale;
      ap.kv_type = kv_->options().type;
      ap.k_cache = kv_->k_layer(l);
      ap.v_cache = kv_->v_layer(l);
      ap.block_size = kv_->block_size();
      ap.block_table = ch.block_table.data();
      ap.out = attn_.data() + row * q_dim;
      ap.out_stride = q_dim;
      ap.window = swa ? c.n_swa : 0;
      ap.sinks = w.sinks.empty() ? nullptr : w.sinks.data();
      attn_params_.push_back(ap);
      row += n;
    }
    kernels::PagedAttentionBatch(attn_params_, pool);

    MatmulRows(w.wo, attn_.data(), T, tmp_.data(), pool);
    AddBias(tmp_.data(), w.bo, T);
    kernels::AddInPlace(x_.data(), tmp_.data(), T * d);
    pool->ParallelFor(T, [&](int64_t b, int64_t e, int) {
      for (int64_t r = b; r < e; ++r) {
        kernels::RmsNorm(x_.data() + r * d, w.ffn_norm.data(), xn_.data() + r * d, d, c.norm_eps);
      }
    }, row_grain);
    if (c.is_moe()) {
      if (absl::Status st =
              moe_.Forward(c, w, l, xn_.data(), T, tmp_.data(), pool, o_.expert_peers);
          !st.ok()) {
        return st;
      }
      const std::vector<int64_t>& routed = moe_.last_expert_tokens();
      for (int32_t e = 0; e < c.n_expert; ++e) {
        expert_tokens_[size_t(l) * c.n_expert + e] += routed[e];
      }
    } else {
      const Projection gate_up[] = {{&w.w_gate, gate_.data()}, {&w.w_up, up_.data()}};
      MatmulSameInput(gate_up, xn_.data(), T, pool);
      kernels::SwiGlu(gate_.data(), up_.data(), gate_.data(), T * c.n_ff);
      MatmulRows(w.w_down, gate_.data(), T, tmp_.data(), pool);
    }
    kernels::AddInPlace(x_.data(), tmp_.data(), T * d);
  }

  // Final norm and classifier only for the rows whose logits were asked for.
  int64_t n_out = 0;
  {
    int64_t row = 0;
    for (const SeqChunk& ch : chunks) {
      row += static_cast<int64_t>(ch.tokens.size());
      if (!ch.want_logits) continue;
      for (int64_t r = row - ch.n_logits; r < row; ++r, ++n_out) {
        kernels::RmsNorm(x_.data() + r * d, model_->output_norm().data(), xn_.data() + n_out * d,
                         d, c.norm_eps);
      }
    }
  }
  logits->resize(n_out * c.n_vocab);
  if (n_out > 0) MatmulRows(model_->output(), xn_.data(), n_out, logits->data(), pool);
  return absl::OkStatus();
}

}  // namespace tandem::engine
