// SwiGLU: out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)). out may alias gate.
#pragma once

#include <cstdint>

namespace tandem::kernels {

void SwiGlu(const float* gate, const float* up, float* out, int64_t n);
void SwiGluReference(const float* gate, const float* up, float* out, int64_t n);

// Adds b into a elementwise.
void AddInPlace(float* a, const float* b, int64_t n);

}  // namespace tandem::kernels
