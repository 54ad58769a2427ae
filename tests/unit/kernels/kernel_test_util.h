// Shared helpers for the kernel tests: seeded random data, NaN poisoning, and a scope guard that
// caps the ISA level so one test body runs every code path the machine has.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "tandem/kernels/cpu_features.h"

namespace tandem::kernels::testing {

inline std::vector<float> RandomNormal(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Normal data whose scale changes from one 32-element block to the next (over ~3 decades), as
// real activations and weights do; catches kernels that mix up per-block scales.
inline std::vector<float> RandomBlockScaled(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-1.5f, 1.5f);
  std::vector<float> v(n);
  float scale = 1.0f;
  for (size_t i = 0; i < n; ++i) {
    if (i % 32 == 0) scale = std::pow(10.0f, log_scale(rng));
    v[i] = dist(rng) * scale;
  }
  return v;
}

inline void Poison(std::vector<float>& v) {
  std::fill(v.begin(), v.end(), std::numeric_limits<float>::quiet_NaN());
}

inline std::vector<Isa> AvailableIsas() {
  std::vector<Isa> out;
  for (int i = 0; i <= static_cast<int>(DetectedIsa()); ++i) out.push_back(static_cast<Isa>(i));
  return out;
}

class ScopedIsaCap {
 public:
  explicit ScopedIsaCap(Isa cap) { SetIsaCapForTesting(cap); }
  ~ScopedIsaCap() { SetIsaCapForTesting(Isa::kAvx512Bf16); }
  ScopedIsaCap(const ScopedIsaCap&) = delete;
  ScopedIsaCap& operator=(const ScopedIsaCap&) = delete;
};

}  // namespace tandem::kernels::testing
