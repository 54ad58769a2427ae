// Model tools: llama2.c conversion, synthetic random-weight models, and requantisation.
//
// All three stream tensor data through GgufWriter::AddTensorFromSource, so peak memory is a
// few MiB per thread regardless of model size; row conversion is spread over a thread pool.
#include "tools/tandem/model_tools.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <numbers>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/gguf/gguf.h"
#include "common/util/status_util.h"
#include "common/util/thread_pool.h"
#include "tandem/kernels/quant.h"

namespace tandem::tools {
namespace {

using kernels::DType;

// Debian's abseil keeps its own string_view type, so absl::StrCat does not take
// std::string_view; this small concatenation does.
inline void AppendPiece(std::string& o, std::string_view s) { o.append(s); }
inline void AppendPiece(std::string& o, const char* s) { o.append(s); }
inline void AppendPiece(std::string& o, char c) { o.push_back(c); }
template <typename T>
requires std::is_arithmetic_v<T>
void AppendPiece(std::string& o, T v) { o += std::to_string(v); }
template <typename... Args>
std::string Cat(const Args&... args) {
  std::string out;
  (AppendPiece(out, args), ...);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Shared helpers

// A read-only private mapping of a whole file.
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return util::FromErrno(errno, Cat("open ", path));
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return util::FromErrno(err, Cat("stat ", path));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(Cat(path, ": not a regular file"));
    }
    std::unique_ptr<MappedFile> f(new MappedFile());
    f->size_ = static_cast<size_t>(st.st_size);
    if (f->size_ > 0) {
      void* m = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (m == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        return util::FromErrno(err, Cat("mmap ", path));
      }
      f->map_ = m;
    }
    ::close(fd);
    return f;
  }
  ~MappedFile() {
    if (map_ != nullptr) ::munmap(map_, size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const uint8_t> bytes() const { return {static_cast<const uint8_t*>(map_), size_}; }

 private:
  MappedFile() = default;
  void* map_ = nullptr;
  size_t size_ = 0;
};

int DefaultThreads() {
  const unsigned n = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(n, 1u, 16u));
}

// Runs fn(row, scratch) for every row of [0, n) on the pool, returning the first error.
// scratch is a per-thread float buffer of `scratch_elems` elements.
absl::Status ParallelRows(util::ThreadPool& pool, int64_t n, int64_t scratch_elems,
                          const std::function<absl::Status(int64_t, float*)>& fn) {
  std::mutex mu;
  absl::Status first;
  std::atomic<bool> failed{false};
  pool.ParallelFor(n, [&](int64_t begin, int64_t end, int) {
    std::vector<float> scratch(static_cast<size_t>(scratch_elems));
    for (int64_t r = begin; r < end && !failed.load(std::memory_order_relaxed); ++r) {
      absl::Status st = fn(r, scratch.data());
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first.ok()) first = std::move(st);
        failed = true;
      }
    }
  });
  return first;
}

bool IsStorableWeightType(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ4_K:
    case DType::kQ6_K:
    case DType::kMXFP4:
      return true;
    default:
      return false;
  }
}

absl::Status CheckWeightType(DType t) {
  if (!IsStorableWeightType(t)) {
    return absl::InvalidArgumentError(
        Cat("weight type ", kernels::Traits(t).name,
            " cannot be stored (use f32, f16, bf16, q8_0, q4_0, q4_K, q6_K or mxfp4)"));
  }
  return absl::OkStatus();
}

// Type a matrix with rows of `row_len` elements is stored as: the requested type when the
// row is a whole number of its blocks, else F16 (every row length is a multiple of F16's 1).
DType MatrixType(DType wanted, int64_t row_len) {
  return row_len % kernels::Traits(wanted).block_elems == 0 ? wanted : DType::kF16;
}

// Adds a tensor whose rows are copied from a caller-owned buffer that outlives the Write.
absl::Status AddBorrowed(gguf::GgufWriter& w, std::string name, std::vector<int64_t> dims,
                         DType type, const uint8_t* data, uint64_t row_bytes) {
  return w.AddTensorFromSource(
      std::move(name), std::move(dims), type,
      [data, row_bytes](int64_t r0, int64_t, std::span<uint8_t> out) {
        std::memcpy(out.data(), data + static_cast<uint64_t>(r0) * row_bytes, out.size());
        return absl::OkStatus();
      });
}

absl::Status AddF32(gguf::GgufWriter& w, std::string name, std::vector<int64_t> dims,
                    const std::vector<float>& v) {
  return w.AddTensor(std::move(name), std::move(dims), DType::kF32,
                     {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(float)});
}

// ---------------------------------------------------------------------------------------------
// llama2.c conversion

struct L2cConfig {
  int64_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab, seq_len;
  bool shared_classifier;
  int64_t head_size() const { return dim / n_heads; }
  int64_t kv_dim() const { return dim * n_kv_heads / n_heads; }
};

// a * b with an overflow flag (values here are products of int32 header fields).
uint64_t Mul(uint64_t a, uint64_t b, bool* overflow) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) *overflow = true;
  return r;
}
uint64_t Add(uint64_t a, uint64_t b, bool* overflow) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) *overflow = true;
  return r;
}

