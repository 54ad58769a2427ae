#include "engine/runtime/cuda/cuda_forward.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"
#include "engine/runtime/step_plan.h"
#include "tandem/cuda/attention.h"
#include "tandem/cuda/cuda_common.h"
#include "tandem/cuda/elementwise.h"
#include "tandem/cuda/kv_blocks.h"
#include "tandem/cuda/matmul.h"
#include "tandem/kernels/fp16.h"
#include "tandem/kernels/matmul.h"
#include "tandem/kernels/quant.h"

namespace tandem::engine {
namespace {

namespace cu = kernels::cuda;
using kernels::DType;

// The engine's one conversion of CUDA runtime errors (the kernels have their own, private to
// kernels/cuda).
absl::Status FromCudaError(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
                                 ") at ", file, ":", line);
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

#define TANDEM_CUDA_RETURN_IF_ERROR(expr)                          \
  do {                                                             \
    const cudaError_t _tandem_ce = (expr);                         \
    if (_tandem_ce != cudaSuccess) {                               \
      return FromCudaError(_tandem_ce, #expr, __FILE__, __LINE__); \
    }                                                              \
  } while (0)

// Device memory that grows on demand; contents are not kept across growth. Growth happens only
// between steps (after the stream was synchronised), so no queued work uses the old memory.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  absl::Status Reserve(size_t bytes) {
    if (bytes <= size_) return absl::OkStatus();
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    size_ = 0;
    // 256-byte granules keep every later growth step from being a few bytes.
    const size_t want = (bytes + 255) / 256 * 256;
    TANDEM_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr_, want));
    size_ = want;
    return absl::OkStatus();
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  uint8_t* bytes() const { return static_cast<uint8_t*>(ptr_); }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

class CudaStream {
 public:
  CudaStream() = default;
  ~CudaStream() {
    if (s_ != nullptr) cudaStreamDestroy(s_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  absl::Status Create() {
    TANDEM_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
    return absl::OkStatus();
  }
  cu::Stream get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

bool IsGemvType(DType t) {
  return t == DType::kQ8_0 || t == DType::kQ4_0 || t == DType::kQ4_K || t == DType::kMXFP4;
}
int64_t GemvBlockElems(DType t) { return t == DType::kQ4_K ? 256 : 32; }
bool IsBf16Source(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16 || t == DType::kQ6_K;
}

// BF16 rows are padded with zero columns to a multiple of 8 elements (16 bytes), so cuBLASLt
// always sees aligned leading dimensions; the activations are padded to match, and the zero
// products leave the result unchanged.
int64_t Bf16Cols(int64_t cols) { return (cols + 7) / 8 * 8; }

// A weight matrix in device memory: GGUF rows of a QuantGemv type, or BF16 rows of
// Bf16Cols(cols) elements.
struct DeviceMatrix {
  DType type = DType::kBF16;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

struct DeviceLayer {
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* bq = nullptr;  // null without qkv bias
  const float* bk = nullptr;
  const float* bv = nullptr;
  DeviceMatrix wq, wk, wv, wo, w_gate, w_up, w_down;
};

class CudaForward final : public DeviceForward {
 public:
  CudaForward(std::shared_ptr<const Model> model, const EngineOptions& o, int ordinal)
      : model_(std::move(model)), o_(o), ordinal_(ordinal) {}

  absl::Status Init(uint64_t kv_bytes);

  void* kv_memory() const override { return kv_owned_.bytes(); }

  absl::Status Step(std::span<const SeqChunk> chunks, int64_t n_tokens, KvCache& kv,
                    std::vector<float>* logits,
                    const std::function<void(int32_t layer)>& on_layer_done) override;

 private:
  // Sizes and copies every weight into weights_ (one allocation).
  absl::Status UploadWeights();
  absl::Status CheckKvMemory(uint64_t kv_bytes) const;
  // out_i = W_i x for projections of the same input (the BF16 rounding of x is done once).
  absl::Status Project(std::initializer_list<std::pair<const DeviceMatrix*, float*>> outs,
                       const float* in, int64_t n_rows);
  absl::Status Attention(const KvCache& kv, int32_t layer);

  std::shared_ptr<const Model> model_;
  EngineOptions o_;
  int ordinal_;
  bool decode_kernel_ok_ = true;  // the decode kernel takes this head_dim and KV type
  // Declared first so it is destroyed last, after the buffers its work used.
  CudaStream stream_;
  DeviceBuffer weights_;
  std::vector<DeviceLayer> layers_;
  DeviceMatrix output_;
  const float* output_norm_ = nullptr;
  const float* rope_freqs_ = nullptr;       // null when the model has none
  std::unique_ptr<cu::CublasLtGemm> gemm_;  // only when some matrix is BF16
  DeviceBuffer kv_owned_;                   // empty when the caller gave kv_memory

  // Per-step device scratch.
  DeviceBuffer x_, xn_, q_, k_, v_, attn_, gate_, up_, tmp_, xb_, xpad_, logits_dev_, ints_dev_,
      slots_dev_, workspace_;
  // Per-step host staging.
  std::vector<float> x_host_;
  StepPlan plan_;
};

// Copies the matrix `name` (GGUF rows of `view`'s shape) into `dst`, as it is for QuantGemv
// types and as BF16 otherwise. The file's tensor is read, not the view's data, which may be the
// CPU's packed layout.
absl::Status UploadMatrix(const gguf::GgufFile& f, const std::string& name, const WeightView& view,
                          uint8_t* dst, DeviceMatrix* out) {
  const gguf::TensorInfo* t = f.FindTensor(name);
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor ", name));
  if (t->dims.size() != 2 || t->dims[0] != view.cols || t->dims[1] != view.rows ||
      t->type != view.type) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, " does not match the loaded model's view of it"));
  }
  out->rows = view.rows;
  out->cols = view.cols;
  out->data = dst;
  if (IsGemvType(t->type)) {
    out->type = t->type;
    const uint64_t bytes = kernels::RowBytes(t->type, view.cols) * uint64_t(view.rows);
    TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, t->data, bytes, cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }
  out->type = DType::kBF16;
  const int64_t ld = Bf16Cols(view.cols);
  const uint64_t src_row = kernels::RowBytes(t->type, view.cols);
  const auto* src = static_cast<const uint8_t*>(t->data);
  // Converted in slabs of about 8M elements, so the host staging stays small.
  const int64_t slab_rows = std::max<int64_t>(1, (int64_t{8} << 20) / ld);
  std::vector<uint16_t> staging(std::min(slab_rows, view.rows) * ld, 0);  // pads stay zero
  std::vector<float> row(view.cols);
  for (int64_t r0 = 0; r0 < view.rows; r0 += slab_rows) {
    const int64_t n = std::min(slab_rows, view.rows - r0);
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* s = src + uint64_t(r0 + r) * src_row;
      uint16_t* d = staging.data() + r * ld;
      if (t->type == DType::kBF16) {
        std::memcpy(d, s, view.cols * sizeof(uint16_t));
        continue;
      }
      kernels::DequantizeRow(t->type, s, row.data(), view.cols);
      for (int64_t i = 0; i < view.cols; ++i) d[i] = kernels::F32ToBf16(row[i]);
    }
    TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst + uint64_t(r0) * ld * sizeof(uint16_t),
                                           staging.data(), n * ld * sizeof(uint16_t),
                                           cudaMemcpyHostToDevice));
  }
  return absl::OkStatus();
}

