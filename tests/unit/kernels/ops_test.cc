// RMSNorm, RoPE, SwiGLU and AddInPlace against their references and against the math.
#include <cmath>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/kernels/activation.h"
#include "tandem/kernels/cpu_features.h"
#include "tandem/kernels/norm.h"
#include "tandem/kernels/rope.h"
#include "tests/unit/kernels/kernel_test_util.h"

namespace tandem::kernels {
namespace {

using testing::AvailableIsas;
using testing::Poison;
using testing::RandomNormal;
using testing::ScopedIsaCap;

TEST(RmsNormTest, MatchesReferenceAndDefinition) {
  for (int64_t n : {1, 7, 64, 4096, 5003}) {
    const auto x = RandomNormal(n, static_cast<uint32_t>(n), 3.0f);
    auto w = RandomNormal(n, static_cast<uint32_t>(n + 1));
    const float eps = 1e-5f;
    std::vector<float> out(n), ref(n);
    Poison(out);
    Poison(ref);
    RmsNorm(x.data(), w.data(), out.data(), n, eps);
    RmsNormReference(x.data(), w.data(), ref.data(), n, eps);
    double ss = 0;
    for (float v : x) ss += double(v) * v;
    const double inv = 1.0 / std::sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; ++i) {
      // Optimised and reference differ only in the order of double additions.
      ASSERT_NEAR(out[i], ref[i], 1e-6 * std::fabs(ref[i])) << n << " " << i;
      ASSERT_NEAR(ref[i], x[i] * inv * w[i], 1e-6 * std::fabs(x[i] * inv * w[i]) + 1e-30)
          << n << " " << i;
    }
    // In place.
    auto y = x;
    RmsNorm(y.data(), w.data(), y.data(), n, eps);
    ASSERT_EQ(0, std::memcmp(y.data(), out.data(), n * sizeof(float)));
  }
}

// Rotation from the definition, in double: pair i turns by pos * base^(-2i/n_rot) / ff * scale.
std::vector<float> RopeDefinition(const RopeParams& p, const std::vector<float>& x, int64_t heads,
                                  int64_t pos) {
  std::vector<float> y = x;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < p.n_rot / 2; ++i) {
      double angle = pos * std::pow(double(p.freq_base), -2.0 * i / p.n_rot) * p.freq_scale;
      if (p.freq_factors) angle /= p.freq_factors[i];
      const int64_t a = h * p.head_dim + (p.mode == RopeMode::kNormal ? 2 * i : i);
      const int64_t b =
          h * p.head_dim + (p.mode == RopeMode::kNormal ? 2 * i + 1 : i + p.n_rot / 2);
      y[a] = static_cast<float>(x[a] * std::cos(angle) - x[b] * std::sin(angle));
      y[b] = static_cast<float>(x[a] * std::sin(angle) + x[b] * std::cos(angle));
    }
  }
  return y;
}

TEST(RopeTest, MatchesReferenceAndDefinitionInBothModes) {
  const int64_t heads = 3;
  std::vector<float> factors(32);
  for (size_t i = 0; i < factors.size(); ++i) factors[i] = 1.0f + 0.25f * static_cast<float>(i % 5);
  for (RopeMode mode : {RopeMode::kNormal, RopeMode::kNeox}) {
    for (int64_t n_rot : {64, 32}) {  // 32: partial rotation of a 64-wide head
      for (bool with_factors : {false, true}) {
        RopeParams p;
        p.mode = mode;
        p.head_dim = 64;
        p.n_rot = n_rot;
        p.freq_base = 10000.0f;
        p.freq_scale = with_factors ? 0.5f : 1.0f;
        p.freq_factors = with_factors ? factors.data() : nullptr;
        for (int64_t pos : {1, 7, 100, 3000}) {
          const auto x = RandomNormal(heads * 64, static_cast<uint32_t>(pos + n_rot));
          auto got = x, ref = x;
          Rope(p, got.data(), heads, pos);
          RopeReference(p, ref.data(), heads, pos);
          ASSERT_EQ(0, std::memcmp(got.data(), ref.data(), got.size() * sizeof(float)));
          const auto def = RopeDefinition(p, x, heads, pos);
          // The float angle recurrence drifts by ~pos * pair * ulp; small for small positions.
          const float tol = 2e-6f * pos * n_rot + 1e-5f;
          for (size_t i = 0; i < x.size(); ++i) {
            ASSERT_NEAR(got[i], def[i], tol)
                << "mode " << int(mode) << " pos " << pos << " i " << i;
            if (static_cast<int64_t>(i % 64) >= n_rot) {
              ASSERT_EQ(got[i], x[i]) << "unrotated dim changed";
            }
          }
        }
      }
    }
  }
}