absl::StatusOr<L2cConfig> ParseL2cHeader(std::span<const uint8_t> b, const std::string& path) {
  if (b.size() < 28) {
    return absl::InvalidArgumentError(
        Cat(path, ": ", b.size(), " bytes is too short for a llama2.c header (28 bytes)"));
  }
  int32_t h[7];
  std::memcpy(h, b.data(), sizeof(h));
  if (static_cast<uint32_t>(h[0]) == 0x616b3432u) {  // "ak42": llama2.c export v1/v2
    return absl::UnimplementedError(
        Cat(path,
            ": llama2.c export version 1/2 (magic ak42) is not supported; export the "
            "legacy (version 0) format"));
  }
  L2cConfig c{h[0], h[1], h[2], h[3], h[4], h[5] < 0 ? -int64_t{h[5]} : h[5], h[6], h[5] > 0};
  auto bad = [&](std::string_view what) {
    return absl::InvalidArgumentError(Cat(path, ": bad llama2.c header (", what, "): dim=", h[0],
                                          " hidden_dim=", h[1], " n_layers=", h[2],
                                          " n_heads=", h[3], " n_kv_heads=", h[4],
                                          " vocab_size=", h[5], " seq_len=", h[6]));
  };
  if (c.dim <= 0 || c.hidden_dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
      c.vocab <= 0 || c.seq_len <= 0) {
    return bad("every field must be positive");
  }
  if (c.dim % c.n_heads != 0) return bad("dim must be a multiple of n_heads");
  if (c.n_heads % c.n_kv_heads != 0) return bad("n_heads must be a multiple of n_kv_heads");
  if (c.head_size() % 2 != 0) return bad("head size must be even for rotary embeddings");
  return c;
}

struct L2cWeights {
  const float* token_embedding;
  const float* rms_att;
  const float* wq;
  const float* wk;
  const float* wv;
  const float* wo;
  const float* rms_ffn;
  const float* w1;
  const float* w2;
  const float* w3;
  const float* rms_final;
  const float* wcls;
};

// Locates the weights in llama2.c's order and checks the file has exactly that many floats.
absl::StatusOr<L2cWeights> LocateL2cWeights(const L2cConfig& c, std::span<const uint8_t> b,
                                            const std::string& path) {
  const uint64_t dim = c.dim, hid = c.hidden_dim, L = c.n_layers, V = c.vocab;
  const uint64_t kv = c.kv_dim(), hs = c.head_size(), seq = c.seq_len;
  bool of = false;
  const uint64_t counts[] = {
      Mul(V, dim, &of),                            // token_embedding
      Mul(L, dim, &of),                            // rms_att
      Mul(Mul(L, dim, &of), dim, &of),             // wq
      Mul(Mul(L, dim, &of), kv, &of),              // wk
      Mul(Mul(L, dim, &of), kv, &of),              // wv
      Mul(Mul(L, dim, &of), dim, &of),             // wo
      Mul(L, dim, &of),                            // rms_ffn
      Mul(Mul(L, dim, &of), hid, &of),             // w1
      Mul(Mul(L, hid, &of), dim, &of),             // w2
      Mul(Mul(L, dim, &of), hid, &of),             // w3
      dim,                                         // rms_final
      Mul(seq, hs / 2, &of),                       // freq_cis_real (unused)
      Mul(seq, hs / 2, &of),                       // freq_cis_imag (unused)
      c.shared_classifier ? 0 : Mul(V, dim, &of),  // wcls
  };
  uint64_t total = 0;
  for (uint64_t n : counts) total = Add(total, n, &of);
  const uint64_t want = Add(28, Mul(total, 4, &of), &of);
  if (of) return absl::InvalidArgumentError(Cat(path, ": llama2.c header sizes overflow"));
  if (b.size() != want) {
    return absl::InvalidArgumentError(
        Cat(path, ": llama2.c checkpoint is ", b.size(), " bytes but its header implies ", want,
            " (", c.shared_classifier ? "shared" : "separate", " classifier)"));
  }
  const float* p = reinterpret_cast<const float*>(b.data() + 28);
  const float* ptrs[14];
  for (int i = 0; i < 14; ++i) {
    ptrs[i] = p;
    p += counts[i];
  }
  return L2cWeights{ptrs[0], ptrs[1], ptrs[2],  ptrs[3],
                    ptrs[4], ptrs[5], ptrs[6],  ptrs[7],
                    ptrs[8], ptrs[9], ptrs[10], c.shared_classifier ? ptrs[0] : ptrs[13]};
}

struct L2cVocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
};

// llama_token_type numbering (llama.h).
constexpr int32_t kTokNormal = 1, kTokUnknown = 2, kTokControl = 3, kTokByte = 6;

bool IsByteToken(std::string_view s) {
  auto hex = [](char ch) { return std::isxdigit(static_cast<unsigned char>(ch)) != 0; };
  return s.size() == 6 && s.substr(0, 3) == "<0x" && hex(s[3]) && hex(s[4]) && s[5] == '>';
}

// SentencePiece writes spaces as U+2581; llama2.c's tokenizer.bin stores plain spaces.
std::string EscapeSpaces(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    if (ch == ' ') {
      out += "\xe2\x96\x81";
    } else {
      out.push_back(ch);
    }
  }
  return out;
}