absl::Status CudaForward::UploadWeights() {
  const Model& m = *model_;
  const ModelConfig& c = m.config();
  const gguf::GgufFile& f = m.file();
  constexpr uint64_t kAlign = 256;
  auto align = [](uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; };

  // Pass 1: every tensor's place in the arena, with its type checked.
  struct MatrixItem {
    std::string name;
    const WeightView* view;
    DeviceMatrix* out;
    uint64_t offset;
  };
  struct VectorItem {
    const std::vector<float>* host;
    const float** out;
    uint64_t offset;
  };
  std::vector<MatrixItem> matrices;
  std::vector<VectorItem> vectors;
  uint64_t total = 0;
  auto add_matrix = [&](std::string name, const WeightView& view,
                        DeviceMatrix* out) -> absl::Status {
    uint64_t bytes = 0;
    if (IsGemvType(view.type)) {
      if (view.cols % GemvBlockElems(view.type) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", name, ": ", view.cols, " columns of ",
                         std::string(kernels::Traits(view.type).name), " are not whole blocks"));
      }
      bytes = kernels::RowBytes(view.type, view.cols) * uint64_t(view.rows);
    } else if (IsBf16Source(view.type)) {
      bytes = uint64_t(view.rows) * Bf16Cols(view.cols) * sizeof(uint16_t);
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", name, " has type ", std::string(kernels::Traits(view.type).name),
          ", which the CUDA engine cannot multiply by (q8_0, q4_0, q4_K, mxfp4, or f32, f16, "
          "bf16 and q6_K as bf16)"));
    }
    matrices.push_back({std::move(name), &view, out, total});
    total += align(bytes);
    return absl::OkStatus();
  };
  auto add_vector = [&](const std::vector<float>& host, const float** out) {
    if (host.empty()) return;
    vectors.push_back({&host, out, total});
    total += align(host.size() * sizeof(float));
  };

  layers_.resize(c.n_layer);
  for (int32_t l = 0; l < c.n_layer; ++l) {
    const LayerWeights& w = m.layer(l);
    DeviceLayer& d = layers_[l];
    const std::string b = absl::StrCat("blk.", l, ".");
    TANDEM_RETURN_IF_ERROR(add_matrix(b + "attn_q.weight", w.wq, &d.wq));
    TANDEM_RETURN_IF_ERROR(add_matrix(b + "attn_k.weight", w.wk, &d.wk));
    TANDEM_RETURN_IF_ERROR(add_matrix(b + "attn_v.weight", w.wv, &d.wv));
    TANDEM_RETURN_IF_ERROR(add_matrix(b + "attn_output.weight", w.wo, &d.wo));
    TANDEM_RETURN_IF_ERROR(add_matrix(b + "ffn_gate.weight", w.w_gate, &d.w_gate));
    TANDEM_RETURN_IF_ERROR(add_matrix(b + "ffn_up.weight", w.w_up, &d.w_up));
    TANDEM_RETURN_IF_ERROR(add_matrix(b + "ffn_down.weight", w.w_down, &d.w_down));
    add_vector(w.attn_norm, &d.attn_norm);
    add_vector(w.ffn_norm, &d.ffn_norm);
    add_vector(w.bq, &d.bq);
    add_vector(w.bk, &d.bk);
    add_vector(w.bv, &d.bv);
  }
  // Tied embeddings: the classifier is the embedding table (uploaded; the host copy still
  // serves the embedding lookups).
  const std::string out_name =
      f.FindTensor("output.weight") != nullptr ? "output.weight" : "token_embd.weight";
  TANDEM_RETURN_IF_ERROR(add_matrix(out_name, m.output(), &output_));
  add_vector(m.output_norm(), &output_norm_);
  add_vector(m.rope_freqs(), &rope_freqs_);

  // Pass 2: one allocation, then the copies.
  TANDEM_RETURN_IF_ERROR(weights_.Reserve(total));
  for (const MatrixItem& it : matrices) {
    TANDEM_RETURN_IF_ERROR(
        UploadMatrix(f, it.name, *it.view, weights_.bytes() + it.offset, it.out));
  }
  for (const VectorItem& it : vectors) {
    uint8_t* dst = weights_.bytes() + it.offset;
    TANDEM_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(dst, it.host->data(), it.host->size() * sizeof(float), cudaMemcpyHostToDevice));
    *it.out = reinterpret_cast<const float*>(dst);
  }
  const bool any_bf16 = std::any_of(matrices.begin(), matrices.end(), [](const MatrixItem& it) {
    return it.out->type == DType::kBF16;
  });
  if (any_bf16) {
    TANDEM_ASSIGN_OR_RETURN(gemm_, cu::CublasLtGemm::Create());
  }
  return absl::OkStatus();
}

