#include "tandem/kernels/matmul.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/util/thread_pool.h"
#include "gtest/gtest.h"
#include "tandem/kernels/cpu_features.h"
#include "tandem/kernels/dtype.h"
#include "tandem/kernels/quant.h"
#include "tests/unit/kernels/kernel_test_util.h"

namespace tandem::kernels {
namespace {

using testing::AvailableIsas;
using testing::Poison;
using testing::RandomBlockScaled;
using testing::RandomNormal;
using testing::ScopedIsaCap;

const DType kWeightTypes[] = {DType::kF32,  DType::kF16,  DType::kBF16, DType::kQ8_0,
                              DType::kQ4_0, DType::kQ4_K, DType::kQ6_K, DType::kMXFP4};

struct Weights {
  DType type;
  int64_t rows, cols;
  std::vector<uint8_t> bytes;
  std::vector<float> dequant;  // rows x cols, what the kernels should be multiplying by
};

Weights MakeWeights(DType t, int64_t rows, int64_t cols, uint32_t seed) {
  Weights w{t, rows, cols, {}, {}};
  const auto src = RandomNormal(rows * cols, seed);
  const size_t rb = RowBytes(t, cols);
  w.bytes.resize(rb * rows);
  w.dequant.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_TRUE(QuantizeRow(t, &src[r * cols], &w.bytes[r * rb], cols).ok());
    DequantizeRow(t, &w.bytes[r * rb], &w.dequant[r * cols], cols);
  }
  return w;
}

// Activations as Matmul sees them after converting to the vec-dot type.
std::vector<float> AsConverted(DType wt, const float* x, int64_t n) {
  const DType vt = VecDotType(wt);
  std::vector<uint8_t> q(RowBytes(vt, n));
  QuantizeActivationRow(vt, x, q.data(), n);
  std::vector<float> out(n);
  DequantizeRow(vt, q.data(), out.data(), n);
  return out;
}

// Quantisation step of the activation format at each element, defined from the formats (not
// from the kernels): Q8_0 steps by amax/127 per 32, Q8_K by amax/127 per 256, F16/BF16 by the
// ulp of the value.
std::vector<double> ActivationStep(DType wt, const float* x, int64_t n) {
  const DType vt = VecDotType(wt);
  std::vector<double> step(n, 0.0);
  if (vt == DType::kQ8_0 || vt == DType::kQ8_K) {
    const int64_t blk = vt == DType::kQ8_0 ? 32 : 256;
    for (int64_t b = 0; b < n; b += blk) {
      double amax = 0;
      for (int64_t i = b; i < b + blk; ++i) amax = std::max(amax, std::fabs(double(x[i])));
      for (int64_t i = b; i < b + blk; ++i) step[i] = amax / 127 * 1.01;  // + fp16 scale rounding
    }
  } else if (vt == DType::kF16 || vt == DType::kBF16) {
    const int mant = vt == DType::kF16 ? 10 : 7;
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] != 0) step[i] = std::ldexp(1.0, std::ilogb(x[i]) - mant);
    }
  }
  return step;
}

struct Shape {
  int64_t rows, cols, batch;
};

