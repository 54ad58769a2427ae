#include "tandem/kernels/quant.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/kernels/dtype.h"
#include "tandem/kernels/fp16.h"
#include "tests/unit/kernels/kernel_test_util.h"

namespace tandem::kernels {
namespace {

using testing::Poison;
using testing::RandomBlockScaled;
using testing::RandomNormal;

const DType kAllTypes[] = {DType::kF32,  DType::kF16,  DType::kBF16, DType::kQ8_0, DType::kQ4_0,
                           DType::kQ4_K, DType::kQ6_K, DType::kQ8_K, DType::kMXFP4};

std::vector<uint8_t> Quantize(DType t, const std::vector<float>& x) {
  std::vector<uint8_t> q(RowBytes(t, x.size()), 0xA5);
  EXPECT_TRUE(QuantizeRow(t, x.data(), q.data(), static_cast<int64_t>(x.size())).ok());
  return q;
}

std::vector<float> Dequantize(DType t, const std::vector<uint8_t>& q, size_t n) {
  std::vector<float> y(n);
  Poison(y);
  DequantizeRow(t, q.data(), y.data(), static_cast<int64_t>(n));
  return y;
}

double RelRms(const std::vector<float>& x, const std::vector<float>& y) {
  double e = 0, s = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    e += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
    s += double(x[i]) * x[i];
  }
  return std::sqrt(e / s);
}

// Relative rms round-trip error on N(0,1) data. The bounds sit ~20% above what these formats
// give (measured here, and within 2% of ggml's reference quantisers on the same kind of data);
// a layout or scale mix-up gives errors of order 1.
double RoundTripBound(DType t) {
  switch (t) {
    case DType::kF32:
      return 0.0;
    case DType::kF16:
      return 2.6e-4;
    case DType::kBF16:
      return 2.1e-3;
    case DType::kQ8_0:
      return 0.0065;
    case DType::kQ8_K:
      return 0.0085;
    case DType::kQ6_K:
      return 0.022;
    case DType::kQ4_0:
      return 0.105;
    case DType::kQ4_K:
      return 0.085;
    case DType::kMXFP4:
      return 0.135;
    case DType::kI8:  // KV-cache types, not GGUF weight formats: kv_quant_test covers them
    case DType::kFp8E4M3:
      break;
  }
  return 0;
}

TEST(QuantTest, RoundTripErrorIsWithinTheFormatsPrecision) {
  const auto x = RandomNormal(8192, 1);
  for (DType t : kAllTypes) {
    const auto y = Dequantize(t, Quantize(t, x), x.size());
    const double err = RelRms(x, y);
    EXPECT_LE(err, RoundTripBound(t)) << Traits(t).name;
    if (t != DType::kF32) {
      EXPECT_GT(err, 0.0) << Traits(t).name;  // it really did round
    }
    for (float v : y) ASSERT_TRUE(std::isfinite(v)) << Traits(t).name;
  }
}

TEST(QuantTest, BlockFormatsFollowEachBlocksOwnScale) {
  // Scales varying by 1000x between blocks: each block's error must be relative to its own size.
  const auto x = RandomBlockScaled(4096, 2);
  for (DType t : {DType::kQ8_0, DType::kQ4_0, DType::kMXFP4}) {
    const auto y = Dequantize(t, Quantize(t, x), x.size());
    for (size_t b = 0; b < x.size() / 32; ++b) {
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[32 * b + j]));
      // Q8_0: half a step of amax/127. Q4_0: a full step of amax/8, because the levels run
      // -8..7 with the largest value at -8, so its opposite clips at 7. Both plus the fp16
      // rounding of the scale times the largest level. MXFP4: with unit u = 2^(floor(log2 amax) -
      // 3) the top level is 12u while amax may approach 16u, so clipping can cost up to 4u (more
      // than half the widest gap, 8u..12u).
      const float bound = t == DType::kQ8_0 ? amax / 127 * (0.5f + 127 * 0x1p-11f)
                          : t == DType::kQ4_0
                              ? amax / 8 * (1.0f + 8 * 0x1p-11f)
                              : std::ldexp(1.0f, static_cast<int>(std::floor(std::log2(amax))) - 1);
      for (int j = 0; j < 32; ++j) {
        ASSERT_LE(std::fabs(x[32 * b + j] - y[32 * b + j]), bound)
            << Traits(t).name << " block " << b;
      }
    }
  }
}

