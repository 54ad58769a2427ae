// Every CUDA kernel against its CPU reference on random data (label gpu). Each case skips
// cleanly when no device is visible, so the binary builds and passes on GPU-less CI machines.
// Output buffers are poisoned (NaN floats, 0xCD bytes) before the kernel runs.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/cuda/attention.h"
#include "tandem/cuda/cuda_common.h"
#include "tandem/cuda/elementwise.h"
#include "tandem/cuda/kv_blocks.h"
#include "tandem/cuda/matmul.h"
#include "tandem/cuda/sampling.h"
#include "tandem/kernels/activation.h"
#include "tandem/kernels/attention.h"
#include "tandem/kernels/fp16.h"
#include "tandem/kernels/kv_pack.h"
#include "tandem/kernels/kv_quant.h"
#include "tandem/kernels/matmul.h"
#include "tandem/kernels/norm.h"
#include "tandem/kernels/quant.h"
#include "tandem/kernels/rope.h"
#include "tandem/kernels/topk_topp.h"
#include "tests/unit/kernels/kernel_test_util.h"

namespace tandem::kernels {
namespace {

using testing::RandomBlockScaled;
using testing::RandomNormal;

#define SKIP_WITHOUT_DEVICE()                                                 \
  do {                                                                        \
    if (cuda::VisibleDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";    \
  } while (0)

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr
#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status _st = (expr);             \
    ASSERT_TRUE(_st.ok()) << _st.ToString();     \
  } while (0)

// Device memory holding a copy of a host vector (or `n` poisoned bytes).
template <typename T>
class DeviceVec {
 public:
  explicit DeviceVec(const std::vector<T>& host) : n_(host.size()) {
    cudaMalloc(&ptr_, std::max<size_t>(bytes(), 16));
    cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice);
  }
  explicit DeviceVec(size_t n) : n_(n) {
    cudaMalloc(&ptr_, std::max<size_t>(bytes(), 16));
    cudaMemset(ptr_, 0xCD, bytes());  // NaN as float, an odd pattern as bytes
  }
  ~DeviceVec() { cudaFree(ptr_); }
  DeviceVec(const DeviceVec&) = delete;
  DeviceVec& operator=(const DeviceVec&) = delete;
  T* get() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return n_ * sizeof(T); }
  std::vector<T> Download() const {
    std::vector<T> out(n_);
    cudaDeviceSynchronize();
    cudaMemcpy(out.data(), ptr_, bytes(), cudaMemcpyDeviceToHost);
    return out;
  }