// `packed`: the weights in PackWeights' layout, used instead of w.bytes (null: row-major).
void CheckMatmul(const Weights& w, int64_t batch, util::ThreadPool* pool, const std::string& what,
                 const uint8_t* packed = nullptr) {
  const int64_t in_stride = w.cols + 3, out_stride = w.rows + 2;
  auto x = RandomBlockScaled(batch * in_stride, static_cast<uint32_t>(w.rows * 31 + batch));
  std::vector<float> out(batch * out_stride), ref(batch * out_stride);
  Poison(out);
  Poison(ref);
  MatmulParams p;
  p.weight_type = w.type;
  p.weight = w.bytes.data();
  p.rows = w.rows;
  p.cols = w.cols;
  p.input = x.data();
  p.input_stride = in_stride;
  p.batch = batch;
  p.output = out.data();
  p.output_stride = out_stride;
  if (packed != nullptr) {
    p.weight = packed;
    p.packed = true;
  }
  Matmul(p, pool);
  p.weight = w.bytes.data();
  p.packed = false;
  p.output = ref.data();
  MatmulReference(p);

  for (int64_t b = 0; b < batch; ++b) {
    const float* xb = &x[b * in_stride];
    const auto xc = AsConverted(w.type, xb, w.cols);
    const auto step = ActivationStep(w.type, xb, w.cols);
    for (int64_t r = 0; r < w.rows; ++r) {
      const float* wr = &w.dequant[r * w.cols];
      double exact_conv = 0, mag = 0, var = 0;
      float wmax = 0;
      for (int64_t c = 0; c < w.cols; ++c) wmax = std::max(wmax, std::fabs(wr[c]));
      for (int64_t c = 0; c < w.cols; ++c) {
        exact_conv += double(wr[c]) * xc[c];
        // Q4_K's min term is accumulated apart from the scaled term, so bound float error by
        // the largest weight rather than each weight.
        mag += std::fabs(double(xc[c])) * (std::fabs(wr[c]) + wmax);
        var += double(wr[c]) * wr[c] * step[c] * step[c] / 12;
      }
      const float got = out[b * out_stride + r];
      ASSERT_TRUE(std::isfinite(got)) << what << " b=" << b << " r=" << r;
      // 1) Against the exact product with the converted activations: only float rounding differs.
      const double float_tol = 3e-6 * mag + 1e-6;
      ASSERT_NEAR(got, exact_conv, float_tol) << what << " b=" << b << " r=" << r;
      // 2) Against the float-activation reference: the activation rounding error, a sum of
      // independent roundings, stays within 6 sigma of its predicted spread.
      ASSERT_NEAR(got, ref[b * out_stride + r], 6 * std::sqrt(var) + float_tol)
          << what << " b=" << b << " r=" << r;
    }
    for (int64_t r = w.rows; r < out_stride; ++r)
      ASSERT_TRUE(std::isnan(out[b * out_stride + r])) << "stride gap written";
  }
}

class MatmulTest : public ::testing::TestWithParam<DType> {};

TEST_P(MatmulTest, MatchesReferenceOnEveryIsaShapeAndThreadCount) {
  const DType t = GetParam();
  const bool k_quant = Traits(t).block_elems == 256;
  // Rows not a multiple of the 16-row blocks or of a two-thread split; float types also get a
  // column count that leaves SIMD tails.
  std::vector<Shape> shapes = {{37, 256, 1}, {70, 512, 3}, {45, 768, 17}, {3, 256, 4}};
  if (!k_quant) {
    // 1, 3 and 7 blocks of 32: every remainder path of the multi-block loops.
    shapes.push_back({4, 32, 3});
    shapes.push_back({19, 96, 5});
    shapes.push_back({7, 224, 2});
    // Batches of 8 and more take the GEMM tiles where the CPU has them (Q8_0, Q4_0, MXFP4 on
    // AVX-512): 1, 2 and 7 blocks, and a last tile of every width.
    shapes.push_back({33, 32, 8});
    shapes.push_back({40, 64, 9});
    shapes.push_back({23, 224, 23});
  }
  if (Traits(t).block_elems == 1) {
    shapes.push_back({21, 203, 2});
    // F32/F16 GEMM tiles (batch >= 8 on AVX-512): four-row groups, a one-row tail, a masked
    // column tail and every activation tile width.
    shapes.push_back({21, 203, 13});
  }
  util::ThreadPool pool(2);
  for (const Shape& s : shapes) {
    const Weights w = MakeWeights(t, s.rows, s.cols, static_cast<uint32_t>(s.rows + s.cols));
    for (Isa isa : AvailableIsas()) {
      ScopedIsaCap cap(isa);
      for (util::ThreadPool* tp : {static_cast<util::ThreadPool*>(nullptr), &pool}) {
        CheckMatmul(w, s.batch, tp,
                    std::string(Traits(t).name) + " " + IsaName(isa) + " " +
                        std::to_string(s.rows) + "x" + std::to_string(s.cols) + " batch " +
                        std::to_string(s.batch) + (tp ? " pool" : " inline"));
      }
    }
  }
}

