// KV-cache quantisation kernels (tandem/kernels/kv_quant.h): the FP8-e4m3fn conversion against
// an independent formula and a brute-force nearest-code search, INT8/FP8 round-trip error
// bounds on random data against double references, non-finite inputs, and the slot layout.
#include "tandem/kernels/kv_quant.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/unit/kernels/kernel_test_util.h"

namespace tandem::kernels {
namespace {

// The OCP e4m3fn value of a code, computed in double from the format's definition.
double RefE4M3(uint8_t c) {
  const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -mag : mag;
}

// The code F32ToFp8E4M3 must return for a finite x: the nearest finite code (ties to the one
// with an even mantissa), saturating at 448. Brute force over the 127 non-negative codes.
uint8_t RefEncode(float x) {
  const double a = std::fabs(double(x));
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (a >= 448.0) return sign | 0x7e;
  int best = 0;
  double best_d = INFINITY;
  for (int c = 0; c <= 0x7e; ++c) {
    const double d = std::fabs(RefE4M3(uint8_t(c)) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | uint8_t(best);
}

TEST(Fp8E4M3Test, DecodesAll256CodesAsTheFormatDefines) {
  for (int c = 0; c < 256; ++c) {
    const double want = RefE4M3(uint8_t(c));
    const float got = Fp8E4M3ToF32(uint8_t(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
      EXPECT_TRUE(c == 0x7f || c == 0xff) << c;
    } else {
      EXPECT_EQ(double(got), want) << "code " << c;
      EXPECT_EQ(std::signbit(got), c >= 0x80) << c;
    }
  }
  EXPECT_EQ(Fp8E4M3ToF32(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4M3ToF32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(Fp8E4M3ToF32(0x08), std::ldexp(1.0f, -6));  // smallest normal
}

TEST(Fp8E4M3Test, EncodeRoundTripsEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(F32ToFp8E4M3(Fp8E4M3ToF32(uint8_t(c))), c) << c;
  }
}

TEST(Fp8E4M3Test, MidpointsRoundToEven) {
  // Every midpoint between neighbouring finite codes is exactly representable in f32.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = Fp8E4M3ToF32(uint8_t(c)), hi = Fp8E4M3ToF32(uint8_t(c + 1));
    const float mid = 0.5f * (lo + hi);
    const uint8_t even = (c & 1) == 0 ? uint8_t(c) : uint8_t(c + 1);
    EXPECT_EQ(F32ToFp8E4M3(mid), even) << "between " << c << " and " << c + 1;
    EXPECT_EQ(F32ToFp8E4M3(-mid), 0x80 | even);
    EXPECT_EQ(F32ToFp8E4M3(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(F32ToFp8E4M3(std::nextafter(mid, 1e9f)), c + 1);
  }
}

TEST(Fp8E4M3Test, RandomValuesEncodeToTheNearestCode) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> exp(-14.0f, 9.5f);
  std::uniform_int_distribution<int> sign(0, 1);
  for (int i = 0; i < 20000; ++i) {
    const float x = (sign(rng) ? -1.0f : 1.0f) * std::exp2(exp(rng));
    ASSERT_EQ(F32ToFp8E4M3(x), RefEncode(x)) << x;
  }
}

TEST(Fp8E4M3Test, SaturatesAndKeepsNaN) {
  for (float x : {448.0f, 449.0f, 463.9f, 464.0f, 480.0f, 1e6f, 3e38f, INFINITY}) {
    EXPECT_EQ(F32ToFp8E4M3(x), 0x7e) << x;
    EXPECT_EQ(F32ToFp8E4M3(-x), 0xfe) << x;
  }
  EXPECT_EQ(F32ToFp8E4M3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(F32ToFp8E4M3(-std::numeric_limits<float>::quiet_NaN()), 0xff);
  EXPECT_EQ(F32ToFp8E4M3(0.0f), 0x00);
  EXPECT_EQ(F32ToFp8E4M3(-0.0f), 0x80);
  EXPECT_EQ(F32ToFp8E4M3(std::ldexp(1.0f, -10)), 0x00);      // tie between 0 and 2^-9: even
  EXPECT_EQ(F32ToFp8E4M3(3 * std::ldexp(1.0f, -10)), 0x02);  // tie between 1 and 2: even
  EXPECT_EQ(F32ToFp8E4M3(1e-30f), 0x00);
}

TEST(KvQuantTest, NamesParse) {
  EXPECT_EQ(KvTypeFromName("int8"), DType::kI8);
  EXPECT_EQ(KvTypeFromName("FP8"), DType::kFp8E4M3);
  EXPECT_EQ(KvTypeFromName("fp8_e4m3"), DType::kFp8E4M3);
  EXPECT_EQ(KvTypeFromName("f16"), DType::kF16);
  EXPECT_EQ(KvTypeFromName("q8_0"), std::nullopt);
  EXPECT_EQ(KvTypeName(DType::kI8), "int8");
  EXPECT_EQ(KvTypeName(DType::kFp8E4M3), "fp8");
  // The KV-only types are not GGUF tensor types.
  EXPECT_EQ(GetDTypeTraits(static_cast<uint32_t>(DType::kI8)), std::nullopt);
  EXPECT_EQ(GetDTypeTraits(static_cast<uint32_t>(DType::kFp8E4M3)), std::nullopt);
}

// Rows of several magnitudes, so the scale is exercised over decades.
std::vector<std::vector<float>> TestRows(int head_dim) {
  std::vector<std::vector<float>> rows;
  uint32_t seed = 1;
  for (float sigma : {1e-3f, 0.05f, 1.0f, 30.0f, 4000.0f}) {
    for (int r = 0; r < 40; ++r) rows.push_back(testing::RandomNormal(head_dim, seed++, sigma));
  }
  return rows;
}

double AbsMax(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, std::fabs(double(v)));
  return m;
}

TEST(KvQuantTest, Int8RoundTripIsWithinHalfAStep) {
  for (int d : {64, 80, 128}) {
    for (const auto& x : TestRows(d)) {
      std::vector<int8_t> codes(d, 99);
      const float scale = QuantizeRowInt8(x.data(), d, codes.data());
      const double amax = AbsMax(x);
      EXPECT_NEAR(scale, amax / 127.0, amax / 127.0 * 1e-6);
      std::vector<float> back(d);
      testing::Poison(back);
      DequantizeRowInt8(codes.data(), scale, d, back.data());
      int at_max = 0;
      for (int i = 0; i < d; ++i) {
        ASSERT_GE(codes[i], -127);
        at_max += std::abs(codes[i]) == 127;
        // Half a step, plus the f32 rounding of x/scale and of code*scale.
        ASSERT_LE(std::fabs(double(back[i]) - x[i]), 0.5 * scale * (1 + 1e-5) + amax * 1e-7)
            << "d=" << d << " i=" << i << " x=" << x[i];
        // The code is the nearest integer to x/scale (double reference).
        ASSERT_LE(std::fabs(codes[i] - double(x[i]) / scale), 0.5 + 1e-5);
      }
      EXPECT_GE(at_max, 1);  // the absmax element uses the full range
    }
  }
}

TEST(KvQuantTest, Fp8RoundTripIsWithinHalfAnUlp) {
  for (int d : {64, 96, 128}) {
    for (const auto& x : TestRows(d)) {
      std::vector<uint8_t> codes(d, 0x55);
      const float scale = QuantizeRowFp8E4M3(x.data(), d, codes.data());
      const double amax = AbsMax(x);
      EXPECT_NEAR(scale, amax / 448.0, amax / 448.0 * 1e-6);
      std::vector<float> back(d);
      testing::Poison(back);
      DequantizeRowFp8E4M3(codes.data(), scale, d, back.data());
      for (int i = 0; i < d; ++i) {
        const double v = double(x[i]) / scale;  // in code units, |v| <= 448
        // Half an ulp of 3 mantissa bits (2^-4 relative) for normals, 2^-10 for subnormals.
        const double half_ulp = std::max(std::fabs(v) / 16.0, std::ldexp(1.0, -10));
        ASSERT_LE(std::fabs(double(back[i]) / scale - v), half_ulp * (1 + 1e-5) + 1e-4)
            << "d=" << d << " i=" << i << " x=" << x[i];
        ASSERT_EQ(codes[i], RefEncode(float(double(x[i]) / scale)) & 0xff);
      }
    }
  }
}

TEST(KvQuantTest, ZeroRowsHaveZeroScale) {
  std::vector<float> x(64, 0.0f);
  std::vector<int8_t> c8(64, 5);
  std::vector<uint8_t> cf(64, 5);
  EXPECT_EQ(QuantizeRowInt8(x.data(), 64, c8.data()), 0.0f);
  EXPECT_EQ(QuantizeRowFp8E4M3(x.data(), 64, cf.data()), 0.0f);
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(c8[i], 0);
    EXPECT_EQ(cf[i], 0);
  }
}

TEST(KvQuantTest, NonFiniteInputs) {
  std::vector<float> x = testing::RandomNormal(32, 5);
  x[3] = 0.0f;
  x[7] = 0.0f;
  x[11] = 0.0f;  // becomes NaN below
  const double amax = AbsMax(x);  // of the finite elements
  x[3] = INFINITY;
  x[7] = -INFINITY;
  {
    std::vector<int8_t> c(32);
    const float s = QuantizeRowInt8(x.data(), 32, c.data());
    EXPECT_NEAR(s, amax / 127, amax * 1e-7);  // infinities do not set the scale
    EXPECT_EQ(c[3], 127);
    EXPECT_EQ(c[7], -127);
    std::vector<uint8_t> f(32);
    const float sf = QuantizeRowFp8E4M3(x.data(), 32, f.data());
    EXPECT_NEAR(sf, amax / 448, amax * 1e-7);
    EXPECT_EQ(f[3], 0x7e);
    EXPECT_EQ(f[7], 0xfe);
  }
  x[11] = std::numeric_limits<float>::quiet_NaN();
  {
    // INT8 has no NaN code: the vector's scale becomes NaN so the NaN is not silently lost.
    std::vector<int8_t> c(32);
    EXPECT_TRUE(std::isnan(QuantizeRowInt8(x.data(), 32, c.data())));
    std::vector<uint8_t> f(32);
    const float sf = QuantizeRowFp8E4M3(x.data(), 32, f.data());
    EXPECT_NEAR(sf, amax / 448, amax * 1e-7);
    EXPECT_EQ(f[11], kFp8E4M3NaN);
    std::vector<float> back(32);
    DequantizeRowFp8E4M3(f.data(), sf, 32, back.data());
    EXPECT_TRUE(std::isnan(back[11]));
    EXPECT_FALSE(std::isnan(back[10]));
  }
}

TEST(KvQuantTest, SlotLayoutIsCodesThenPerHeadScales) {
  // 3 heads of 6: 18 code bytes padded to 20, then 3 f32 scales.
  constexpr int kHeads = 3, kDim = 6;
  EXPECT_EQ(KvQuantCodeBytes(kHeads, kDim), 20);
  EXPECT_EQ(KvQuantSlotBytes(kHeads, kDim), 32);
  EXPECT_EQ(KvQuantSlotBytes(8, 64), 8 * 64 + 32);
  for (DType t : {DType::kI8, DType::kFp8E4M3}) {
    std::vector<float> x = testing::RandomBlockScaled(kHeads * kDim, 9);
    x[kDim] *= 100;  // head 1 gets a much larger scale than its neighbours
    std::vector<uint8_t> slot(32, 0xAB);
    QuantizeKvSlot(t, x.data(), kHeads, kDim, slot.data());
    EXPECT_EQ(slot[18], 0);
    EXPECT_EQ(slot[19], 0);
    for (int h = 0; h < kHeads; ++h) {
      std::vector<uint8_t> codes(kDim);
      const float want = t == DType::kI8
                             ? QuantizeRowInt8(x.data() + h * kDim, kDim,
                                               reinterpret_cast<int8_t*>(codes.data()))
                             : QuantizeRowFp8E4M3(x.data() + h * kDim, kDim, codes.data());
      float got;
      std::memcpy(&got, slot.data() + 20 + 4 * h, 4);
      EXPECT_EQ(got, want) << h;
      EXPECT_EQ(0, std::memcmp(codes.data(), slot.data() + h * kDim, kDim)) << h;
    }
    std::vector<float> back(kHeads * kDim);
    testing::Poison(back);
    DequantizeKvSlot(t, slot.data(), kHeads, kDim, back.data());
    for (int h = 0; h < kHeads; ++h) {
      double amax = 0;
      for (int i = 0; i < kDim; ++i) amax = std::max(amax, std::fabs(double(x[h * kDim + i])));
      const double tol = t == DType::kI8 ? amax / 254 * 1.0001 : amax / 16 * 1.0001;
      for (int i = 0; i < kDim; ++i) {
        EXPECT_NEAR(back[h * kDim + i], x[h * kDim + i], tol) << h << "," << i;
      }
    }
  }
}

}  // namespace
}  // namespace tandem::kernels