 private:
  size_t n_;
  void* ptr_ = nullptr;
};

void ExpectNoCudaError() {
  const cudaError_t e = cudaDeviceSynchronize();
  ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
}

// ---- attention ------------------------------------------------------------------------------

struct PagedCache {
  std::vector<uint8_t> k, v;  // one layer's regions
  int64_t block_size, n_kv_head, head_dim, num_blocks;
  DType type;
};

PagedCache RandomCache(DType type, int64_t num_blocks, int64_t block_size, int64_t n_kv_head,
                       int64_t head_dim, uint32_t seed) {
  PagedCache c{{}, {}, block_size, n_kv_head, head_dim, num_blocks, type};
  const int64_t n = num_blocks * block_size * n_kv_head * head_dim;
  const auto kf = RandomNormal(n, seed), vf = RandomNormal(n, seed + 1);
  if (IsQuantizedKvType(type)) {
    const int64_t slots = num_blocks * block_size, row = n_kv_head * head_dim;
    const int64_t slot_bytes = KvQuantSlotBytes(n_kv_head, head_dim);
    c.k.resize(slots * slot_bytes);
    c.v.resize(slots * slot_bytes);
    for (int64_t s = 0; s < slots; ++s) {
      QuantizeKvSlot(type, kf.data() + s * row, n_kv_head, head_dim, c.k.data() + s * slot_bytes);
      QuantizeKvSlot(type, vf.data() + s * row, n_kv_head, head_dim, c.v.data() + s * slot_bytes);
    }
    return c;
  }
  const size_t elem = type == DType::kF16 ? 2 : 4;
  c.k.resize(n * elem);
  c.v.resize(n * elem);
  if (type == DType::kF16) {
    F32ToFp16Row(kf.data(), reinterpret_cast<uint16_t*>(c.k.data()), n);
    F32ToFp16Row(vf.data(), reinterpret_cast<uint16_t*>(c.v.data()), n);
  } else {
    std::memcpy(c.k.data(), kf.data(), n * 4);
    std::memcpy(c.v.data(), vf.data(), n * 4);
  }
  return c;
}

struct DecodeCase {
  DType type;
  int head_dim, n_head, n_kv_head;
  std::vector<int32_t> lens;
  int keys_per_split;
};

TEST(CudaAttentionTest, PagedDecodeMatchesReference) {
  SKIP_WITHOUT_DEVICE();
  const DecodeCase cases[] = {
      {DType::kF16, 128, 32, 8, {1, 17, 300, 2049}, 0},
      {DType::kF16, 64, 14, 2, {5, 1000, 3001}, 0},    // group 7
      {DType::kF16, 128, 24, 2, {700, 64}, 128},       // group 12: two CTAs per KV head
      {DType::kF32, 128, 8, 8, {33, 900}, 256},        // no GQA, f32, forced splits
      {DType::kF32, 64, 16, 4, {1, 2, 3, 4000}, 0},
      {DType::kF16, 256, 8, 1, {129, 513}, 0},
      {DType::kI8, 128, 32, 8, {1, 300, 2049}, 0},   // quantised caches (kv_quant.h layout)
      {DType::kFp8E4M3, 64, 14, 2, {77, 1500}, 256},
      {DType::kI8, 32, 4, 4, {3, 40}, 0},             // slot of 4*32 codes + 16 bytes of scales
  };
  uint32_t seed = 100;
  for (const DecodeCase& dc : cases) {
    const int block_size = 16;
    const int n_seqs = static_cast<int>(dc.lens.size());
    const int max_len = *std::max_element(dc.lens.begin(), dc.lens.end());
    const int max_blocks = (max_len + block_size - 1) / block_size;
    const int num_blocks = max_blocks * n_seqs + 3;
    const PagedCache c =
        RandomCache(dc.type, num_blocks, block_size, dc.n_kv_head, dc.head_dim, seed++);
    // Each sequence gets a shuffled, disjoint set of blocks.
    std::vector<int32_t> perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(seed++));
    std::vector<int32_t> tables(size_t(n_seqs) * max_blocks);
    for (size_t i = 0; i < tables.size(); ++i) tables[i] = perm[i];
    const int64_t row = int64_t{dc.n_head} * dc.head_dim;
    const auto q = RandomNormal(n_seqs * row, seed++);
    const float scale = 1.0f / std::sqrt(float(dc.head_dim));

    std::vector<float> ref(n_seqs * row);
    for (int s = 0; s < n_seqs; ++s) {
      PagedAttentionParams p;
      p.q = q.data() + s * row;
      p.q_stride = row;
      p.n_q = 1;
      const int32_t pos = dc.lens[s] - 1;
      p.q_pos = &pos;
      p.n_head = dc.n_head;
      p.n_kv_head = dc.n_kv_head;
      p.head_dim = dc.head_dim;
      p.scale = scale;
      p.kv_type = dc.type;
      p.k_cache = c.k.data();
      p.v_cache = c.v.data();
      p.block_size = block_size;
      p.block_table = tables.data() + s * max_blocks;
      p.out = ref.data() + s * row;
      p.out_stride = row;
      PagedAttentionReference(p);
    }

    DeviceVec<uint8_t> dk(c.k), dv(c.v);
    DeviceVec<float> dq(q), dout(n_seqs * row);
    DeviceVec<int32_t> dlens(dc.lens), dtables(tables);
    cuda::DecodeAttentionParams p;
    p.q = dq.get();
    p.q_stride = row;
    p.n_seqs = n_seqs;
    p.seq_lens = dlens.get();
    p.max_seq_len = max_len;
    p.n_head = dc.n_head;
    p.n_kv_head = dc.n_kv_head;
    p.head_dim = dc.head_dim;
    p.scale = scale;
    p.kv_type = dc.type;
    p.k_cache = dk.get();
    p.v_cache = dv.get();
    p.block_size = block_size;
    p.block_tables = dtables.get();
    p.max_blocks_per_seq = max_blocks;
    p.out = dout.get();
    p.out_stride = row;
    p.keys_per_split = dc.keys_per_split;
    auto ws_bytes = cuda::DecodeAttentionWorkspaceBytes(p);
    ASSERT_TRUE(ws_bytes.ok()) << ws_bytes.status();
    if (dc.keys_per_split > 0 && max_len > dc.keys_per_split) {
      ASSERT_GT(*ws_bytes, 0u) << "a forced split must use the workspace";
    }
    DeviceVec<uint8_t> ws(*ws_bytes);
    p.workspace = ws.get();
    p.workspace_bytes = *ws_bytes;
    ASSERT_OK(cuda::PagedDecodeAttention(p, nullptr));
    ExpectNoCudaError();
    const auto got = dout.Download();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], ref[i], 2e-4 + 2e-4 * std::fabs(ref[i]))
          << "head_dim " << dc.head_dim << " group " << dc.n_head / dc.n_kv_head << " seq "
          << i / row << " elem " << i % row;
    }
  }
}