TEST_P(MatmulTest, ThreadsAndBatchingDoNotChangeResults) {
  const DType t = GetParam();
  const int64_t rows = 53, cols = 512, batch = 9;
  const Weights w = MakeWeights(t, rows, cols, 11);
  const auto x = RandomNormal(batch * cols, 12);
  util::ThreadPool pool(2);
  for (Isa isa : AvailableIsas()) {
    ScopedIsaCap cap(isa);
    std::vector<float> a(batch * rows), b(batch * rows);
    Poison(a);
    Poison(b);
    MatmulParams p;
    p.weight_type = t;
    p.weight = w.bytes.data();
    p.rows = rows;
    p.cols = cols;
    p.input = x.data();
    p.batch = batch;
    p.output = a.data();
    Matmul(p, nullptr);
    p.output = b.data();
    Matmul(p, &pool);
    // Same tiles, different row split: bit-identical.
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << IsaName(isa);
    // One activation row at a time (a different tile width) and DotRow agree to float rounding.
    for (int64_t bi = 0; bi < batch; ++bi) {
      std::vector<float> single(rows);
      Poison(single);
      p.input = &x[bi * cols];
      p.batch = 1;
      p.output = single.data();
      Matmul(p, &pool);
      for (int64_t r = 0; r < rows; ++r) {
        double mag = 0;
        for (int64_t c = 0; c < cols; ++c)
          mag += std::fabs(double(w.dequant[r * cols + c]) * x[bi * cols + c]);
        const double tol = 2e-6 * mag;
        ASSERT_NEAR(single[r], a[bi * rows + r], tol) << IsaName(isa);
        const float d = DotRow(t, &w.bytes[r * RowBytes(t, cols)], &x[bi * cols], cols);
        ASSERT_EQ(d, single[r]) << IsaName(isa) << " DotRow row " << r;
      }
    }
  }
}

TEST_P(MatmulTest, MultiEqualsOneMatmulPerTarget) {
  // Fused projections (three matrices of different heights on one input) must give each
  // output exactly what its own Matmul gives, whatever the batch tile and the row split.
  const DType t = GetParam();
  const int64_t cols = 512;
  const int64_t heights[] = {40, 9, 23};
  std::vector<Weights> ws;
  for (int i = 0; i < 3; ++i) ws.push_back(MakeWeights(t, heights[i], cols, 21 + i));
  util::ThreadPool pool(2);
  for (int64_t batch : {1, 3, 9}) {
    const auto x = RandomNormal(batch * cols, 31 + batch);
    for (Isa isa : AvailableIsas()) {
      ScopedIsaCap cap(isa);
      std::vector<std::vector<float>> fused(3), single(3);
      std::vector<MatmulTarget> targets;
      for (int i = 0; i < 3; ++i) {
        fused[i].resize(batch * heights[i]);
        single[i].resize(batch * heights[i]);
        Poison(fused[i]);
        Poison(single[i]);
        targets.push_back({ws[i].bytes.data(), heights[i], fused[i].data(), 0});
        MatmulParams p;
        p.weight_type = t;
        p.weight = ws[i].bytes.data();
        p.rows = heights[i];
        p.cols = cols;
        p.input = x.data();
        p.batch = batch;
        p.output = single[i].data();
        Matmul(p, nullptr);
      }
      MatmulMulti(t, cols, x.data(), 0, batch, targets, &pool);
      for (int i = 0; i < 3; ++i) {
        ASSERT_EQ(0, std::memcmp(fused[i].data(), single[i].data(), fused[i].size() * 4))
            << IsaName(isa) << " batch " << batch << " target " << i;
      }
    }
  }
}

TEST_P(MatmulTest, GetRowDequantisesOneRow) {
  const DType t = GetParam();
  const Weights w = MakeWeights(t, 6, 512, 13);
  for (int64_t r = 0; r < 6; ++r) {
    std::vector<float> row(512);
    Poison(row);
    GetRow(t, w.bytes.data(), 512, r, row.data());
    ASSERT_EQ(0, std::memcmp(row.data(), &w.dequant[r * 512], 512 * sizeof(float))) << r;
  }
}

INSTANTIATE_TEST_SUITE_P(AllWeightTypes, MatmulTest, ::testing::ValuesIn(kWeightTypes),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(Traits(info.param).name);
                         });

// ---- Packed weights -------------------------------------------------------------------------

struct AlignedBytes {
  explicit AlignedBytes(size_t n) : storage(n + 64) {
    data = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
  }
  std::vector<uint8_t> storage;
  uint8_t* data;
};