absl::StatusOr<L2cVocab> ReadL2cTokenizer(const std::string& path, int64_t vocab) {
  TANDEM_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  const std::span<const uint8_t> b = file->bytes();
  uint64_t pos = 0;
  auto need = [&](uint64_t n, std::string_view what) -> absl::Status {
    if (n > b.size() - pos) {
      return absl::InvalidArgumentError(Cat(path, ": at byte ", pos, ": truncated ", what));
    }
    return absl::OkStatus();
  };
  TANDEM_RETURN_IF_ERROR(need(4, "max_token_length"));
  pos = 4;
  if (static_cast<uint64_t>(vocab) > (b.size() - pos) / 8) {  // >= 8 bytes per token
    return absl::InvalidArgumentError(
        Cat(path, ": ", b.size(), " bytes cannot hold the ", vocab, " tokens the model has"));
  }
  L2cVocab v;
  v.tokens.reserve(vocab);
  for (int64_t id = 0; id < vocab; ++id) {
    TANDEM_RETURN_IF_ERROR(need(8, Cat("token ", id)));
    float score;
    int32_t len;
    std::memcpy(&score, b.data() + pos, 4);
    std::memcpy(&len, b.data() + pos + 4, 4);
    if (len < 0) {
      return absl::InvalidArgumentError(
          Cat(path, ": at byte ", pos + 4, ": token ", id, " has negative length ", len));
    }
    pos += 8;
    TANDEM_RETURN_IF_ERROR(need(static_cast<uint64_t>(len), Cat("text of token ", id)));
    std::string_view text(reinterpret_cast<const char*>(b.data() + pos), len);
    pos += static_cast<uint64_t>(len);
    // Ids 0..2 are llama2.c's <unk>, <s>, </s> (stored with newlines around them).
    int32_t type = kTokNormal;
    std::string out;
    if (id == 0) {
      out = "<unk>";
      type = kTokUnknown;
    } else if (id == 1) {
      out = "<s>";
      type = kTokControl;
    } else if (id == 2) {
      out = "</s>";
      type = kTokControl;
    } else {
      if (text.empty()) {
        type = kTokControl;
      } else if (IsByteToken(text)) {
        type = kTokByte;
      }
      out = EscapeSpaces(text);
    }
    v.tokens.push_back(std::move(out));
    v.scores.push_back(score);
    v.types.push_back(type);
  }
  if (pos != b.size()) {
    return absl::InvalidArgumentError(
        Cat(path, ": ", b.size() - pos, " bytes follow the ", vocab,
            " tokens the model expects (tokenizer and checkpoint do not match)"));
  }
  return v;
}

std::string FileStem(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  const size_t dot = base.find_last_of('.');
  if (dot != std::string::npos && dot > 0) base.resize(dot);
  return base;
}

// ---------------------------------------------------------------------------------------------
// Synthetic models

// splitmix64: tiny, fast and identical everywhere, so synthetic files are reproducible.
uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char ch : s) {
    h ^= static_cast<uint8_t>(ch);
    h *= 0x100000001b3ull;
  }
  return h;
}

// Standard normal samples (Box-Muller) from a splitmix64 stream keyed by (seed, tensor, row),
// so a row's values do not depend on which thread or chunk produces it.
class RowNormal {
 public:
  RowNormal(uint64_t seed, uint64_t tensor_hash, int64_t row) {
    uint64_t s = seed;
    uint64_t t = SplitMix(s) ^ tensor_hash;
    uint64_t r = SplitMix(t) ^ static_cast<uint64_t>(row);
    state_ = SplitMix(r);
  }
  void Fill(float* out, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i += 2) {
      // u1 in (0, 1] so the log is finite; 53-bit uniforms.
      const double u1 = (static_cast<double>(SplitMix(state_) >> 11) + 1.0) * 0x1.0p-53;
      const double u2 = static_cast<double>(SplitMix(state_) >> 11) * 0x1.0p-53;
      const double r = std::sqrt(-2.0 * std::log(u1));
      const double a = 2.0 * std::numbers::pi * u2;
      out[i] = static_cast<float>(r * std::cos(a)) * scale;
      if (i + 1 < n) out[i + 1] = static_cast<float>(r * std::sin(a)) * scale;
    }
  }

 private:
  uint64_t state_;
};

struct Shape {
  std::string_view name;
  std::string_view arch;
  std::string_view vocab_file;
  int64_t dim, n_layers, n_heads, n_kv_heads, ffn, context;
  double rope_base;
  double eps;
  bool tied_embeddings;
  bool qkv_bias;
  std::optional<Llama3RopeScaling> llama3_rope;
  // Shapes whose head width is not dim / n_heads (qwen3) name it; 0: dim / n_heads.
  int64_t head_dim = 0;
  bool qk_norm = false;
  // Mixture of experts: n_expert > 0. qwen2moe and qwen3moe size each expert by n_ff_exp (ffn
  // is then the model's nominal FFN width, written as feed_forward_length); Mixtral (llama)
  // by ffn. n_ff_shexp > 0: qwen2moe's shared expert.
  int64_t n_expert = 0, n_expert_used = 0, n_ff_exp = 0, n_ff_shexp = 0;
  // gpt-oss: a sliding window on alternate layers, YaRN (factor, original context), attention
  // sinks, and biases on attention output, router and experts.
  int64_t n_swa = 0;
  double yarn_factor = 0;
  int64_t yarn_ctx_orig = 0;
};