TEST(CudaAttentionTest, PagedDecodeRejectsUnsupportedHeadDim) {
  SKIP_WITHOUT_DEVICE();
  cuda::DecodeAttentionParams p;
  p.n_seqs = 1;
  p.max_seq_len = 1;
  p.n_head = p.n_kv_head = 1;
  p.head_dim = 96;  // 12 vectors of 16 bytes: not a power of two
  p.max_blocks_per_seq = 1;
  alignas(16) static uint8_t dummy[16];
  p.k_cache = p.v_cache = dummy;
  EXPECT_EQ(cuda::PagedDecodeAttention(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaAttentionTest, PagedPrefillWithCachedPrefixMatchesReference) {
  SKIP_WITHOUT_DEVICE();
  struct Case {
    DType type;
    int head_dim, n_head, n_kv_head, prefix, n_new;
  };
  const Case cases[] = {
      {DType::kF16, 128, 8, 2, 37, 50},
      {DType::kF32, 64, 4, 4, 0, 33},
      {DType::kF16, 64, 14, 2, 100, 17},
      {DType::kF16, 256, 4, 1, 5, 20},
      {DType::kI8, 64, 8, 2, 21, 30},
      {DType::kFp8E4M3, 128, 4, 4, 16, 16},
  };
  uint32_t seed = 300;
  for (const Case& pc : cases) {
    const int block_size = 16;
    const int total = pc.prefix + pc.n_new;
    const int n_blocks = (total + block_size - 1) / block_size;
    const PagedCache c =
        RandomCache(pc.type, n_blocks + 4, block_size, pc.n_kv_head, pc.head_dim, seed++);
    std::vector<int32_t> table(n_blocks + 4);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(seed++));
    table.resize(n_blocks);
    const int64_t row = int64_t{pc.n_head} * pc.head_dim;
    const auto q = RandomNormal(pc.n_new * row, seed++);
    std::vector<int32_t> pos(pc.n_new);
    std::iota(pos.begin(), pos.end(), pc.prefix);
    const float scale = 1.0f / std::sqrt(float(pc.head_dim));

    std::vector<float> ref(pc.n_new * row);
    PagedAttentionParams rp;
    rp.q = q.data();
    rp.q_stride = row;
    rp.n_q = pc.n_new;
    rp.q_pos = pos.data();
    rp.n_head = pc.n_head;
    rp.n_kv_head = pc.n_kv_head;
    rp.head_dim = pc.head_dim;
    rp.scale = scale;
    rp.kv_type = pc.type;
    rp.k_cache = c.k.data();
    rp.v_cache = c.v.data();
    rp.block_size = block_size;
    rp.block_table = table.data();
    rp.out = ref.data();
    rp.out_stride = row;
    PagedAttentionReference(rp);

    DeviceVec<uint8_t> dk(c.k), dv(c.v);
    DeviceVec<float> dq(q), dout(pc.n_new * row);
    DeviceVec<int32_t> dpos(pos), dtable(table);
    cuda::PrefillAttentionParams p;
    p.q = dq.get();
    p.q_stride = row;
    p.n_q = pc.n_new;
    p.q_pos = dpos.get();
    p.max_pos = total - 1;
    p.n_head = pc.n_head;
    p.n_kv_head = pc.n_kv_head;
    p.head_dim = pc.head_dim;
    p.scale = scale;
    p.kv_type = pc.type;
    p.k_cache = dk.get();
    p.v_cache = dv.get();
    p.block_size = block_size;
    p.block_table = dtable.get();
    p.out = dout.get();
    p.out_stride = row;
    ASSERT_OK(cuda::PagedPrefillAttention(p, nullptr));
    ExpectNoCudaError();
    const auto got = dout.Download();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], ref[i], 2e-4 + 2e-4 * std::fabs(ref[i]))
          << "head_dim " << pc.head_dim << " row " << i / row << " elem " << i % row;
    }
  }
}

