// SwiGLU and residual add. SwiGlu uses the AVX2 version (a vectorised exp accurate to a couple
// of ulp) when the CPU has it; SwiGluReference is the scalar libm definition.
#include "tandem/kernels/activation.h"

#include <cmath>

#include "internal.h"
#include "tandem/kernels/cpu_features.h"

namespace tandem::kernels {

void SwiGlu(const float* gate, const float* up, float* out, int64_t n) {
#if TANDEM_KERNELS_X86
  if (ActiveIsa() >= Isa::kAvx2) {
    internal::avx2::SwiGlu(gate, up, out, n);
    return;
  }
#endif
  SwiGluReference(gate, up, out, n);
}

void SwiGluReference(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void AddInPlace(float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

}  // namespace tandem::kernels