const Shape kShapes[] = {
    // llama2.c's stories15M (its classifier is stored separately, as llama.cpp's converter
    // writes it, so this shape also exercises an untied output matrix).
    {"stories15M", "llama", "ggml-vocab-llama-spm.gguf", 288, 6, 6, 6, 768, 256, 10000.0, 1e-5,
     false, false, std::nullopt},
    // Llama-3.2-1B.
    {"llama-1b", "llama", "ggml-vocab-llama-bpe.gguf", 2048, 16, 32, 8, 8192, 131072, 500000.0,
     1e-5, true, false, Llama3RopeScaling{32.0, 1.0, 4.0, 8192}},
    // Qwen2.5-0.5B.
    {"qwen2-0.5b", "qwen2", "ggml-vocab-qwen2.gguf", 896, 24, 14, 2, 4864, 32768, 1000000.0, 1e-6,
     true, true, std::nullopt},
    // Qwen3-0.6B.
    {"qwen3-0.6b", "qwen3", "ggml-vocab-qwen2.gguf", 1024, 28, 16, 8, 3072, 40960, 1000000.0,
     1e-6, true, false, std::nullopt, 128, true},
    // Mixture-of-experts shapes. Qwen3-30B-A3B: 128 experts of 768, 8 per token.
    {"qwen3-30b-a3b", "qwen3moe", "ggml-vocab-qwen2.gguf", 2048, 48, 32, 4, 6144, 40960,
     1000000.0, 1e-6, false, false, std::nullopt, 128, true, 128, 8, 768, 0},
    // Qwen1.5-MoE-A2.7B (qwen2moe): 60 experts of 1408, 4 per token, a shared expert of 5632.
    {"qwen1.5-moe-a2.7b", "qwen2moe", "ggml-vocab-qwen2.gguf", 2048, 24, 16, 16, 5632, 8192,
     1000000.0, 1e-6, false, true, std::nullopt, 0, false, 60, 4, 1408, 5632},
    // Mixtral-8x7B scaled down 4x in width and layers (8 experts, 2 per token, as the real one).
    {"mixtral-mini", "llama", "ggml-vocab-llama-spm.gguf", 1024, 8, 8, 2, 3584, 32768, 1000000.0,
     1e-5, false, false, std::nullopt, 0, false, 8, 2, 3584, 0},
    // Small MoE shapes for tests and `make fidelity` (widths are whole K-quant blocks).
    {"qwen3moe-test", "qwen3moe", "ggml-vocab-qwen2.gguf", 256, 4, 8, 2, 1024, 4096, 1000000.0,
     1e-6, false, false, std::nullopt, 64, true, 16, 4, 256, 0},
    {"qwen2moe-test", "qwen2moe", "ggml-vocab-qwen2.gguf", 256, 4, 8, 8, 512, 4096, 1000000.0,
     1e-6, false, true, std::nullopt, 0, false, 16, 4, 256, 512},
    {"mixtral-test", "llama", "ggml-vocab-llama-spm.gguf", 256, 4, 8, 2, 512, 4096, 1000000.0,
     1e-5, false, false, std::nullopt, 0, false, 8, 2, 512, 0},
    // gpt-oss-20b: 32 experts of 2880, 4 per token, a 128-position window on even layers, YaRN
    // x32 over 4096. Its own o200k vocabulary is not among llama.cpp's vocab files; Llama 3's
    // 128k BPE vocabulary stands in (the tokenizer is independent of the architecture).
    {"gpt-oss-20b", "gpt-oss", "ggml-vocab-llama-bpe.gguf", 2880, 24, 64, 8, 2880, 131072,
     150000.0, 1e-5, false, true, std::nullopt, 64, false, 32, 4, 2880, 0, 128, 32.0, 4096},
    {"gpt-oss-test", "gpt-oss", "ggml-vocab-llama-bpe.gguf", 256, 4, 8, 2, 256, 131072, 150000.0,
     1e-5, false, true, std::nullopt, 64, false, 16, 4, 256, 0, 16, 32.0, 4096},
};

// Scales, chosen so random weights give a numerically tame network (see Synthesize).
constexpr float kEmbeddingRms = 0.3f;  // times 1/sqrt(dim)
constexpr float kQueryGain = 2.0f;
constexpr float kFirstAttnOutGain = 0.3f;
constexpr float kNormJitter = 0.05f;
constexpr float kBiasStd = 0.1f;
// The MoE router: logits with a standard deviation of 2, so a token's experts are chosen by
// clear margins (near-ties between the last chosen and first unchosen expert are rare) while
// the weights are not one-hot.
constexpr float kRouterGain = 2.0f;

uint32_t FileTypeForImpl(DType t) {
  switch (t) {
    case DType::kF32:
      return 0;  // LLAMA_FTYPE_ALL_F32
    case DType::kF16:
      return 1;  // LLAMA_FTYPE_MOSTLY_F16
    case DType::kQ4_0:
      return 2;  // LLAMA_FTYPE_MOSTLY_Q4_0
    case DType::kQ8_0:
      return 7;  // LLAMA_FTYPE_MOSTLY_Q8_0
    case DType::kQ4_K:
      return 15;  // LLAMA_FTYPE_MOSTLY_Q4_K_M
    case DType::kQ6_K:
      return 18;  // LLAMA_FTYPE_MOSTLY_Q6_K
    case DType::kBF16:
      return 32;  // LLAMA_FTYPE_MOSTLY_BF16
    case DType::kMXFP4:
      return 38;  // LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    default:
      return 1024;  // LLAMA_FTYPE_GUESSED
  }
}

bool IsQuantized(DType t) { return kernels::Traits(t).block_elems > 1; }

// Everything a synthetic tensor's rows need; lives until the Write finishes.
struct SynthMatrix {
  uint64_t hash;
  int64_t row_len;
  DType type;
  float std;
};

}  // namespace

uint32_t FileTypeFor(DType type) { return FileTypeForImpl(type); }

std::vector<float> Llama3RopeFactors(const Llama3RopeScaling& r, double base, int64_t head_dim) {
  const double low_wavelen = r.original_context / r.low_freq_factor;
  const double high_wavelen = r.original_context / r.high_freq_factor;
  std::vector<float> out;
  for (int64_t i = 0; i < head_dim; i += 2) {
    const float freq = static_cast<float>(
        1.0 /
        std::pow(base, static_cast<double>(static_cast<float>(i) / static_cast<float>(head_dim))));
    const double wavelen = 2.0 * std::numbers::pi / freq;
    double f;
    if (wavelen < high_wavelen) {
      f = 1.0;
    } else if (wavelen > low_wavelen) {
      f = r.factor;
    } else {
      const double smooth = (r.original_context / wavelen - r.low_freq_factor) /
                            (r.high_freq_factor - r.low_freq_factor);
      f = 1.0 / ((1.0 - smooth) / r.factor + smooth);
    }
    out.push_back(static_cast<float>(f));
  }
  return out;
}

std::vector<std::string> SynthShapeNames() {
  std::vector<std::string> out;
  for (const Shape& s : kShapes) out.emplace_back(s.name);
  return out;
}

// ---------------------------------------------------------------------------------------------