// ---- norm, rope, swiglu ---------------------------------------------------------------------

TEST(CudaElementwiseTest, RmsNormMatchesReference) {
  SKIP_WITHOUT_DEVICE();
  for (int64_t n : {64, 896, 4096, 5003}) {
    const int64_t rows = 3;
    const auto x = RandomNormal(rows * n, uint32_t(n), 3.0f);
    const auto w = RandomNormal(n, uint32_t(n + 1));
    std::vector<float> ref(rows * n);
    for (int64_t r = 0; r < rows; ++r) {
      RmsNormReference(x.data() + r * n, w.data(), ref.data() + r * n, n, 1e-5f);
    }
    DeviceVec<float> dx(x), dw(w), dout(rows * n);
    ASSERT_OK(cuda::RmsNorm(dx.get(), dw.get(), dout.get(), rows, n, 0, 1e-5f, nullptr));
    const auto got = dout.Download();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], ref[i], 1e-5 * std::fabs(ref[i]) + 1e-6) << n << " " << i;
    }
  }
}

TEST(CudaElementwiseTest, RopeMatchesReference) {
  SKIP_WITHOUT_DEVICE();
  for (RopeMode mode : {RopeMode::kNormal, RopeMode::kNeox}) {
    for (bool factors : {false, true}) {
      RopeParams p;
      p.mode = mode;
      p.head_dim = 128;
      p.n_rot = 128;
      p.freq_base = 500000.0f;
      p.freq_scale = 1.0f;
      const int64_t n_heads = 6, n_tokens = 9;
      std::vector<float> ff(p.n_rot / 2);
      for (size_t i = 0; i < ff.size(); ++i) ff[i] = 1.0f + 0.1f * float(i % 7);
      const std::vector<int32_t> pos = {0, 1, 2, 17, 100, 511, 512, 999, 1000};
      const auto x = RandomNormal(n_tokens * n_heads * p.head_dim, 77);
      std::vector<float> ref = x;
      RopeParams rp = p;
      rp.freq_factors = factors ? ff.data() : nullptr;
      for (int64_t t = 0; t < n_tokens; ++t) {
        RopeReference(rp, ref.data() + t * n_heads * p.head_dim, n_heads, pos[t]);
      }
      DeviceVec<float> dx(x), dff(ff);
      DeviceVec<int32_t> dpos(pos);
      p.freq_factors = factors ? dff.get() : nullptr;
      ASSERT_OK(cuda::Rope(p, dx.get(), n_tokens, 0, n_heads, dpos.get(), nullptr));
      const auto got = dx.Download();
      for (size_t i = 0; i < got.size(); ++i) {
        // Angles up to 1000 rad: float angle rounding differs between the power and ggml's
        // repeated product by a few ulp of the angle.
        ASSERT_NEAR(got[i], ref[i], 4e-3) << int(mode) << factors << " " << i;
      }
    }
  }
}

TEST(CudaElementwiseTest, SwiGluMatchesReference) {
  SKIP_WITHOUT_DEVICE();
  const int64_t n = 100003;
  const auto g = RandomNormal(n, 5, 4.0f), u = RandomNormal(n, 6);
  std::vector<float> ref(n);
  SwiGluReference(g.data(), u.data(), ref.data(), n);
  DeviceVec<float> dg(g), du(u), dout(n);
  ASSERT_OK(cuda::SwiGlu(dg.get(), du.get(), dout.get(), n, nullptr));
  const auto got = dout.Download();
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(got[i], ref[i], 2e-6 * std::fabs(ref[i]) + 1e-7) << i;
  }
}