// YaRN from its definition (the YaRN paper's blend, in double): pairs below the fast
// correction dim keep their unscaled angle, pairs above the slow one are interpolated by
// freq_scale, and the ones between blend linearly; the magnitude is scaled by
// attn_factor * (1 + 0.1 ln(1 / freq_scale)).
TEST(RopeTest, YarnBlendsExtrapolationAndInterpolationByPair) {
  RopeParams p;
  p.mode = RopeMode::kNeox;
  p.head_dim = 64;
  p.n_rot = 64;
  p.freq_base = 150000.0f;
  p.freq_scale = 1.0f / 32.0f;
  p.ext_factor = 1.0f;
  p.attn_factor = 0.9f;
  YarnCorrDims(p.n_rot, 4096, p.freq_base, 32.0f, 1.0f, p.corr_dims);
  // gpt-oss's numbers: dims from floor(8.09) to ceil(17.4).
  EXPECT_EQ(p.corr_dims[0], 8.0f);
  EXPECT_EQ(p.corr_dims[1], 18.0f);
  const int64_t heads = 2;
  for (int64_t pos : {1, 9, 250}) {
    const auto x = RandomNormal(heads * 64, static_cast<uint32_t>(pos));
    auto got = x, ref = x;
    Rope(p, got.data(), heads, pos);
    RopeReference(p, ref.data(), heads, pos);
    ASSERT_EQ(0, std::memcmp(got.data(), ref.data(), got.size() * sizeof(float)));
    const double mscale = 0.9 * (1.0 + 0.1 * std::log(32.0));
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < 32; ++i) {
        const double extrap = pos * std::pow(150000.0, -2.0 * i / 64);
        const double ramp = 1.0 - std::clamp((i - 8.0) / (18.0 - 8.0), 0.0, 1.0);
        const double angle = extrap / 32.0 * (1.0 - ramp) + extrap * ramp;
        const int64_t a = h * 64 + i, b = h * 64 + i + 32;
        const double ya = mscale * (x[a] * std::cos(angle) - x[b] * std::sin(angle));
        const double yb = mscale * (x[a] * std::sin(angle) + x[b] * std::cos(angle));
        const double tol = 2e-6 * pos * 64 + 1e-5;
        ASSERT_NEAR(got[a], ya, tol) << "pos " << pos << " pair " << i;
        ASSERT_NEAR(got[b], yb, tol) << "pos " << pos << " pair " << i;
      }
    }
  }
}

TEST(RopeTest, PositionZeroIsIdentityAndModesDiffer) {
  RopeParams p;
  p.head_dim = 64;
  p.n_rot = 64;
  const auto x = RandomNormal(2 * 64, 3);
  for (RopeMode mode : {RopeMode::kNormal, RopeMode::kNeox}) {
    p.mode = mode;
    auto y = x;
    Rope(p, y.data(), 2, 0);
    ASSERT_EQ(0, std::memcmp(y.data(), x.data(), x.size() * sizeof(float)));
  }
  auto normal = x, neox = x;
  p.mode = RopeMode::kNormal;
  Rope(p, normal.data(), 2, 5);
  p.mode = RopeMode::kNeox;
  Rope(p, neox.data(), 2, 5);
  double diff = 0;
  for (size_t i = 0; i < x.size(); ++i) diff += std::fabs(normal[i] - neox[i]);
  EXPECT_GT(diff, 1.0);
  // Both are rotations: each head keeps its norm.
  for (const auto* v : {&normal, &neox}) {
    double n0 = 0, n1 = 0;
    for (int i = 0; i < 64; ++i) {
      n0 += double(x[i]) * x[i];
      n1 += double((*v)[i]) * (*v)[i];
    }
    EXPECT_NEAR(n0, n1, 1e-4 * n0);
  }
}

TEST(SwiGluTest, MatchesReferenceOnEveryIsa) {
  const int64_t n = 1003;
  auto gate = RandomNormal(n, 1, 4.0f);
  gate[0] = 95.0f;   // exp(-x) underflows: silu(x) = x
  gate[1] = -95.0f;  // exp(-x) overflows: silu(x) = -0
  gate[2] = 0.0f;
  gate[3] = -20.0f;
  const auto up = RandomNormal(n, 2);
  std::vector<float> ref(n);
  Poison(ref);
  SwiGluReference(gate.data(), up.data(), ref.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    ASSERT_NEAR(ref[i], g / (1 + std::exp(-g)) * up[i], 1e-6 * std::fabs(ref[i]) + 1e-30);
  }
  for (Isa isa : AvailableIsas()) {
    ScopedIsaCap cap(isa);
    std::vector<float> out(n);
    Poison(out);
    SwiGlu(gate.data(), up.data(), out.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(out[i], ref[i], 1e-6 * std::fabs(ref[i]) + 1e-35)
          << IsaName(isa) << " x=" << gate[i];
    }
    auto inplace = gate;
    SwiGlu(inplace.data(), up.data(), inplace.data(), n);
    ASSERT_EQ(0, std::memcmp(inplace.data(), out.data(), n * sizeof(float))) << IsaName(isa);
  }
}

TEST(AddInPlaceTest, AddsElementwise) {
  auto a = RandomNormal(37, 1);
  const auto b = RandomNormal(37, 2);
  const auto a0 = a;
  AddInPlace(a.data(), b.data(), 37);
  for (int i = 0; i < 37; ++i) ASSERT_EQ(a[i], a0[i] + b[i]);
}

}  // namespace
}  // namespace tandem::kernels