absl::Status ConvertLlama2c(const ConvertLlama2cOptions& options) {
  if (options.model_path.empty() || options.tokenizer_path.empty() || options.out_path.empty()) {
    return absl::InvalidArgumentError("convert llama2c: model, tokenizer and out are required");
  }
  TANDEM_ASSIGN_OR_RETURN(auto model, MappedFile::Open(options.model_path));
  TANDEM_ASSIGN_OR_RETURN(L2cConfig c, ParseL2cHeader(model->bytes(), options.model_path));
  TANDEM_ASSIGN_OR_RETURN(L2cWeights wt, LocateL2cWeights(c, model->bytes(), options.model_path));
  TANDEM_ASSIGN_OR_RETURN(L2cVocab vocab, ReadL2cTokenizer(options.tokenizer_path, c.vocab));

  gguf::GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetString("general.name", FileStem(options.model_path));
  w.SetU32("general.file_type", FileTypeFor(DType::kF32));
  w.SetU32("llama.context_length", static_cast<uint32_t>(c.seq_len));
  w.SetU32("llama.embedding_length", static_cast<uint32_t>(c.dim));
  w.SetU32("llama.feed_forward_length", static_cast<uint32_t>(c.hidden_dim));
  w.SetU32("llama.block_count", static_cast<uint32_t>(c.n_layers));
  w.SetU32("llama.attention.head_count", static_cast<uint32_t>(c.n_heads));
  w.SetU32("llama.attention.head_count_kv", static_cast<uint32_t>(c.n_kv_heads));
  w.SetU32("llama.rope.dimension_count", static_cast<uint32_t>(c.head_size()));
  w.SetF32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.SetF32("llama.rope.freq_base", 10000.0f);
  w.SetU32("llama.vocab_size", static_cast<uint32_t>(c.vocab));
  w.SetString("tokenizer.ggml.model", "llama");
  w.SetStringArray("tokenizer.ggml.tokens", std::move(vocab.tokens));
  w.SetF32Array("tokenizer.ggml.scores", std::move(vocab.scores));
  w.SetI32Array("tokenizer.ggml.token_type", std::move(vocab.types));
  w.SetU32("tokenizer.ggml.unknown_token_id", 0);
  w.SetU32("tokenizer.ggml.bos_token_id", 1);
  w.SetU32("tokenizer.ggml.eos_token_id", 2);
  w.SetBool("tokenizer.ggml.add_bos_token", true);
  w.SetBool("tokenizer.ggml.add_eos_token", false);

  // llama2.c matrices are row-major [out][in], which is GGUF's [in (row), out] layout, and its
  // rotary embedding pairs adjacent elements like GGUF llama's, so weights copy unchanged.
  const int64_t dim = c.dim, hid = c.hidden_dim, kv = c.kv_dim(), V = c.vocab;
  auto add = [&](std::string name, std::vector<int64_t> dims, const float* p) {
    const uint64_t row_bytes = static_cast<uint64_t>(dims[0]) * sizeof(float);
    return AddBorrowed(w, std::move(name), std::move(dims), DType::kF32,
                       reinterpret_cast<const uint8_t*>(p), row_bytes);
  };
  TANDEM_RETURN_IF_ERROR(add("token_embd.weight", {dim, V}, wt.token_embedding));
  TANDEM_RETURN_IF_ERROR(add("output_norm.weight", {dim}, wt.rms_final));
  // Written even when tied (as llama.cpp's own converter does); loaders accept either form.
  TANDEM_RETURN_IF_ERROR(add("output.weight", {dim, V}, wt.wcls));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = Cat("blk.", l, ".");
    TANDEM_RETURN_IF_ERROR(add(p + "attn_q.weight", {dim, dim}, wt.wq + l * dim * dim));
    TANDEM_RETURN_IF_ERROR(add(p + "attn_k.weight", {dim, kv}, wt.wk + l * dim * kv));
    TANDEM_RETURN_IF_ERROR(add(p + "attn_v.weight", {dim, kv}, wt.wv + l * dim * kv));
    TANDEM_RETURN_IF_ERROR(add(p + "attn_output.weight", {dim, dim}, wt.wo + l * dim * dim));
    TANDEM_RETURN_IF_ERROR(add(p + "attn_norm.weight", {dim}, wt.rms_att + l * dim));
    TANDEM_RETURN_IF_ERROR(add(p + "ffn_gate.weight", {dim, hid}, wt.w1 + l * dim * hid));
    TANDEM_RETURN_IF_ERROR(add(p + "ffn_down.weight", {hid, dim}, wt.w2 + l * hid * dim));
    TANDEM_RETURN_IF_ERROR(add(p + "ffn_up.weight", {dim, hid}, wt.w3 + l * dim * hid));
    TANDEM_RETURN_IF_ERROR(add(p + "ffn_norm.weight", {dim}, wt.rms_ffn + l * dim));
  }
  return w.Write(options.out_path);
}