TEST(CudaElementwiseTest, AddInPlaceAndAddBiasMatchCpu) {
  SKIP_WITHOUT_DEVICE();
  const int64_t n = 100003;
  auto x = RandomNormal(n, 7), y = RandomNormal(n, 8);
  DeviceVec<float> dx(x), dy(y);
  ASSERT_OK(cuda::AddInPlace(dx.get(), dy.get(), n, nullptr));
  AddInPlace(x.data(), y.data(), n);
  const auto got = dx.Download();
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], x[i]) << i;  // one float add: exact

  // Rows with a stride wider than the bias: the gap between rows must stay untouched.
  const int64_t rows = 37, width = 200, stride = 208;
  auto m = RandomNormal(rows * stride, 9);
  const auto bias = RandomNormal(width, 10);
  DeviceVec<float> dm(m), db(bias);
  ASSERT_OK(cuda::AddBias(dm.get(), db.get(), rows, width, stride, nullptr));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < width; ++i) m[r * stride + i] += bias[i];
  }
  EXPECT_EQ(dm.Download(), m);
  EXPECT_FALSE(cuda::AddBias(dm.get(), db.get(), rows, width, width - 1, nullptr).ok());
  ExpectNoCudaError();
}

// ---- GEMV / GEMM ----------------------------------------------------------------------------

TEST(CudaMatmulTest, QuantGemvMatchesDoubleReference) {
  SKIP_WITHOUT_DEVICE();
  for (DType t : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kMXFP4}) {
    for (int batch : {1, 3, 8}) {
      const int64_t rows = 67, cols = t == DType::kQ4_K ? 1536 : 544;
      const auto wf = RandomBlockScaled(rows * cols, 11);
      const size_t row_bytes = RowBytes(t, cols);
      std::vector<uint8_t> w(rows * row_bytes);
      for (int64_t r = 0; r < rows; ++r) {
        ASSERT_TRUE(QuantizeRow(t, wf.data() + r * cols, w.data() + r * row_bytes, cols).ok());
      }
      const auto x = RandomNormal(batch * cols, 12);
      std::vector<float> ref(batch * rows);
      MatmulParams mp;
      mp.weight_type = t;
      mp.weight = w.data();
      mp.rows = rows;
      mp.cols = cols;
      mp.input = x.data();
      mp.batch = batch;
      mp.output = ref.data();
      MatmulReference(mp);
      // Scale of each output's rounding: sum of |w||x| over the dequantised row.
      std::vector<float> deq(cols);
      std::vector<double> mag(batch * rows);
      for (int64_t r = 0; r < rows; ++r) {
        DequantizeRow(t, w.data() + r * row_bytes, deq.data(), cols);
        for (int b = 0; b < batch; ++b) {
          for (int64_t c = 0; c < cols; ++c) mag[b * rows + r] += std::fabs(deq[c] * x[b * cols + c]);
        }
      }
      DeviceVec<uint8_t> dw(w);
      DeviceVec<float> dx(x), dout(batch * rows);
      cuda::GemvParams p;
      p.weight_type = t;
      p.weight = dw.get();
      p.rows = rows;
      p.cols = cols;
      p.input = dx.get();
      p.batch = batch;
      p.output = dout.get();
      ASSERT_OK(cuda::QuantGemv(p, nullptr));
      const auto got = dout.Download();
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], ref[i], 1e-5 * mag[i] + 1e-6)
            << Traits(t).name << " batch " << batch << " out " << i;
      }
    }
  }
}