// Packs w at the detected ISA; null when this CPU has no packed kernel for the type.
std::unique_ptr<AlignedBytes> Pack(const Weights& w) {
  ScopedIsaCap cap(DetectedIsa());
  const size_t n = PackedWeightBytes(w.type, w.rows, w.cols);
  if (n == 0) return nullptr;
  auto out = std::make_unique<AlignedBytes>(n);
  std::memset(out->data, 0xA5, n);
  PackWeights(w.type, w.bytes.data(), w.rows, w.cols, out->data);
  return out;
}

class PackedMatmulTest : public ::testing::TestWithParam<DType> {};

TEST_P(PackedMatmulTest, MatchesReferenceOnEveryShapeIsaAndThreadCount) {
  const DType t = GetParam();
  // Rows that leave a partial last group of 16, 1 to 17 blocks, every batch tile width.
  const Shape shapes[] = {{37, 256, 1}, {16, 32, 3}, {70, 544, 8}, {5, 96, 9}, {33, 224, 23}};
  util::ThreadPool pool(2);
  for (const Shape& s : shapes) {
    const Weights w = MakeWeights(t, s.rows, s.cols, static_cast<uint32_t>(7 * s.rows + s.cols));
    const auto packed = Pack(w);
    if (packed == nullptr) GTEST_SKIP() << "no packed kernel on this CPU";
    for (Isa isa : AvailableIsas()) {
      ScopedIsaCap cap(isa);
      for (util::ThreadPool* tp : {static_cast<util::ThreadPool*>(nullptr), &pool}) {
        CheckMatmul(w, s.batch, tp,
                    std::string("packed ") + std::string(Traits(t).name) + " " + IsaName(isa) +
                        " " + std::to_string(s.rows) + "x" + std::to_string(s.cols) + " batch " +
                        std::to_string(s.batch) + (tp ? " pool" : " inline"),
                    packed->data);
      }
    }
  }
}

TEST_P(PackedMatmulTest, GetPackedRowEqualsGetRow) {
  const DType t = GetParam();
  const Weights w = MakeWeights(t, 21, 96, 71);
  const auto packed = Pack(w);
  if (packed == nullptr) GTEST_SKIP() << "no packed kernel on this CPU";
  for (int64_t r = 0; r < w.rows; ++r) {
    std::vector<float> got(w.cols), want(w.cols);
    Poison(got);
    GetPackedRow(t, packed->data, w.cols, r, got.data());
    GetRow(t, w.bytes.data(), w.cols, r, want.data());
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << "row " << r;
  }
}

TEST_P(PackedMatmulTest, SimdScalarThreadsAndFusionGiveTheSameBits) {
  // The SIMD kernel's float steps are the scalar definition's, in the same order, so every ISA,
  // batch tile, row split and fused call gives identical bits.
  const DType t = GetParam();
  const int64_t cols = 320;
  const int64_t heights[] = {48, 9, 23};
  std::vector<Weights> ws;
  std::vector<std::unique_ptr<AlignedBytes>> packed;
  for (int i = 0; i < 3; ++i) {
    ws.push_back(MakeWeights(t, heights[i], cols, 41 + i));
    packed.push_back(Pack(ws.back()));
    if (packed.back() == nullptr) GTEST_SKIP() << "no packed kernel on this CPU";
  }
  util::ThreadPool pool(2);
  for (int64_t batch : {1, 3, 9, 20}) {
    const auto x = RandomBlockScaled(batch * cols, 51 + static_cast<uint32_t>(batch));
    std::vector<std::vector<float>> first(3);
    for (Isa isa : AvailableIsas()) {
      ScopedIsaCap cap(isa);
      std::vector<MatmulTarget> targets;
      std::vector<std::vector<float>> fused(3);
      for (int i = 0; i < 3; ++i) {
        fused[i].resize(batch * heights[i]);
        Poison(fused[i]);
        targets.push_back({packed[i]->data, heights[i], fused[i].data(), 0});
        std::vector<float> single(batch * heights[i]), by_row(batch * heights[i]);
        Poison(single);
        MatmulParams p;
        p.weight_type = t;
        p.weight = packed[i]->data;
        p.packed = true;
        p.rows = heights[i];
        p.cols = cols;
        p.input = x.data();
        p.batch = batch;
        p.output = single.data();
        Matmul(p, nullptr);
        for (int64_t b = 0; b < batch; ++b) {  // one activation row per call: tile width 1
          p.input = &x[b * cols];
          p.batch = 1;
          p.output = &by_row[b * heights[i]];
          Matmul(p, &pool);
        }
        ASSERT_EQ(0, std::memcmp(single.data(), by_row.data(), single.size() * 4))
            << IsaName(isa) << " batch " << batch << " target " << i;
        if (first[i].empty()) {
          first[i] = single;
        } else {
          ASSERT_EQ(0, std::memcmp(single.data(), first[i].data(), single.size() * 4))
              << IsaName(isa) << " differs from the scalar kernel, batch " << batch;
        }
      }
      MatmulMulti(t, cols, x.data(), 0, batch, targets, &pool, /*packed=*/true);
      for (int i = 0; i < 3; ++i) {
        ASSERT_EQ(0, std::memcmp(fused[i].data(), first[i].data(), fused[i].size() * 4))
            << IsaName(isa) << " fused, batch " << batch << " target " << i;
      }
    }
  }
}

