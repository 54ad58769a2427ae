// Times each CUDA kernel on representative decode/prefill shapes and prints a table of time,
// effective bandwidth (bytes a kernel must move at least once / time) and that bandwidth as a
// share of the measured device-to-device copy bandwidth (cudaMemcpy D2D, read + write). GEMMs
// and prefill attention report TFLOP/s instead. No timing is asserted: this is the report that
// `make gpu-check` prints (docs/perf/cuda.md). Usage: cuda_kernel_bench [--out FILE] [--quick]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tandem/cuda/attention.h"
#include "tandem/cuda/cuda_common.h"
#include "tandem/cuda/elementwise.h"
#include "tandem/cuda/kv_blocks.h"
#include "tandem/cuda/matmul.h"
#include "tandem/cuda/sampling.h"
#include "tandem/kernels/dtype.h"
#include "tandem/kernels/kv_quant.h"
#include "tandem/kernels/quant.h"

namespace tandem::kernels::cuda {
namespace {

#define BENCH_CHECK(expr)                                                          \
  do {                                                                             \
    const cudaError_t _e = (expr);                                                 \
    if (_e != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr,            \
                   cudaGetErrorString(_e));                                        \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// Device allocation freed at exit of the scope; filled with a finite pattern.
struct Buf {
  explicit Buf(size_t bytes, int pattern = 0x3c) : bytes(bytes) {
    BENCH_CHECK(cudaMalloc(&ptr, std::max<size_t>(bytes, 16)));
    BENCH_CHECK(cudaMemset(ptr, pattern, bytes));
  }
  ~Buf() { cudaFree(ptr); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
  void* ptr = nullptr;
  size_t bytes;
};

template <typename T>
void Upload(const Buf& b, const std::vector<T>& v) {
  BENCH_CHECK(cudaMemcpy(b.ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}

// Mean milliseconds per call of fn over `iters` calls after a warm-up.
double TimeMs(const std::function<void()>& fn, int iters) {
  for (int i = 0; i < 3; ++i) fn();
  cudaEvent_t a, b;
  BENCH_CHECK(cudaEventCreate(&a));
  BENCH_CHECK(cudaEventCreate(&b));
  BENCH_CHECK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) fn();
  BENCH_CHECK(cudaEventRecord(b));
  BENCH_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  BENCH_CHECK(cudaEventElapsedTime(&ms, a, b));
  BENCH_CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / iters;
}

struct Table {
  std::string text;
  double copy_gbs = 0;
  void Row(const std::string& name, const std::string& shape, double ms, double bytes,
           double flops = 0) {
    char line[512];
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    if (flops > 0) {
      std::snprintf(line, sizeof line, "| %-24s | %-34s | %10.1f | %9s | %7s | %8.1f TFLOP/s |\n",
                    name.c_str(), shape.c_str(), ms * 1e3, "-", "-", flops / (ms * 1e-3) / 1e12);
    } else {
      std::snprintf(line, sizeof line, "| %-24s | %-34s | %10.1f | %9.0f | %6.0f%% | %15s |\n",
                    name.c_str(), shape.c_str(), ms * 1e3, gbs,
                    copy_gbs > 0 ? 100.0 * gbs / copy_gbs : 0.0, "-");
    }
    text += line;
    std::fputs(line, stdout);
    std::fflush(stdout);
  }
};

void BenchDecode(Table& t, int n_seqs, int ctx, int n_head, int n_kv, int head_dim, int iters,
                 DType kv = DType::kF16) {
  const int bs = 16, max_blocks = (ctx + bs - 1) / bs, num_blocks = n_seqs * max_blocks;
  const size_t slot_bytes = IsQuantizedKvType(kv) ? KvQuantSlotBytes(n_kv, head_dim)
                                                  : size_t(n_kv) * head_dim * 2;
  const size_t kv_bytes = size_t(num_blocks) * bs * slot_bytes;
  Buf k(kv_bytes), v(kv_bytes), q(size_t(n_seqs) * n_head * head_dim * 4),
      out(size_t(n_seqs) * n_head * head_dim * 4), lens(n_seqs * 4),
      tables(size_t(num_blocks) * 4);
  std::vector<int32_t> table(num_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(1));  // scattered, as in a real pool
  Upload(tables, table);
  Upload(lens, std::vector<int32_t>(n_seqs, ctx));
  DecodeAttentionParams p;
  p.q = q.as<float>();
  p.q_stride = int64_t{n_head} * head_dim;
  p.n_seqs = n_seqs;
  p.seq_lens = lens.as<int32_t>();
  p.max_seq_len = ctx;
  p.n_head = n_head;
  p.n_kv_head = n_kv;
  p.head_dim = head_dim;
  p.scale = 0.088f;
  p.kv_type = kv;
  p.k_cache = k.ptr;
  p.v_cache = v.ptr;
  p.block_size = bs;
  p.block_tables = tables.as<int32_t>();
  p.max_blocks_per_seq = max_blocks;
  p.out = out.as<float>();
  p.out_stride = p.q_stride;
  auto ws_bytes = DecodeAttentionWorkspaceBytes(p);
  Check(ws_bytes.status(), "workspace");
  Buf ws(*ws_bytes);
  p.workspace = ws.ptr;
  p.workspace_bytes = *ws_bytes;
  const double ms = TimeMs([&] { Check(PagedDecodeAttention(p, nullptr), "decode"); }, iters);
  char shape[96];
  std::snprintf(shape, sizeof shape, "%dx%d ctx, %d/%d heads, d%d %s", n_seqs, ctx, n_head,
                n_kv, head_dim, std::string(KvTypeName(kv)).c_str());
  t.Row("paged decode attention", shape, ms, 2.0 * kv_bytes);
}

void BenchPrefill(Table& t, int n_q, int n_head, int n_kv, int head_dim, int iters) {
  const int bs = 16, nb = (n_q + bs - 1) / bs;
  const size_t kv_bytes = size_t(nb) * bs * n_kv * head_dim * 2;
  Buf k(kv_bytes), v(kv_bytes), q(size_t(n_q) * n_head * head_dim * 4),
      out(size_t(n_q) * n_head * head_dim * 4), pos(n_q * 4), table(nb * 4);
  std::vector<int32_t> pv(n_q), tv(nb);
  std::iota(pv.begin(), pv.end(), 0);
  std::iota(tv.begin(), tv.end(), 0);
  Upload(pos, pv);
  Upload(table, tv);
  PrefillAttentionParams p;
  p.q = q.as<float>();
  p.q_stride = int64_t{n_head} * head_dim;
  p.n_q = n_q;
  p.q_pos = pos.as<int32_t>();
  p.max_pos = n_q - 1;
  p.n_head = n_head;
  p.n_kv_head = n_kv;
  p.head_dim = head_dim;
  p.scale = 0.088f;
  p.kv_type = DType::kF16;
  p.k_cache = k.ptr;
  p.v_cache = v.ptr;
  p.block_size = bs;
  p.block_table = table.as<int32_t>();
  p.out = out.as<float>();
  p.out_stride = p.q_stride;
  const double ms = TimeMs([&] { Check(PagedPrefillAttention(p, nullptr), "prefill"); }, iters);
  char shape[96];
  std::snprintf(shape, sizeof shape, "%d tokens causal, %d/%d heads, d%d", n_q, n_head, n_kv,
                head_dim);
  // Causal: half of the n_q x n_q score matrix, two matmuls of 2 flops per multiply-add.
  const double flops = 2.0 * 2.0 * n_head * head_dim * double(n_q) * n_q / 2;
  t.Row("paged prefill attention", shape, ms, 0, flops);
}

void BenchGemv(Table& t, DType type, int64_t rows, int64_t cols, int iters) {
  const size_t wbytes = RowBytes(type, cols) * rows;
  // Valid blocks: quantise one random row and repeat it (scales must be finite).
  std::vector<float> rowf(cols);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (auto& x : rowf) x = nd(rng);
  std::vector<uint8_t> row(RowBytes(type, cols));
  Check(QuantizeRow(type, rowf.data(), row.data(), cols), "quantise");
  Buf w(wbytes), x(cols * 4), y(rows * 4);
  for (int64_t r = 0; r < rows; ++r) {
    BENCH_CHECK(cudaMemcpy(w.as<uint8_t>() + r * row.size(), row.data(), row.size(),
                           cudaMemcpyHostToDevice));
  }
  GemvParams p;
  p.weight_type = type;
  p.weight = w.ptr;
  p.rows = rows;
  p.cols = cols;
  p.input = x.as<float>();
  p.output = y.as<float>();
  const double ms = TimeMs([&] { Check(QuantGemv(p, nullptr), "gemv"); }, iters);
  char name[64], shape[96];
  std::snprintf(name, sizeof name, "gemv %s", std::string(Traits(type).name).c_str());
  std::snprintf(shape, sizeof shape, "%lldx%lld, batch 1", (long long)rows, (long long)cols);
  t.Row(name, shape, ms, double(wbytes));
}

void BenchGemm(Table& t, bool fp8, int64_t rows, int64_t cols, int64_t batch, int iters) {
  auto gemm = CublasLtGemm::Create();
  Check(gemm.status(), "cublasLt");
  const size_t e = fp8 ? 1 : 2;
  Buf w(rows * cols * e, fp8 ? 0x30 : 0x3c), x(batch * cols * e, fp8 ? 0x30 : 0x3c),
      out(batch * rows * 4), scales(8);
  std::vector<float> one = {1.0f, 1.0f};
  Upload(scales, one);
  const double ms = TimeMs(
      [&] {
        if (fp8) {
          Check((*gemm)->Fp8(w.as<uint8_t>(), scales.as<float>(), x.as<uint8_t>(),
                             scales.as<float>() + 1, out.as<float>(), rows, cols, batch, nullptr),
                "fp8 gemm");
        } else {
          Check((*gemm)->Bf16(w.as<uint16_t>(), x.as<uint16_t>(), out.as<float>(), rows, cols,
                              batch, nullptr),
                "bf16 gemm");
        }
      },
      iters);
  char shape[96];
  std::snprintf(shape, sizeof shape, "%lldx%lld x batch %lld", (long long)rows, (long long)cols,
                (long long)batch);
  t.Row(fp8 ? "cuBLASLt gemm fp8" : "cuBLASLt gemm bf16", shape, ms, 0,
        2.0 * rows * cols * batch);
}

int Main(int argc, char** argv) {
  const char* out_path = nullptr;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      out_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::printf(
          "cuda_kernel_bench: times every CUDA kernel against the measured device-to-device "
          "copy bandwidth and prints a markdown table\n"
          "usage: cuda_kernel_bench [--out FILE] [--quick]\n");
      return 0;
    } else {
      std::fprintf(stderr, "cuda_kernel_bench: unknown argument %s (see --help)\n", argv[i]);
      return 2;
    }
  }
  if (VisibleDeviceCount() == 0) {
    std::fprintf(stderr, "cuda_kernel_bench: no CUDA device\n");
    return 2;
  }
  auto dev = CurrentDevice();
  Check(dev.status(), "device");
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, dev->ordinal));
  const int iters = quick ? 5 : 20;
  Table t;
  char head[512];
  std::snprintf(head, sizeof head, "device: %s (sm_%d%d, %d SMs)\n\n", prop.name, dev->sm_major,
                dev->sm_minor, dev->num_sms);
  t.text += head;
  std::fputs(head, stdout);
  const char* hdr =
      "| kernel                   | shape                              |  time (us) |      GB/s | of D2D  |   compute       |\n"
      "|--------------------------|------------------------------------|------------|-----------|---------|-----------------|\n";
  t.text += hdr;
  std::fputs(hdr, stdout);