// Synthetic weights. Plain N(0, 1/fan_in) matrices give a network whose hidden state is mostly
// an average over the context: consecutive positions then look alike, the previous greedy
// winner stays on top and decoding falls into repeating one token (more so with tied
// embeddings, where the input embedding itself boosts its own logit). The scales below were
// chosen with a reference forward pass (tests/unit/gguf/model_tools_test.cc) so that greedy
// decoding keeps moving, activations stay bounded and the top-1/top-2 logit gap is far above
// float rounding:
// - matrices ~ N(0, 1/fan_in), so each projection keeps unit-RMS activations;
// - W_q x2: attention scores have std ~2, so each query attends to a few positions chosen by
//   the current token instead of a uniform average;
// - layer 0's attention output x0.3: its FFN then sees mostly the current token, making a
//   strong token-specific component in the residual stream;
// - W_o and W_down of later layers x1/sqrt(n_layers) (GPT-2's residual scaling): the
//   residual stays O(1) and the token-specific part is not swamped by the context;
// - token embeddings ~ N(0, (0.3/sqrt(dim))^2): with tied embeddings a token's own logit gets
//   a boost of about rms(embedding)/rms(final residual) * sqrt(dim) standard deviations, which
//   this keeps near 0.3; still far above the RMSNorm epsilon;
// - norm weights 1 + N(0, 0.05^2), biases N(0, 0.1^2), untied output ~ N(0, 1/dim): logits
//   are ~N(0, 1) per token (top-1/top-2 gap ~0.2 sd for 32k tokens).
absl::Status Synthesize(const SynthOptions& options) {
  const Shape* shape = nullptr;
  for (const Shape& s : kShapes) {
    if (s.name == options.shape) shape = &s;
  }
  if (shape == nullptr) {
    std::string names;
    for (const std::string& n : SynthShapeNames()) names += (names.empty() ? "" : ", ") + n;
    return absl::InvalidArgumentError(
        Cat("unknown synth shape '", options.shape, "' (known: ", names, ")"));
  }
  TANDEM_RETURN_IF_ERROR(CheckWeightType(options.type));
  if (options.out_path.empty()) return absl::InvalidArgumentError("synth: out path is required");
  if (options.vocab_dir.empty()) {
    return absl::InvalidArgumentError("synth: vocab_dir (llama.cpp vocab GGUFs) is required");
  }
  const std::string vocab_path = Cat(options.vocab_dir, "/", shape->vocab_file);
  TANDEM_ASSIGN_OR_RETURN(auto vocab, gguf::GgufFile::Open(vocab_path));
  TANDEM_ASSIGN_OR_RETURN(auto tokens, vocab->GetStringArray("tokenizer.ggml.tokens"));
  const int64_t n_vocab = static_cast<int64_t>(tokens.size());
  if (n_vocab == 0) return absl::InvalidArgumentError(Cat(vocab_path, ": empty vocabulary"));

  const Shape& s = *shape;
  const std::string a(s.arch);
  const int64_t head_dim = s.head_dim > 0 ? s.head_dim : s.dim / s.n_heads;
  const int64_t q_dim = head_dim * s.n_heads, kv_dim = head_dim * s.n_kv_heads;

  gguf::GgufWriter w;
  w.SetString("general.architecture", a);
  w.SetString("general.name",
              Cat("tandem synthetic ", s.name, " (random weights, seed ", options.seed, ")"));
  w.SetString("general.description",
              "Random weights of a real model's shape with a real tokenizer: its text is "
              "gibberish. Made by `tandem synth` for benchmarks and engine comparisons.");
  w.SetU32("general.file_type", FileTypeFor(options.type));
  if (IsQuantized(options.type)) w.SetU32("general.quantization_version", 2);
  w.SetBool("tandem.synthetic", true);
  w.SetString("tandem.synth.shape", std::string(s.name));
  w.SetU64("tandem.synth.seed", options.seed);
  w.SetU32(a + ".context_length", static_cast<uint32_t>(s.context));
  w.SetU32(a + ".embedding_length", static_cast<uint32_t>(s.dim));
  w.SetU32(a + ".block_count", static_cast<uint32_t>(s.n_layers));
  w.SetU32(a + ".feed_forward_length", static_cast<uint32_t>(s.ffn));
  w.SetU32(a + ".attention.head_count", static_cast<uint32_t>(s.n_heads));
  w.SetU32(a + ".attention.head_count_kv", static_cast<uint32_t>(s.n_kv_heads));
  w.SetU32(a + ".attention.key_length", static_cast<uint32_t>(head_dim));
  w.SetU32(a + ".attention.value_length", static_cast<uint32_t>(head_dim));
  w.SetU32(a + ".rope.dimension_count", static_cast<uint32_t>(head_dim));
  w.SetF32(a + ".rope.freq_base", static_cast<float>(s.rope_base));
  w.SetF32(a + ".attention.layer_norm_rms_epsilon", static_cast<float>(s.eps));
  w.SetU32(a + ".vocab_size", static_cast<uint32_t>(n_vocab));
  if (s.n_swa > 0) w.SetU32(a + ".attention.sliding_window", static_cast<uint32_t>(s.n_swa));
  if (s.yarn_factor > 0) {
    w.SetString(a + ".rope.scaling.type", "yarn");
    w.SetF32(a + ".rope.scaling.factor", static_cast<float>(s.yarn_factor));
    w.SetU32(a + ".rope.scaling.original_context_length", static_cast<uint32_t>(s.yarn_ctx_orig));
  }
  if (s.n_expert > 0) {
    w.SetU32(a + ".expert_count", static_cast<uint32_t>(s.n_expert));
    w.SetU32(a + ".expert_used_count", static_cast<uint32_t>(s.n_expert_used));
    if (a != "llama") {
      w.SetU32(a + ".expert_feed_forward_length", static_cast<uint32_t>(s.n_ff_exp));
    }
    if (s.n_ff_shexp > 0) {
      w.SetU32(a + ".expert_shared_feed_forward_length", static_cast<uint32_t>(s.n_ff_shexp));
    }
  }
  for (const gguf::KeyValue& kv : vocab->metadata()) {
    if (kv.key.starts_with("tokenizer.")) w.CopyValue(std::string(kv.key), kv.value);
  }

  // Matrices are generated row by row at Write time; their specs must outlive the Write.
  std::vector<std::unique_ptr<SynthMatrix>> specs;
  std::vector<std::string> f16_fallback;
  util::ThreadPool pool(DefaultThreads());
  const uint64_t seed = options.seed;
  // A matrix, or with n_stack > 1 a 3-D stack of n_stack matrices (MoE experts). The router
  // stays F32 whatever the type, as llama.cpp's converter and quantizer keep it.
  auto add_matrix = [&](std::string name, int64_t row_len, int64_t rows, float std,
                        int64_t n_stack = 1, bool keep_f32 = false) -> absl::Status {
    // MXFP4 as llama.cpp's MXFP4_MOE file type lays it out: experts MXFP4, other matrices Q8_0.
    const bool non_expert_of_mxfp4_moe =
        options.type == DType::kMXFP4 && s.n_expert > 0 && n_stack == 1;
    const DType wanted = non_expert_of_mxfp4_moe ? DType::kQ8_0 : options.type;
    const DType type = keep_f32 ? DType::kF32 : MatrixType(wanted, row_len);
    if (type != wanted && !keep_f32) f16_fallback.push_back(name);
    auto spec = std::make_unique<SynthMatrix>(SynthMatrix{Fnv1a(name), row_len, type, std});
    const SynthMatrix* m = spec.get();
    specs.push_back(std::move(spec));
    const uint64_t row_bytes = kernels::RowBytes(type, row_len);
    std::vector<int64_t> dims = {row_len, rows};
    if (n_stack > 1) dims.push_back(n_stack);
    return w.AddTensorFromSource(
        std::move(name), std::move(dims), type,
        [m, row_bytes, seed, &pool](int64_t r0, int64_t r1, std::span<uint8_t> out) {
          return ParallelRows(pool, r1 - r0, m->row_len, [&](int64_t i, float* row) {
            RowNormal(seed, m->hash, r0 + i).Fill(row, m->row_len, m->std);
            return kernels::QuantizeRow(m->type, row, out.data() + i * row_bytes, m->row_len);
          });
        });
  };
  auto vector_of = [&](const std::string& name, int64_t n, float center, float std) {
    std::vector<float> v(n);
    RowNormal(seed, Fnv1a(name), 0).Fill(v.data(), n, std);
    for (float& x : v) x += center;
    return v;
  };
  auto add_vector = [&](std::string name, int64_t n, float center, float std) {
    return AddF32(w, name, {n}, vector_of(name, n, center, std));
  };

  const float in_std = 1.0f / std::sqrt(static_cast<float>(s.dim));
  const float later_gain = 1.0f / std::sqrt(static_cast<float>(s.n_layers));
  TANDEM_RETURN_IF_ERROR(add_matrix("token_embd.weight", s.dim, n_vocab, kEmbeddingRms * in_std));
  if (s.llama3_rope) {
    TANDEM_RETURN_IF_ERROR(AddF32(w, "rope_freqs.weight", {head_dim / 2},
                                  Llama3RopeFactors(*s.llama3_rope, s.rope_base, head_dim)));
  }
  for (int64_t l = 0; l < s.n_layers; ++l) {
    const std::string p = Cat("blk.", l, ".");
    TANDEM_RETURN_IF_ERROR(add_vector(p + "attn_norm.weight", s.dim, 1.0f, kNormJitter));
    const float out_gain = l == 0 ? kFirstAttnOutGain : later_gain;
    const float down_gain = l == 0 ? 1.0f : later_gain;
    TANDEM_RETURN_IF_ERROR(add_matrix(p + "attn_q.weight", s.dim, q_dim, kQueryGain * in_std));
    TANDEM_RETURN_IF_ERROR(add_matrix(p + "attn_k.weight", s.dim, kv_dim, in_std));
    TANDEM_RETURN_IF_ERROR(add_matrix(p + "attn_v.weight", s.dim, kv_dim, in_std));
    if (s.qkv_bias) {
      TANDEM_RETURN_IF_ERROR(add_vector(p + "attn_q.bias", q_dim, 0.0f, kBiasStd));
      TANDEM_RETURN_IF_ERROR(add_vector(p + "attn_k.bias", kv_dim, 0.0f, kBiasStd));
      TANDEM_RETURN_IF_ERROR(add_vector(p + "attn_v.bias", kv_dim, 0.0f, kBiasStd));
    }
    TANDEM_RETURN_IF_ERROR(add_matrix(p + "attn_output.weight", q_dim, s.dim,
                                      out_gain / std::sqrt(static_cast<float>(q_dim))));
    if (s.qk_norm) {
      TANDEM_RETURN_IF_ERROR(add_vector(p + "attn_q_norm.weight", head_dim, 1.0f, kNormJitter));
      TANDEM_RETURN_IF_ERROR(add_vector(p + "attn_k_norm.weight", head_dim, 1.0f, kNormJitter));
    }
    const bool gpt_oss = a == "gpt-oss";
    const char* ffn_norm = gpt_oss ? "post_attention_norm.weight" : "ffn_norm.weight";
    TANDEM_RETURN_IF_ERROR(add_vector(p + ffn_norm, s.dim, 1.0f, kNormJitter));
    if (gpt_oss) {
      TANDEM_RETURN_IF_ERROR(add_vector(p + "attn_output.bias", s.dim, 0.0f, kBiasStd));
      TANDEM_RETURN_IF_ERROR(add_vector(p + "attn_sinks.weight", s.n_heads, 0.0f, 1.0f));
    }
    if (s.n_expert == 0) {
      TANDEM_RETURN_IF_ERROR(add_matrix(p + "ffn_gate.weight", s.dim, s.ffn, in_std));
      TANDEM_RETURN_IF_ERROR(add_matrix(p + "ffn_up.weight", s.dim, s.ffn, in_std));
      TANDEM_RETURN_IF_ERROR(add_matrix(p + "ffn_down.weight", s.ffn, s.dim,
                                        down_gain / std::sqrt(static_cast<float>(s.ffn))));
      continue;
    }
    // Experts as the dense FFN's matrices, stacked; the router's logits of std kRouterGain.
    const int64_t ff = a == "llama" ? s.ffn : s.n_ff_exp, ne = s.n_expert;
    TANDEM_RETURN_IF_ERROR(add_matrix(p + "ffn_gate_inp.weight", s.dim, ne, kRouterGain * in_std,
                                      1, /*keep_f32=*/true));
    TANDEM_RETURN_IF_ERROR(add_matrix(p + "ffn_gate_exps.weight", s.dim, ff, in_std, ne));
    TANDEM_RETURN_IF_ERROR(add_matrix(p + "ffn_up_exps.weight", s.dim, ff, in_std, ne));
    TANDEM_RETURN_IF_ERROR(add_matrix(p + "ffn_down_exps.weight", ff, s.dim,
                                      down_gain / std::sqrt(static_cast<float>(ff)), ne));
    if (gpt_oss) {
      TANDEM_RETURN_IF_ERROR(add_vector(p + "ffn_gate_inp.bias", ne, 0.0f, kBiasStd));
      for (const char* name : {"ffn_gate_exps.bias", "ffn_up_exps.bias"}) {
        TANDEM_RETURN_IF_ERROR(
            AddF32(w, p + name, {ff, ne}, vector_of(p + name, ff * ne, 0.0f, kBiasStd)));
      }
      const std::string down_b = p + "ffn_down_exps.bias";
      TANDEM_RETURN_IF_ERROR(
          AddF32(w, down_b, {s.dim, ne}, vector_of(down_b, s.dim * ne, 0.0f, kBiasStd)));
    }
    if (s.n_ff_shexp > 0) {
      const int64_t sff = s.n_ff_shexp;
      TANDEM_RETURN_IF_ERROR(add_vector(p + "ffn_gate_inp_shexp.weight", s.dim, 0.0f, in_std));
      TANDEM_RETURN_IF_ERROR(add_matrix(p + "ffn_gate_shexp.weight", s.dim, sff, in_std));
      TANDEM_RETURN_IF_ERROR(add_matrix(p + "ffn_up_shexp.weight", s.dim, sff, in_std));
      TANDEM_RETURN_IF_ERROR(add_matrix(p + "ffn_down_shexp.weight", sff, s.dim,
                                        down_gain / std::sqrt(static_cast<float>(sff))));
    }
  }
  TANDEM_RETURN_IF_ERROR(add_vector("output_norm.weight", s.dim, 1.0f, kNormJitter));
  if (!s.tied_embeddings) {
    TANDEM_RETURN_IF_ERROR(add_matrix("output.weight", s.dim, n_vocab, in_std));
  }
  if (!f16_fallback.empty()) {
    // Matrices whose row length is not a whole number of the type's blocks are stored as F16.
    w.SetStringArray("tandem.synth.f16_fallback_tensors", f16_fallback);
  }
  return w.Write(options.out_path);
}