TEST(PackedMatmulSupportTest, OnlyQ8_0Q4_0AndMxfp4OnAvx512Pack) {
  for (DType t : kWeightTypes) {
    ScopedIsaCap cap(DetectedIsa());
    const bool expect = (t == DType::kQ8_0 || t == DType::kQ4_0 || t == DType::kMXFP4) &&
                        DetectedIsa() >= Isa::kAvx512;
    EXPECT_EQ(PackedWeightBytes(t, 40, 256) > 0, expect) << Traits(t).name;
  }
  ScopedIsaCap cap(Isa::kAvx2);
  EXPECT_EQ(PackedWeightBytes(DType::kQ8_0, 40, 256), 0u) << "no packed kernel below AVX-512";
  if (DetectedIsa() >= Isa::kAvx512) {
    ScopedIsaCap full(DetectedIsa());
    // Three groups of 16 rows, each 3 blocks rounded up to 2 pairs, a pair being two blocks of
    // 16 rows' values and one 64-byte line of scales: Q8_0 2 * (2 * 512 + 64) = 2176 bytes,
    // Q4_0 2 * (2 * 256 + 64) = 1152.
    EXPECT_EQ(PackedWeightBytes(DType::kQ8_0, 40, 96), 3u * 2176);
    EXPECT_EQ(PackedWeightBytes(DType::kQ4_0, 40, 96), 3u * 1152);
    EXPECT_EQ(PackedWeightBytes(DType::kMXFP4, 40, 96), 3u * 1152);  // Q4_0's layout
  }
}

INSTANTIATE_TEST_SUITE_P(PackableTypes, PackedMatmulTest,
                         ::testing::Values(DType::kQ8_0, DType::kQ4_0, DType::kMXFP4),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(Traits(info.param).name);
                         });

TEST(MatmulMxfp4Test, SubnormalSharedExponentsMatchScalarPath) {
  // E8M0 exponents 0 and 1 give subnormal scales (2^-128, 2^-127), decoded by a separate branch
  // in the SIMD kernels. Rows: all e=0, all e=1, all e=2, then a mix with ordinary exponents.
  const int64_t rows = 4, cols = 256, nblk = cols / 32;
  std::vector<uint8_t> w(rows * nblk * 17);
  std::mt19937 rng(21);
  const uint8_t mixed[] = {0, 1, 2, 3, 1, 0, 2, 1};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nblk; ++b) {
      uint8_t* blk = &w[(r * nblk + b) * 17];
      blk[0] = r < 3 ? static_cast<uint8_t>(r) : mixed[b];
      for (int j = 1; j < 17; ++j) blk[j] = static_cast<uint8_t>(rng());
    }
  }
  const auto x = RandomNormal(cols, 22);
  MatmulParams p;
  p.weight_type = DType::kMXFP4;
  p.weight = w.data();
  p.rows = rows;
  p.cols = cols;
  p.input = x.data();
  std::vector<float> scalar(rows);
  {
    ScopedIsaCap cap(Isa::kScalar);
    p.output = scalar.data();
    Matmul(p, nullptr);
  }
  for (float v : scalar) ASSERT_NE(v, 0.0f);
  for (Isa isa : AvailableIsas()) {
    ScopedIsaCap cap(isa);
    std::vector<float> out(rows);
    Poison(out);
    p.output = out.data();
    Matmul(p, nullptr);
    for (int64_t r = 0; r < rows; ++r)
      ASSERT_NEAR(out[r], scalar[r], 1e-5 * std::fabs(scalar[r])) << IsaName(isa) << " " << r;
  }
  // Packed, the subnormal scales take the packed kernel's own E8M0 decoding.
  const size_t n = PackedWeightBytes(DType::kMXFP4, rows, cols);
  if (n == 0) return;
  AlignedBytes packed(n);
  PackWeights(DType::kMXFP4, w.data(), rows, cols, packed.data);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> got(cols), want(cols);
    GetPackedRow(DType::kMXFP4, packed.data, cols, r, got.data());
    GetRow(DType::kMXFP4, w.data(), cols, r, want.data());
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), cols * 4)) << "row " << r;
  }
  std::vector<float> out(rows);
  Poison(out);
  p.weight = packed.data;
  p.packed = true;
  p.output = out.data();
  Matmul(p, nullptr);
  for (int64_t r = 0; r < rows; ++r)
    ASSERT_NEAR(out[r], scalar[r], 1e-5 * std::fabs(scalar[r])) << "packed " << r;
}