TEST(CudaMatmulTest, CublasLtBf16GemmMatchesDoubleReference) {
  SKIP_WITHOUT_DEVICE();
  const int64_t rows = 96, cols = 256, batch = 5;
  const auto wf = RandomNormal(rows * cols, 21), xf = RandomNormal(batch * cols, 22);
  std::vector<uint16_t> w(wf.size()), xb(xf.size());
  for (size_t i = 0; i < wf.size(); ++i) w[i] = F32ToBf16(wf[i]);
  for (size_t i = 0; i < xf.size(); ++i) xb[i] = F32ToBf16(xf[i]);
  DeviceVec<uint16_t> dw(w), dxb(xf.size());
  DeviceVec<float> dxf(xf), dout(batch * rows);
  ASSERT_OK(cuda::ConvertF32ToBf16(dxf.get(), dxb.get(), int64_t(xf.size()), nullptr));
  ASSERT_EQ(dxb.Download(), xb) << "device bf16 rounding must equal the host's";
  auto gemm = cuda::CublasLtGemm::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  ASSERT_OK((*gemm)->Bf16(dw.get(), dxb.get(), dout.get(), rows, cols, batch, nullptr));
  const auto got = dout.Download();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      double acc = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double p = double(Bf16ToF32(w[r * cols + c])) * Bf16ToF32(xb[b * cols + c]);
        acc += p;
        mag += std::fabs(p);
      }
      ASSERT_NEAR(got[b * rows + r], acc, 1e-5 * mag + 1e-6) << b << " " << r;
    }
  }
}

TEST(CudaMatmulTest, CublasLtFp8GemmMatchesDoubleReference) {
  SKIP_WITHOUT_DEVICE();
  auto dev = cuda::CurrentDevice();
  ASSERT_TRUE(dev.ok()) << dev.status();
  if (!cuda::CublasLtGemm::DeviceHasFp8(*dev)) GTEST_SKIP() << "no FP8 tensor cores";
  const int64_t rows = 64, cols = 512, batch = 16;
  const auto wf = RandomNormal(rows * cols, 31), xf = RandomNormal(batch * cols, 32, 3.0f);
  const float w_scale = 4.0f / kFp8E4M3Max, x_scale = 12.0f / kFp8E4M3Max;
  std::vector<uint8_t> w(wf.size()), xq(xf.size());
  for (size_t i = 0; i < wf.size(); ++i) w[i] = F32ToFp8E4M3(wf[i] / w_scale);
  for (size_t i = 0; i < xf.size(); ++i) xq[i] = F32ToFp8E4M3(xf[i] * (1.0f / x_scale));
  DeviceVec<uint8_t> dw(w), dxq(xf.size());
  DeviceVec<float> dxf(xf), dout(batch * rows);
  DeviceVec<float> dws(std::vector<float>{w_scale}), dxs(std::vector<float>{x_scale});
  ASSERT_OK(cuda::ConvertF32ToFp8E4m3(dxf.get(), dxq.get(), int64_t(xf.size()), 1.0f / x_scale,
                                      nullptr));
  ASSERT_EQ(dxq.Download(), xq) << "device e4m3 rounding must equal the host's";
  auto gemm = cuda::CublasLtGemm::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  ASSERT_OK((*gemm)->Fp8(dw.get(), dws.get(), dxq.get(), dxs.get(), dout.get(), rows, cols,
                         batch, nullptr));
  const auto got = dout.Download();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      double acc = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double p = double(Fp8E4M3ToF32(w[r * cols + c])) * w_scale *
                         Fp8E4M3ToF32(xq[b * cols + c]) * x_scale;
        acc += p;
        mag += std::fabs(p);
      }
      // FP8 tensor cores accumulate a few k-steps at reduced precision before promoting.
      ASSERT_NEAR(got[b * rows + r], acc, 1e-3 * mag + 1e-5) << b << " " << r;
    }
  }
}

// ---- KV blocks ------------------------------------------------------------------------------