absl::Status CudaForward::CheckKvMemory(uint64_t kv_bytes) const {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, o_.kv_memory);
  if (e != cudaSuccess) cudaGetLastError();  // not a pointer CUDA knows: clear the error
  const bool on_device =
      e == cudaSuccess &&
      (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) &&
      attr.device == ordinal_;
  if (!on_device) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_memory is not device memory of CUDA device ", ordinal_,
                     "; a cuda engine's KV pool must live on its GPU"));
  }
  if (o_.kv_memory_bytes < kv_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_memory has ", o_.kv_memory_bytes, " bytes; the KV pool needs ", kv_bytes));
  }
  return absl::OkStatus();
}

absl::Status CudaForward::Init(uint64_t kv_bytes) {
  const ModelConfig& c = model_->config();
  if (c.head_dim % 8 != 0 || c.head_dim > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device cuda: head_dim ", c.head_dim,
        " is not supported by the CUDA attention kernels (a multiple of 8 up to 256)"));
  }
  if (o_.max_batch_tokens > 65535) {
    return absl::InvalidArgumentError("device cuda: max_batch_tokens must be at most 65535");
  }
  KvCacheOptions ko;
  ko.num_kv_heads = c.n_head_kv;
  ko.head_dim = c.head_dim;
  ko.type = o_.kv_type;
  const uint64_t layer_bytes = uint64_t(o_.kv_blocks) * o_.block_size * KvCache::SlotBytes(ko);
  if (layer_bytes % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device cuda: one layer's KV region is ", layer_bytes,
        " bytes; the CUDA attention kernels need 16-byte aligned layers (change kv_blocks)"));
  }
  TANDEM_RETURN_IF_ERROR(stream_.Create());
  TANDEM_RETURN_IF_ERROR(UploadWeights());
  void* kv_base = o_.kv_memory;
  if (kv_base != nullptr) {
    TANDEM_RETURN_IF_ERROR(CheckKvMemory(kv_bytes));
    if (reinterpret_cast<uintptr_t>(kv_base) % 16 != 0) {
      return absl::InvalidArgumentError("kv_memory must be 16-byte aligned");
    }
  } else {
    TANDEM_RETURN_IF_ERROR(kv_owned_.Reserve(kv_bytes));
    // Zeroed like the CPU engine's fresh mapping, so no block ever holds stale bytes.
    TANDEM_CUDA_RETURN_IF_ERROR(cudaMemset(kv_owned_.bytes(), 0, kv_bytes));
    kv_base = kv_owned_.bytes();
  }
  // The decode kernel takes power-of-two head dims in a range that depends on the KV type;
  // where it does not, single-token chunks go through the prefill kernel (also correct).
  cu::DecodeAttentionParams probe;
  probe.n_seqs = 1;
  probe.max_seq_len = 1;
  probe.n_head = c.n_head;
  probe.n_kv_head = c.n_head_kv;
  probe.head_dim = c.head_dim;
  probe.kv_type = o_.kv_type;
  probe.k_cache = kv_base;
  probe.v_cache = kv_base;
  probe.block_size = o_.block_size;
  probe.max_blocks_per_seq = 1;
  decode_kernel_ok_ = cu::DecodeAttentionWorkspaceBytes(probe).ok();
  return absl::OkStatus();
}