// Requantisation. Only 2-D ".weight" matrices and 3-D expert stacks change type: norms, biases
// and rope factors are copied as they are. A matrix whose row length is not a whole number of
// the target type's blocks (e.g. 896-wide rows for a 256-element K-quant block) falls back to
// F16, which every row length allows and which loses little.
absl::Status QuantizeModel(const std::string& in_path, const std::string& out_path, DType type) {
  TANDEM_RETURN_IF_ERROR(CheckWeightType(type));
  TANDEM_ASSIGN_OR_RETURN(auto in, gguf::GgufFile::Open(in_path));
  gguf::GgufWriter w;
  for (const gguf::KeyValue& kv : in->metadata()) {
    if (kv.key == "general.alignment") continue;  // re-created by Write from the alignment
    if (kv.key.ends_with(".f16_fallback_tensors")) continue;  // describes the old types
    w.CopyValue(std::string(kv.key), kv.value);
  }
  w.SetU32("general.file_type", FileTypeFor(type));
  if (IsQuantized(type)) w.SetU32("general.quantization_version", 2);

  util::ThreadPool pool(DefaultThreads());
  std::vector<std::string> f16_fallback;
  // MXFP4 on an MoE file is llama.cpp's MXFP4_MOE: experts MXFP4, other matrices Q8_0.
  bool moe = false;
  for (const gguf::TensorInfo& t : in->tensors()) moe = moe || t.dims.size() == 3;
  for (const gguf::TensorInfo& t : in->tensors()) {
    const uint64_t src_row_bytes = kernels::RowBytes(t.type, t.dims[0]);
    // Matrices and stacks of expert matrices; the MoE router keeps its type (llama.cpp's
    // quantizer leaves ffn_gate_inp alone too).
    const bool is_matrix = (t.dims.size() == 2 || t.dims.size() == 3) &&
                           std::string_view(t.name).ends_with(".weight") &&
                           !std::string_view(t.name).ends_with("ffn_gate_inp.weight");
    const DType wanted =
        type == DType::kMXFP4 && moe && t.dims.size() == 2 ? DType::kQ8_0 : type;
    const DType dst = is_matrix ? MatrixType(wanted, t.dims[0]) : t.type;
    if (is_matrix && dst != wanted) f16_fallback.emplace_back(t.name);
    if (dst == t.type) {
      TANDEM_RETURN_IF_ERROR(
          AddBorrowed(w, std::string(t.name), t.dims, t.type, t.data, src_row_bytes));
      continue;
    }
    const uint64_t dst_row_bytes = kernels::RowBytes(dst, t.dims[0]);
    const gguf::TensorInfo* src = &t;
    TANDEM_RETURN_IF_ERROR(w.AddTensorFromSource(
        std::string(t.name), t.dims, dst,
        [src, dst, src_row_bytes, dst_row_bytes, &pool](int64_t r0, int64_t r1,
                                                        std::span<uint8_t> out) {
          const int64_t n = src->dims[0];
          return ParallelRows(pool, r1 - r0, n, [&](int64_t i, float* row) {
            kernels::DequantizeRow(src->type, src->data + (r0 + i) * src_row_bytes, row, n);
            return kernels::QuantizeRow(dst, row, out.data() + i * dst_row_bytes, n);
          });
        }));
  }
  if (!f16_fallback.empty()) {
    w.SetStringArray("tandem.quantize.f16_fallback_tensors", f16_fallback);
  }
  return w.Write(out_path, in->alignment());
}

}  // namespace tandem::tools