TEST(CudaKvBlocksTest, PackAndUnpackMatchCpuBytes) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937 rng(41);
  for (size_t block_bytes : {size_t{16 * 8 * 128 * 2}, size_t{4104}, size_t{37}}) {
    const int32_t num_blocks = 40, n_regions = 8, n = 13;
    const size_t stride = num_blocks * block_bytes;
    std::vector<uint8_t> cache(stride * n_regions);
    for (auto& b : cache) b = static_cast<uint8_t>(rng());
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(n);
    KvPackParams p{stride, n_regions, block_bytes, ids.data(), n};
    std::vector<uint8_t> want(KvPackedBytes(p));
    PackKvBlocks(p, cache.data(), want.data());

    DeviceVec<uint8_t> dcache(cache), dpacked(KvPackedBytes(p));
    DeviceVec<int32_t> dids(ids);
    KvPackParams dp = p;
    dp.blocks = dids.get();
    ASSERT_OK(cuda::PackKvBlocks(dp, dcache.get(), dpacked.get(), nullptr));
    ASSERT_EQ(dpacked.Download(), want) << block_bytes;

    std::vector<uint8_t> other(cache.size());
    for (auto& b : other) b = static_cast<uint8_t>(rng());
    DeviceVec<uint8_t> dother(other);
    UnpackKvBlocks(p, want.data(), other.data());
    ASSERT_OK(cuda::UnpackKvBlocks(dp, dpacked.get(), dother.get(), nullptr));
    ASSERT_EQ(dother.Download(), other) << block_bytes;
  }
}

TEST(CudaKvBlocksTest, WriteKvMatchesCpuBytesForEveryCacheType) {
  SKIP_WITHOUT_DEVICE();
  const int n_kv_head = 3, head_dim = 66;  // code bytes 198: padded to 200 for quantised slots
  const int n_tokens = 7, num_slots = 40;
  for (DType t : {DType::kF32, DType::kF16, DType::kI8, DType::kFp8E4M3}) {
    const int64_t row = int64_t{n_kv_head} * head_dim;
    auto k = RandomBlockScaled(n_tokens * row, 51), v = RandomNormal(n_tokens * row, 52, 5.0f);
    if (IsQuantizedKvType(t)) {
      // Edge cases of the encoding: an all-zero head, infinities, a NaN, tiny values.
      std::fill(k.begin() + row, k.begin() + row + head_dim, 0.0f);
      k[2 * row + 3] = INFINITY;
      k[2 * row + 5] = -INFINITY;
      v[3 * row + head_dim + 1] = NAN;
      v[3 * row + 2 * head_dim + 4] = -NAN;  // the sign of a NaN survives in FP8
      for (int i = 0; i < head_dim; ++i) v[4 * row + i] = 1e-30f * float(i - 30);
    }
    const int64_t slot_bytes = IsQuantizedKvType(t) ? KvQuantSlotBytes(n_kv_head, head_dim)
                                                    : row * (t == DType::kF16 ? 2 : 4);
    std::vector<int64_t> slots = {5, 0, 39, 17, -1, 18, 2};
    std::vector<uint8_t> want_k(num_slots * slot_bytes, 0xCD), want_v = want_k;
    for (int tok = 0; tok < n_tokens; ++tok) {
      if (slots[tok] < 0) continue;
      for (int which = 0; which < 2; ++which) {
        const float* x = (which ? v : k).data() + tok * row;
        uint8_t* dst = (which ? want_v : want_k).data() + slots[tok] * slot_bytes;
        if (t == DType::kF32) {
          std::memcpy(dst, x, row * 4);
        } else if (t == DType::kF16) {
          F32ToFp16Row(x, reinterpret_cast<uint16_t*>(dst), row);
        } else {
          QuantizeKvSlot(t, x, n_kv_head, head_dim, dst);
        }
      }
    }
    DeviceVec<float> dk(k), dv(v);
    DeviceVec<int64_t> dslots(slots);
    DeviceVec<uint8_t> kc(num_slots * slot_bytes), vc(num_slots * slot_bytes);  // 0xCD
    cuda::KvWriteParams p;
    p.k = dk.get();
    p.v = dv.get();
    p.n_tokens = n_tokens;
    p.slot_mapping = dslots.get();
    p.n_kv_head = n_kv_head;
    p.head_dim = head_dim;
    p.type = t;
    p.k_cache = kc.get();
    p.v_cache = vc.get();
    ASSERT_OK(cuda::WriteKv(p, nullptr));
    ExpectNoCudaError();
    const auto got_k = kc.Download(), got_v = vc.Download();
    for (size_t i = 0; i < got_k.size(); ++i) {
      ASSERT_EQ(got_k[i], want_k[i]) << KvTypeName(t) << " K byte " << i << " slot "
                                     << i / slot_bytes;
      ASSERT_EQ(got_v[i], want_v[i]) << KvTypeName(t) << " V byte " << i << " slot "
                                     << i / slot_bytes;
    }
  }
}