absl::Status CudaForward::Project(
    std::initializer_list<std::pair<const DeviceMatrix*, float*>> outs, const float* in,
    int64_t n_rows) {
  const cu::Stream s = stream_.get();
  bool rounded = false;  // every matrix of one call has the same cols (same input)
  for (const auto& [w, out] : outs) {
    if (w->type == DType::kBF16) {
      const int64_t ld = Bf16Cols(w->cols);
      if (!rounded) {
        const float* src = in;
        if (ld != w->cols) {
          // Rows re-laid ld floats apart with zero pads, then rounded like the rest.
          float* padded = xpad_.as<float>();
          TANDEM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(padded, 0, n_rows * ld * sizeof(float), s));
          TANDEM_CUDA_RETURN_IF_ERROR(
              cudaMemcpy2DAsync(padded, ld * sizeof(float), in, w->cols * sizeof(float),
                                w->cols * sizeof(float), n_rows, cudaMemcpyDeviceToDevice, s));
          src = padded;
        }
        TANDEM_RETURN_IF_ERROR(cu::ConvertF32ToBf16(src, xb_.as<uint16_t>(), n_rows * ld, s));
        rounded = true;
      }
      TANDEM_RETURN_IF_ERROR(gemm_->Bf16(static_cast<const uint16_t*>(w->data), xb_.as<uint16_t>(),
                                         out, w->rows, ld, n_rows, s));
      continue;
    }
    for (int64_t r0 = 0; r0 < n_rows; r0 += cu::kMaxGemvBatch) {
      cu::GemvParams p;
      p.weight_type = w->type;
      p.weight = w->data;
      p.rows = w->rows;
      p.cols = w->cols;
      p.input = in + r0 * w->cols;
      p.input_stride = w->cols;
      p.batch = static_cast<int32_t>(std::min<int64_t>(cu::kMaxGemvBatch, n_rows - r0));
      p.output = out + r0 * w->rows;
      p.output_stride = w->rows;
      TANDEM_RETURN_IF_ERROR(cu::QuantGemv(p, s));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaForward::Attention(const KvCache& kv, int32_t layer) {
  const ModelConfig& c = model_->config();
  const int64_t q_dim = int64_t{c.n_head} * c.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  const int32_t* ints = ints_dev_.as<int32_t>();
  for (const AttentionLaunch& call : plan_.launches) {
    if (call.decode) {
      cu::DecodeAttentionParams p;
      p.q = q_.as<float>() + call.row * q_dim;
      p.q_stride = q_dim;
      p.n_seqs = call.n;
      p.seq_lens = ints + call.lens_off;
      p.max_seq_len = call.max_len;
      p.n_head = c.n_head;
      p.n_kv_head = c.n_head_kv;
      p.head_dim = c.head_dim;
      p.scale = scale;
      p.kv_type = o_.kv_type;
      p.k_cache = kv.k_layer(layer);
      p.v_cache = kv.v_layer(layer);
      p.block_size = o_.block_size;
      p.block_tables = ints + call.table_off;
      p.max_blocks_per_seq = call.table_width;
      p.out = attn_.as<float>() + call.row * q_dim;
      p.out_stride = q_dim;
      p.workspace = workspace_.bytes();
      p.workspace_bytes = workspace_.size();
      TANDEM_RETURN_IF_ERROR(cu::PagedDecodeAttention(p, stream_.get()));
      continue;
    }
    cu::PrefillAttentionParams p;
    p.q = q_.as<float>() + call.row * q_dim;
    p.q_stride = q_dim;
    p.n_q = call.n;
    p.q_pos = ints + call.row;  // the upload starts with the rows' positions
    p.max_pos = call.max_pos;
    p.n_head = c.n_head;
    p.n_kv_head = c.n_head_kv;
    p.head_dim = c.head_dim;
    p.scale = scale;
    p.kv_type = o_.kv_type;
    p.k_cache = kv.k_layer(layer);
    p.v_cache = kv.v_layer(layer);
    p.block_size = o_.block_size;
    p.block_table = ints + call.table_off;
    p.out = attn_.as<float>() + call.row * q_dim;
    p.out_stride = q_dim;
    TANDEM_RETURN_IF_ERROR(cu::PagedPrefillAttention(p, stream_.get()));
  }
  return absl::OkStatus();
}

absl::Status CudaForward::Step(std::span<const SeqChunk> chunks, int64_t T, KvCache& kv,
                               std::vector<float>* logits,
                               const std::function<void(int32_t layer)>& on_layer_done) {
  // Steps may come from different threads; the device is per thread.
  TANDEM_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
  const ModelConfig& c = model_->config();
  const int64_t d = c.n_embd;
  const int64_t q_dim = int64_t{c.n_head} * c.head_dim;
  const int64_t kv_dim = int64_t{c.n_head_kv} * c.head_dim;
  const int64_t ff = c.n_ff;
  const int64_t vocab = c.n_vocab;
  const int32_t bs = o_.block_size;
  const cu::Stream s = stream_.get();

  // Host side: positions, KV slots and attention tables; embedding rows.
  plan_.Build(chunks, bs, decode_kernel_ok_);
  const int64_t n_out = static_cast<int64_t>(plan_.logit_rows.size());
  x_host_.resize(T * d);
  {
    int64_t r = 0;
    for (const SeqChunk& ch : chunks) {
      for (int32_t t : ch.tokens) {
        kernels::GetRow(model_->token_embd().type, model_->token_embd().data, d, t,
                        x_host_.data() + r * d);
        ++r;
      }
    }
  }

  // Device scratch for this step's shape (grows only; the previous step has finished).
  const int64_t max_cols = Bf16Cols(std::max({d, q_dim, ff}));
  TANDEM_RETURN_IF_ERROR(x_.Reserve(T * d * sizeof(float)));
  TANDEM_RETURN_IF_ERROR(xn_.Reserve(T * d * sizeof(float)));
  TANDEM_RETURN_IF_ERROR(q_.Reserve(T * q_dim * sizeof(float)));
  TANDEM_RETURN_IF_ERROR(attn_.Reserve(T * q_dim * sizeof(float)));
  TANDEM_RETURN_IF_ERROR(k_.Reserve(T * kv_dim * sizeof(float)));
  TANDEM_RETURN_IF_ERROR(v_.Reserve(T * kv_dim * sizeof(float)));
  TANDEM_RETURN_IF_ERROR(gate_.Reserve(T * ff * sizeof(float)));
  TANDEM_RETURN_IF_ERROR(up_.Reserve(T * ff * sizeof(float)));
  TANDEM_RETURN_IF_ERROR(tmp_.Reserve(T * d * sizeof(float)));
  if (gemm_ != nullptr) {
    TANDEM_RETURN_IF_ERROR(xb_.Reserve(T * max_cols * sizeof(uint16_t)));
    TANDEM_RETURN_IF_ERROR(xpad_.Reserve(T * max_cols * sizeof(float)));
  }
  TANDEM_RETURN_IF_ERROR(logits_dev_.Reserve(std::max<int64_t>(n_out, 1) * vocab * sizeof(float)));
  TANDEM_RETURN_IF_ERROR(ints_dev_.Reserve(plan_.ints.size() * sizeof(int32_t)));
  TANDEM_RETURN_IF_ERROR(slots_dev_.Reserve(T * sizeof(int64_t)));
  size_t ws = 0;
  for (const AttentionLaunch& call : plan_.launches) {
    if (!call.decode) continue;
    cu::DecodeAttentionParams p;
    p.n_seqs = call.n;
    p.max_seq_len = call.max_len;
    p.n_head = c.n_head;
    p.n_kv_head = c.n_head_kv;
    p.head_dim = c.head_dim;
    p.kv_type = o_.kv_type;
    p.k_cache = kv.k_layer(0);
    p.v_cache = kv.v_layer(0);
    p.block_size = bs;
    p.max_blocks_per_seq = call.table_width;
    TANDEM_ASSIGN_OR_RETURN(const size_t need, cu::DecodeAttentionWorkspaceBytes(p));
    ws = std::max(ws, need);
  }
  if (ws > 0) TANDEM_RETURN_IF_ERROR(workspace_.Reserve(ws));

  // Pageable sources: each copy returns once the bytes are staged, so the host vectors may
  // change afterwards.
  TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(x_.bytes(), x_host_.data(), T * d * sizeof(float),
                                              cudaMemcpyHostToDevice, s));
  TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ints_dev_.bytes(), plan_.ints.data(),
                                              plan_.ints.size() * sizeof(int32_t),
                                              cudaMemcpyHostToDevice, s));
  TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slots_dev_.bytes(), plan_.slots.data(),
                                              T * sizeof(int64_t), cudaMemcpyHostToDevice, s));

  kernels::RopeParams rope;
  rope.mode = c.rope_mode;
  rope.head_dim = c.head_dim;
  rope.n_rot = c.n_rot;
  rope.freq_base = c.rope_base;
  rope.freq_scale = c.rope_freq_scale;
  rope.freq_factors = rope_freqs_;
  const int32_t* pos = ints_dev_.as<int32_t>();
  float* x = x_.as<float>();
  float* xn = xn_.as<float>();
  float* q = q_.as<float>();
  float* k = k_.as<float>();
  float* v = v_.as<float>();
  float* gate = gate_.as<float>();
  float* up = up_.as<float>();
  float* tmp = tmp_.as<float>();

  for (int32_t l = 0; l < c.n_layer; ++l) {
    const DeviceLayer& w = layers_[l];
    TANDEM_RETURN_IF_ERROR(cu::RmsNorm(x, w.attn_norm, xn, T, d, 0, c.norm_eps, s));
    TANDEM_RETURN_IF_ERROR(Project({{&w.wq, q}, {&w.wk, k}, {&w.wv, v}}, xn, T));
    if (w.bq != nullptr) {
      TANDEM_RETURN_IF_ERROR(cu::AddBias(q, w.bq, T, q_dim, 0, s));
      TANDEM_RETURN_IF_ERROR(cu::AddBias(k, w.bk, T, kv_dim, 0, s));
      TANDEM_RETURN_IF_ERROR(cu::AddBias(v, w.bv, T, kv_dim, 0, s));
    }
    TANDEM_RETURN_IF_ERROR(cu::Rope(rope, q, T, q_dim, c.n_head, pos, s));
    TANDEM_RETURN_IF_ERROR(cu::Rope(rope, k, T, kv_dim, c.n_head_kv, pos, s));
    cu::KvWriteParams kw;
    kw.k = k;
    kw.v = v;
    kw.stride = kv_dim;
    kw.n_tokens = static_cast<int32_t>(T);
    kw.slot_mapping = slots_dev_.as<int64_t>();
    kw.n_kv_head = c.n_head_kv;
    kw.head_dim = c.head_dim;
    kw.type = o_.kv_type;
    kw.k_cache = kv.k_layer(l);
    kw.v_cache = kv.v_layer(l);
    TANDEM_RETURN_IF_ERROR(cu::WriteKv(kw, s));
    if (on_layer_done) {
      TANDEM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
      on_layer_done(l);
    }
    TANDEM_RETURN_IF_ERROR(Attention(kv, l));
    TANDEM_RETURN_IF_ERROR(Project({{&w.wo, tmp}}, attn_.as<float>(), T));
    TANDEM_RETURN_IF_ERROR(cu::AddInPlace(x, tmp, T * d, s));
    TANDEM_RETURN_IF_ERROR(cu::RmsNorm(x, w.ffn_norm, xn, T, d, 0, c.norm_eps, s));
    TANDEM_RETURN_IF_ERROR(Project({{&w.w_gate, gate}, {&w.w_up, up}}, xn, T));
    TANDEM_RETURN_IF_ERROR(cu::SwiGlu(gate, up, gate, T * ff, s));
    TANDEM_RETURN_IF_ERROR(Project({{&w.w_down, tmp}}, gate, T));
    TANDEM_RETURN_IF_ERROR(cu::AddInPlace(x, tmp, T * d, s));
  }

  // Final norm and classifier only for the rows whose logits were asked for.
  for (int64_t i = 0; i < n_out; ++i) {
    TANDEM_RETURN_IF_ERROR(
        cu::RmsNorm(x + plan_.logit_rows[i] * d, output_norm_, xn + i * d, 1, d, 0, c.norm_eps, s));
  }
  logits->resize(n_out * vocab);
  if (n_out > 0) {
    TANDEM_RETURN_IF_ERROR(Project({{&output_, logits_dev_.as<float>()}}, xn, n_out));
    TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits->data(), logits_dev_.bytes(),
                                                n_out * vocab * sizeof(float),
                                                cudaMemcpyDeviceToHost, s));
  }
  TANDEM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaDeviceAvailable() {
  if (cu::VisibleDeviceCount() == 0) {
    return absl::FailedPreconditionError(
        "device cuda: no CUDA device is visible (no NVIDIA driver, no GPU, or "
        "CUDA_VISIBLE_DEVICES hides them)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceForward>> CreateCudaForward(std::shared_ptr<const Model> model,
                                                                 const EngineOptions& o,
                                                                 uint64_t kv_bytes) {
  const ModelConfig& c = model->config();
  const char* missing = c.is_moe()                 ? "experts"
                        : c.qk_norm                  ? "per-head q/k norms"
                        : c.rope_ext_factor != 0.0f  ? "YaRN rope scaling"
                        : c.n_swa > 0 || c.attn_sinks ? "sliding windows and attention sinks"
                                                     : nullptr;
  if (missing != nullptr) {
    return absl::UnimplementedError(absl::StrCat("device cuda: the CUDA engine does not run ",
                                                 c.arch_name, " models yet (", missing,
                                                 "); use device cpu"));
  }
  TANDEM_RETURN_IF_ERROR(CudaDeviceAvailable());
  TANDEM_ASSIGN_OR_RETURN(const cu::DeviceInfo dev, cu::CurrentDevice());
  if (dev.sm_major < 8) {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda: GPU ", dev.ordinal, " has compute capability ", dev.sm_major,
                     ".", dev.sm_minor, "; tandem's CUDA kernels need 8.0 or newer"));
  }
  auto f = std::make_unique<CudaForward>(std::move(model), o, dev.ordinal);
  TANDEM_RETURN_IF_ERROR(f->Init(kv_bytes));
  return std::unique_ptr<DeviceForward>(std::move(f));
}

}  // namespace tandem::engine