  {  // Reference bandwidth: a D2D copy reads and writes every byte.
    const size_t bytes = size_t{1} << 30;
    Buf a(bytes), b(bytes);
    const double ms = TimeMs(
        [&] { BENCH_CHECK(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice)); },
        iters);
    t.copy_gbs = 2.0 * bytes / (ms * 1e-3) / 1e9;
    t.Row("cudaMemcpy D2D", "1 GiB", ms, 2.0 * bytes);
  }
  BenchDecode(t, 64, 4096, 32, 8, 128, iters);  // Llama-3-8B-like batch
  BenchDecode(t, 8, 32768, 32, 8, 128, iters);  // long context: split-K
  BenchDecode(t, 1, 32768, 32, 8, 128, iters);
  BenchDecode(t, 64, 2048, 14, 2, 64, iters);   // Qwen2-0.5B-like
  BenchDecode(t, 64, 4096, 32, 8, 128, iters, DType::kFp8E4M3);
  BenchDecode(t, 64, 4096, 32, 8, 128, iters, DType::kI8);
  BenchPrefill(t, 4096, 32, 8, 128, quick ? 2 : 5);
  for (DType type : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kMXFP4}) {
    BenchGemv(t, type, 14336, 4096, iters);
  }
  BenchGemm(t, false, 4096, 4096, 2048, iters);
  if (CublasLtGemm::DeviceHasFp8(*dev)) BenchGemm(t, true, 4096, 4096, 2048, iters);
  {
    const int64_t rows = 4096, n = 4096;
    Buf x(rows * n * 4), w(n * 4);
    const double ms = TimeMs(
        [&] {
          Check(RmsNorm(x.as<float>(), w.as<float>(), x.as<float>(), rows, n, 0, 1e-5f, nullptr),
                "rmsnorm");
        },
        iters);
    t.Row("rmsnorm", "4096 x 4096 f32", ms, 2.0 * rows * n * 4);
  }
  {
    const int64_t tokens = 4096, heads = 32, d = 128;
    Buf x(tokens * heads * d * 4, 0), pos(tokens * 4, 0);
    RopeParams rp;
    rp.head_dim = d;
    rp.n_rot = d;
    const double ms = TimeMs(
        [&] { Check(Rope(rp, x.as<float>(), tokens, 0, heads, pos.as<int32_t>(), nullptr), "rope"); },
        iters);
    t.Row("rope", "4096 tok x 32 heads x 128", ms, 2.0 * tokens * heads * d * 4);
  }
  {
    const int64_t n = int64_t{64} << 20;
    Buf g(n * 4), u(n * 4);
    const double ms = TimeMs(
        [&] { Check(SwiGlu(g.as<float>(), u.as<float>(), g.as<float>(), n, nullptr), "swiglu"); },
        iters);
    t.Row("swiglu", "64M f32", ms, 3.0 * n * 4);
  }
  {  // One request's KV for a transfer: 32 layers x K,V x 128 blocks of 16 slots x 8 x 128 f16.
    const int32_t regions = 64, nblk = 128, pool = 1024;
    const size_t block_bytes = 16 * 8 * 128 * 2, stride = size_t(pool) * block_bytes;
    Buf cache(stride * regions), packed(size_t(regions) * nblk * block_bytes), ids(nblk * 4);
    std::vector<int32_t> iv(pool);
    std::iota(iv.begin(), iv.end(), 0);
    std::shuffle(iv.begin(), iv.end(), std::mt19937(2));
    iv.resize(nblk);
    Upload(ids, iv);
    KvPackParams p{stride, regions, block_bytes, ids.as<int32_t>(), nblk};
    const double ms = TimeMs(
        [&] { Check(PackKvBlocks(p, cache.ptr, packed.ptr, nullptr), "pack"); }, iters);
    t.Row("kv block pack", "64 regions x 128 blocks x 32 KiB", ms, 2.0 * KvPackedBytes(p));
  }
  {
    const int32_t tokens = 4096, nkv = 8, d = 128;
    Buf k(size_t(tokens) * nkv * d * 4, 0), v(size_t(tokens) * nkv * d * 4, 0),
        slots(tokens * 8), kc(size_t(tokens) * (nkv * d + 4 * nkv)),
        vc(size_t(tokens) * (nkv * d + 4 * nkv));
    std::vector<int64_t> sv(tokens);
    std::iota(sv.begin(), sv.end(), 0);
    Upload(slots, sv);
    KvWriteParams p;
    p.k = k.as<float>();
    p.v = v.as<float>();
    p.n_tokens = tokens;
    p.slot_mapping = slots.as<int64_t>();
    p.n_kv_head = nkv;
    p.head_dim = d;
    p.type = DType::kFp8E4M3;
    p.k_cache = kc.ptr;
    p.v_cache = vc.ptr;
    const double ms = TimeMs([&] { Check(WriteKv(p, nullptr), "kv write"); }, iters);
    t.Row("kv write fp8", "4096 tok x 8 x 128", ms, 2.0 * tokens * nkv * d * 5);
  }
  {
    const int32_t rows = 64, vocab = 128256;
    Buf l(size_t(rows) * vocab * 4, 0x3c), temp(rows * 4), k(rows * 4), pp(rows * 4),
        u(rows * 4), out(rows * 4);
    Upload(temp, std::vector<float>(rows, 0.8f));
    Upload(k, std::vector<int32_t>(rows, 50));
    Upload(pp, std::vector<float>(rows, 0.9f));
    Upload(u, std::vector<float>(rows, 0.5f));
    SampleParams p;
    p.logits = l.as<float>();
    p.n_rows = rows;
    p.vocab = vocab;
    p.temperature = temp.as<float>();
    p.top_k = k.as<int32_t>();
    p.top_p = pp.as<float>();
    p.u = u.as<float>();
    p.out = out.as<int32_t>();
    const double ms = TimeMs([&] { Check(SampleTopKTopP(p, nullptr), "sample"); }, iters);
    t.Row("top-k/top-p sample", "64 rows x 128256 vocab", ms, double(rows) * vocab * 4);
  }
  if (out_path != nullptr) {
    FILE* f = std::fopen(out_path, "w");
    if (f == nullptr) {
      std::perror(out_path);
      return 1;
    }
    std::fputs(t.text.c_str(), f);
    std::fclose(f);
  }
  return 0;
}

}  // namespace
}  // namespace tandem::kernels::cuda

int main(int argc, char** argv) { return tandem::kernels::cuda::Main(argc, argv); }