// ---- sampling -------------------------------------------------------------------------------

TEST(CudaSamplingTest, TopKTopPMatchesReferenceAwayFromFloatBoundaries) {
  SKIP_WITHOUT_DEVICE();
  const int32_t vocab = 32000;
  struct RowCase {
    float temperature;
    int32_t top_k;
    float top_p;
  };
  const RowCase cases[] = {{0.0f, 0, 1.0f},  {1.0f, 0, 1.0f},   {0.8f, 40, 1.0f},
                           {1.0f, 0, 0.9f},  {0.7f, 50, 0.95f}, {1.2f, 1, 1.0f},
                           {1.0f, 5, 0.3f},  {0.3f, 0, 0.5f},   {2.0f, 1000, 0.99f}};
  const int n_rows = static_cast<int>(std::size(cases));
  int compared = 0;
  for (int round = 0; round < 8; ++round) {
    const auto logits = RandomNormal(size_t(n_rows) * vocab, 600 + round, 3.0f);
    std::mt19937 rng(700 + round);
    std::uniform_real_distribution<float> unif(0.0f, 1.0f);
    std::vector<float> temp, top_p, u;
    std::vector<int32_t> top_k;
    for (const RowCase& c : cases) {
      temp.push_back(c.temperature);
      top_k.push_back(c.top_k);
      top_p.push_back(c.top_p);
      u.push_back(unif(rng));
    }
    DeviceVec<float> dl(logits), dt(temp), dp(top_p), du(u);
    DeviceVec<int32_t> dk(top_k), dout(n_rows);
    cuda::SampleParams p;
    p.logits = dl.get();
    p.n_rows = n_rows;
    p.vocab = vocab;
    p.temperature = dt.get();
    p.top_k = dk.get();
    p.top_p = dp.get();
    p.u = du.get();
    p.out = dout.get();
    ASSERT_OK(cuda::SampleTopKTopP(p, nullptr));
    const auto got = dout.Download();
    for (int r = 0; r < n_rows; ++r) {
      const float* row = logits.data() + size_t(r) * vocab;
      TopKTopPParams rp{cases[r].temperature, cases[r].top_k, cases[r].top_p};
      const int32_t want = SampleTopKTopPReference(row, vocab, rp, u[r]);
      // Float sums on the GPU (relative error ~1e-6) may move a draw that sits on a boundary.
      // Perturb u and top_p by 1e-5: where the reference's answer does not move, the GPU must
      // match it exactly; elsewhere it must lie within the perturbed answers (draws are
      // monotone in u), which still catches a wrong filter or scan.
      int32_t lo = want, hi = want;
      auto widen = [&](const TopKTopPParams& q, double uu) {
        const int32_t id = SampleTopKTopPReference(row, vocab, q, std::clamp(uu, 0.0, 0.999999));
        lo = std::min(lo, id);
        hi = std::max(hi, id);
      };
      for (double du2 : {-1e-5, 1e-5}) widen(rp, u[r] + du2);
      if (rp.top_p < 1.0f && rp.temperature > 0.0f) {
        for (float dp2 : {-1e-5f, 1e-5f}) {
          TopKTopPParams q = rp;
          q.top_p = std::min(1.0f, rp.top_p + dp2);
          for (double du2 : {-1e-5, 0.0, 1e-5}) widen(q, u[r] + du2);
        }
      }
      if (lo == hi) {
        ++compared;
        ASSERT_EQ(got[r], want) << "row " << r << " round " << round << " u " << u[r];
      } else {
        ASSERT_GE(got[r], lo) << "row " << r << " round " << round << " u " << u[r];
        ASSERT_LE(got[r], hi) << "row " << r << " round " << round << " u " << u[r];
      }
    }
  }
  EXPECT_GE(compared, 8 * n_rows / 2) << "too few stable draws to mean anything";
}

}  // namespace
}  // namespace tandem::kernels
