#include "tandem/kernels/fp16.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/kernels/cpu_features.h"
#include "tests/unit/kernels/kernel_test_util.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tandem::kernels {
namespace {

using testing::AvailableIsas;
using testing::ScopedIsaCap;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
bool HalfIsNan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

// Value of a half from the IEEE definition, in double.
double HalfValue(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v;
  if (exp == 0x1f) {
    v = mant ? NAN : INFINITY;
  } else if (exp == 0) {
    v = std::ldexp(mant, -24);
  } else {
    v = std::ldexp(1024 + mant, exp - 25);
  }
  return sign ? -v : v;
}

// f32 -> f16 from the definition: scale into the half's integer grid in double (exact), round to
// nearest even there, and re-encode.
uint16_t HalfFromDefinition(float f) {
  const uint16_t sign = (Bits(f) >> 16) & 0x8000;
  if (std::isnan(f)) return sign | 0x7e00;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14))
    return sign | static_cast<uint16_t>(std::nearbyint(a * std::ldexp(1.0, 24)));
  int e;
  std::frexp(a, &e);                                       // a = m * 2^e, m in [0.5, 1)
  double q = std::nearbyint(a * std::ldexp(1.0, 11 - e));  // in [1024, 2048]
  int exp = e - 1 + 15;
  if (q == 2048) {
    q = 1024;
    ++exp;
  }
  return sign | static_cast<uint16_t>((exp << 10) | (static_cast<int>(q) - 1024));
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) uint16_t HalfFromF16c(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
uint16_t HalfFromF16c(float f) { return HalfFromDefinition(f); }
#endif

// Floats around every rounding boundary of the half grid: each 13-bit-truncated pattern, with
// low bits at the tie, just below and just above it, and a few random ones.
std::vector<float> BoundarySweep() {
  std::vector<float> out;
  std::mt19937 rng(7);
  const uint32_t lows[] = {0, 1, 0xfff, 0x1000, 0x1001, 0x1fff};
  for (uint32_t hi = 0; hi < (1u << 19); hi += 3) {
    for (uint32_t low : lows) out.push_back(FromBits((hi << 13) | low));
    out.push_back(FromBits((hi << 13) | (rng() & 0x1fff)));
  }
  return out;
}

TEST(Fp16Test, ExhaustiveHalfToFloatMatchesDefinitionAndRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = Fp16ToF32(static_cast<uint16_t>(h));
    if (HalfIsNan(h)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      // Quiet NaN with the payload kept, as ggml's conversion gives on x86.
      EXPECT_EQ(Bits(f), ((h & 0x8000u) << 16) | 0x7fc00000u | ((h & 0x3ffu) << 13)) << h;
      EXPECT_EQ(F32ToFp16(f), (h & 0x8000) | 0x7e00) << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), HalfValue(h)) << h;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << h;
    ASSERT_EQ(F32ToFp16(f), h) << h;
  }
}

TEST(Fp16Test, FloatToHalfRoundsToNearestEvenEverywhere) {
  const bool have_f16c = DetectedIsa() >= Isa::kAvx2;
  int checked = 0;
  for (float f : BoundarySweep()) {
    for (float v : {f, -f}) {
      const uint16_t got = F32ToFp16(v);
      ASSERT_EQ(got, HalfFromDefinition(v)) << std::hexfloat << v;
      if (have_f16c && !std::isnan(v)) {
        ASSERT_EQ(got, HalfFromF16c(v)) << std::hexfloat << v;
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000000);
  EXPECT_EQ(F32ToFp16(65519.996f), 0x7bff);
  EXPECT_EQ(F32ToFp16(65520.0f), 0x7c00);
  EXPECT_EQ(F32ToFp16(-INFINITY), 0xfc00);
  EXPECT_EQ(F32ToFp16(0x1p-25f), 0x0000);         // tie between 0 and the smallest subnormal: even
  EXPECT_EQ(F32ToFp16(0x1.000002p-25f), 0x0001);  // just above the tie
  EXPECT_EQ(F32ToFp16(-0.0f), 0x8000);
}

TEST(Fp16Test, RowConversionsMatchScalarOnEveryIsa) {
  std::vector<uint16_t> halves(65536 + 5);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i * 40503u);
  std::vector<float> floats = BoundarySweep();
  floats.resize(200003);
  floats[17] = NAN;
  floats[18] = -NAN;
  floats[19] = FromBits(0x7f800001);  // signalling NaN with a payload F16C would keep
  floats[20] = INFINITY;
  for (Isa isa : AvailableIsas()) {
    ScopedIsaCap cap(isa);
    std::vector<float> f(halves.size(), 123.0f);
    Fp16ToF32Row(halves.data(), f.data(), static_cast<int64_t>(halves.size()));
    for (size_t i = 0; i < halves.size(); ++i) {
      ASSERT_EQ(Bits(f[i]), Bits(Fp16ToF32(halves[i]))) << IsaName(isa) << " half " << halves[i];
    }
    std::vector<uint16_t> h(floats.size(), 0x1234);
    F32ToFp16Row(floats.data(), h.data(), static_cast<int64_t>(floats.size()));
    for (size_t i = 0; i < floats.size(); ++i) {
      ASSERT_EQ(h[i], F32ToFp16(floats[i])) << IsaName(isa) << " " << std::hexfloat << floats[i];
    }
  }
}

TEST(Fp16Test, Bfloat16RoundsToNearestEvenAndKeepsNanQuiet) {
  EXPECT_EQ(F32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(F32ToBf16(FromBits(0x3f808000)), 0x3f80);  // tie, even stays
  EXPECT_EQ(F32ToBf16(FromBits(0x3f818000)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(F32ToBf16(FromBits(0x3f808001)), 0x3f81);
  EXPECT_EQ(F32ToBf16(FromBits(0x7f800001)) & 0x7fc0, 0x7fc0);
  EXPECT_EQ(Bf16ToF32(0xc040), -3.0f);
}

}  // namespace
}  // namespace tandem::kernels