TEST(QuantTest, ZerosAndConstantsSurvive) {
  for (DType t : kAllTypes) {
    const int64_t n = 512;
    std::vector<float> zeros(n, 0.0f);
    for (float v : Dequantize(t, Quantize(t, zeros), n)) ASSERT_EQ(v, 0.0f) << Traits(t).name;
    std::vector<float> c(n, -0.75f);
    for (float v : Dequantize(t, Quantize(t, c), n))
      ASSERT_NEAR(v, -0.75f, 0.02f) << Traits(t).name;
  }
}

TEST(QuantTest, RejectsPartialBlocks) {
  std::vector<float> x(300, 1.0f);
  std::vector<uint8_t> q(4096);
  EXPECT_EQ(QuantizeRow(DType::kQ8_0, x.data(), q.data(), 33).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeRow(DType::kQ4_K, x.data(), q.data(), 288).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(QuantizeRow(DType::kF16, x.data(), q.data(), 7).ok());
}

// ---- Byte equality with ggml's reference quantisers, re-derived here from their definitions ----

std::vector<uint8_t> GgmlQ8_0(const std::vector<float>& x) {
  std::vector<uint8_t> out;
  for (size_t b = 0; b < x.size() / 32; ++b) {
    const float* v = &x[32 * b];
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    const uint16_t dh = F32ToFp16(d);
    out.push_back(dh & 0xff);
    out.push_back(dh >> 8);
    for (int j = 0; j < 32; ++j)
      out.push_back(static_cast<uint8_t>(static_cast<int8_t>(std::roundf(v[j] * id))));
  }
  return out;
}

std::vector<uint8_t> GgmlQ4_0(const std::vector<float>& x) {
  std::vector<uint8_t> out;
  for (size_t b = 0; b < x.size() / 32; ++b) {
    const float* v = &x[32 * b];
    float amax = 0, max = 0;
    for (int j = 0; j < 32; ++j) {
      if (std::fabs(v[j]) > amax) {
        amax = std::fabs(v[j]);
        max = v[j];
      }
    }
    const float d = max / -8;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    const uint16_t dh = F32ToFp16(d);
    out.push_back(dh & 0xff);
    out.push_back(dh >> 8);
    for (int j = 0; j < 16; ++j) {
      const int lo = std::min(15, int(int8_t(v[j] * id + 8.5f)));
      const int hi = std::min(15, int(int8_t(v[j + 16] * id + 8.5f)));
      out.push_back(static_cast<uint8_t>(lo | (hi << 4)));
    }
  }
  return out;
}

std::vector<uint8_t> GgmlQ8K(const std::vector<float>& x) {
  std::vector<uint8_t> out;
  for (size_t b = 0; b < x.size() / 256; ++b) {
    const float* v = &x[256 * b];
    float amax = 0, max = 0;
    for (int j = 0; j < 256; ++j) {
      if (std::fabs(v[j]) > amax) {
        amax = std::fabs(v[j]);
        max = v[j];
      }
    }
    const float iscale = -127.0f / max;
    int8_t q[256];
    for (int j = 0; j < 256; ++j) q[j] = int8_t(std::min(127, int(std::nearbyint(iscale * v[j]))));
    int16_t bsums[16] = {};
    for (int j = 0; j < 256; ++j) bsums[j / 16] += q[j];
    const float d = 1 / iscale;
    const auto* p = reinterpret_cast<const uint8_t*>(&d);
    out.insert(out.end(), p, p + 4);
    out.insert(out.end(), reinterpret_cast<uint8_t*>(q), reinterpret_cast<uint8_t*>(q) + 256);
    out.insert(out.end(), reinterpret_cast<uint8_t*>(bsums),
               reinterpret_cast<uint8_t*>(bsums) + 32);
  }
  return out;
}

const int kE2m1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

std::vector<uint8_t> GgmlMxfp4(const std::vector<float>& x) {
  std::vector<uint8_t> out;
  for (size_t b = 0; b < x.size() / 32; ++b) {
    const float* v = &x[32 * b];
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const int e = amax > 0 ? int(std::floor(std::log2(amax))) - 2 + 127 : 0;
    out.push_back(static_cast<uint8_t>(e));
    const float d = std::ldexp(1.0f, e - 128);
    auto best = [&](float t) {
      int bi = 0;
      for (int i = 1; i < 16; ++i) {
        if (std::fabs(kE2m1Doubled[i] * d - t) < std::fabs(kE2m1Doubled[bi] * d - t)) bi = i;
      }
      return bi;
    };
    for (int j = 0; j < 16; ++j)
      out.push_back(static_cast<uint8_t>(best(v[j]) | (best(v[j + 16]) << 4)));
  }
  return out;
}

// Random blocks plus hand-made ones whose scaled values land exactly on rounding ties.
std::vector<float> TieBlocks() {
  auto x = RandomBlockScaled(32 * 12, 3);
  std::vector<float> ties(64, 0.0f);
  ties[0] = 127.0f;  // Q8_0 scale exactly 1
  ties[1] = 2.5f;    // roundf: away from zero
  ties[2] = -2.5f;
  ties[3] = 0.5f;
  ties[4] = -126.5f;
  ties[32] = -8.0f;  // Q4_0 scale exactly 1
  ties[33] = 0.5f;
  ties[34] = -0.5f;
  ties[35] = 3.5f;
  ties[36] = 7.5f;
  x.insert(x.end(), ties.begin(), ties.end());
  return x;
}

TEST(QuantTest, Q8_0AndQ4_0MatchGgmlReferenceBytes) {
  const auto x = TieBlocks();
  EXPECT_EQ(Quantize(DType::kQ8_0, x), GgmlQ8_0(x));
  EXPECT_EQ(Quantize(DType::kQ4_0, x), GgmlQ4_0(x));
}

TEST(QuantTest, Q8KAndMxfp4MatchGgmlReferenceBytes) {
  auto x = RandomBlockScaled(256 * 4, 4);
  x[5] = 1e-3f;  // make sure one tiny block exists for MXFP4's exponent
  EXPECT_EQ(Quantize(DType::kQ8_K, x), GgmlQ8K(x));
  EXPECT_EQ(Quantize(DType::kMXFP4, x), GgmlMxfp4(x));
}

// ---- Block layouts, checked against blocks assembled here from ggml's documented format -------

TEST(QuantTest, Q4KLayoutDecodesAsGgmlDefines) {
  std::mt19937 rng(5);
  uint8_t sc[8], mn[8], lv[256];
  for (int j = 0; j < 8; ++j) {
    sc[j] = rng() % 64;
    mn[j] = rng() % 64;
  }
  for (int i = 0; i < 256; ++i) lv[i] = rng() % 16;
  std::vector<uint8_t> blk(144);
  const uint16_t d = F32ToFp16(0.03125f), dmin = F32ToFp16(0.0078125f);
  std::memcpy(&blk[0], &d, 2);
  std::memcpy(&blk[2], &dmin, 2);
  uint8_t* s = &blk[4];
  for (int j = 0; j < 4; ++j) {
    s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
    s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
    s[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
  }
  uint8_t* qs = &blk[16];
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) qs[32 * c + l] = lv[64 * c + l] | (lv[64 * c + 32 + l] << 4);
  const auto y = Dequantize(DType::kQ4_K, blk, 256);
  for (int i = 0; i < 256; ++i) {
    const int j = i / 32;
    ASSERT_FLOAT_EQ(y[i], 0.03125f * sc[j] * lv[i] - 0.0078125f * mn[j]) << i;
  }
}

TEST(QuantTest, Q6KLayoutDecodesAsGgmlDefines) {
  std::mt19937 rng(6);
  int8_t sc[16];
  uint8_t lv[256];
  for (int g = 0; g < 16; ++g) sc[g] = static_cast<int8_t>(int(rng() % 256) - 128);
  for (int i = 0; i < 256; ++i) lv[i] = rng() % 64;
  std::vector<uint8_t> blk(210, 0);
  for (int h = 0; h < 2; ++h) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t* v = lv + 128 * h;
      blk[64 * h + l] = (v[l] & 15) | ((v[l + 64] & 15) << 4);
      blk[64 * h + l + 32] = (v[l + 32] & 15) | ((v[l + 96] & 15) << 4);
      blk[128 + 32 * h + l] =
          (v[l] >> 4) | ((v[l + 32] >> 4) << 2) | ((v[l + 64] >> 4) << 4) | ((v[l + 96] >> 4) << 6);
    }
  }
  std::memcpy(&blk[192], sc, 16);
  const uint16_t d = F32ToFp16(0.001953125f);
  std::memcpy(&blk[208], &d, 2);
  const auto y = Dequantize(DType::kQ6_K, blk, 256);
  for (int i = 0; i < 256; ++i)
    ASSERT_FLOAT_EQ(y[i], 0.001953125f * sc[i / 16] * (lv[i] - 32)) << i;
}

TEST(QuantTest, Mxfp4LayoutDecodesAsGgmlDefines) {
  std::vector<uint8_t> blk(17);
  blk[0] = 130;  // 2^(130-127) = 8, halved for the doubled table: 4
  for (int j = 0; j < 16; ++j) blk[1 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  const auto y = Dequantize(DType::kMXFP4, blk, 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 4.0f * kE2m1Doubled[j]);
    EXPECT_EQ(y[j + 16], 4.0f * kE2m1Doubled[15 - j]);
  }
}

}  // namespace
}  // namespace tandem::kernels