TEST(MatmulVecDotTest, ActivationTypesFollowLlamaCpp) {
  EXPECT_EQ(VecDotType(DType::kQ8_0), DType::kQ8_0);
  EXPECT_EQ(VecDotType(DType::kQ4_0), DType::kQ8_0);
  EXPECT_EQ(VecDotType(DType::kMXFP4), DType::kQ8_0);
  EXPECT_EQ(VecDotType(DType::kQ4_K), DType::kQ8_K);
  EXPECT_EQ(VecDotType(DType::kQ6_K), DType::kQ8_K);
  EXPECT_EQ(VecDotType(DType::kF16), DType::kF16);
  EXPECT_EQ(VecDotType(DType::kBF16), DType::kBF16);
  EXPECT_EQ(VecDotType(DType::kF32), DType::kF32);
}

TEST(MatmulVecDotTest, Q8_0ActivationsAreTheSameBitsOnEveryIsa) {
  // Random blocks of very different magnitudes, plus blocks whose products land exactly on
  // ties (amax 127 makes the multiplier 1): the SIMD quantiser must round as the scalar one.
  auto x = RandomBlockScaled(32 * 64, 61);
  for (int j = 0; j < 32; ++j) x[j] = j == 0 ? 127.0f : (j % 2 ? 0.5f : -2.5f) + (j / 4);
  std::vector<uint8_t> first;
  for (Isa isa : AvailableIsas()) {
    ScopedIsaCap cap(isa);
    std::vector<uint8_t> q(34 * 64);
    std::memset(q.data(), 0xA5, q.size());
    QuantizeActivationRow(DType::kQ8_0, x.data(), q.data(), 32 * 64);
    if (first.empty()) {
      first = q;
    } else {
      ASSERT_EQ(0, std::memcmp(first.data(), q.data(), q.size())) << IsaName(isa);
    }
  }
  EXPECT_EQ(static_cast<int8_t>(first[2 + 2]), -2) << "-2.5 rounds to even";
  EXPECT_EQ(static_cast<int8_t>(first[2 + 3]), 0) << "0.5 rounds to even";
  EXPECT_EQ(static_cast<int8_t>(first[2 + 7]), 2) << "1.5 rounds to even";
}

TEST(MatmulVecDotTest, Q8_0ActivationsRoundLikeLlamaCppCpuBackend) {
  // Scale 127/amax and ties to even: with amax = 127 the multiplier is exactly 1, so 2.5 -> 2
  // and -3.5 -> -4 (the reference quantiser's roundf would give 3 and -4).
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f;
  x[1] = 2.5f;
  x[2] = -3.5f;
  x[3] = 0.5f;
  std::vector<uint8_t> q(34);
  QuantizeActivationRow(DType::kQ8_0, x.data(), q.data(), 32);
  EXPECT_EQ(static_cast<int8_t>(q[2]), 127);
  EXPECT_EQ(static_cast<int8_t>(q[3]), 2);
  EXPECT_EQ(static_cast<int8_t>(q[4]), -4);
  EXPECT_EQ(static_cast<int8_t>(q[5]), 0);
}

}  // namespace
}  // namespace tandem::kernels
