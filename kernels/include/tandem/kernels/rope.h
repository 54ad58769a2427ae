// Rotary position embedding, applied in place to one token's heads.
//
// kNormal rotates adjacent pairs (x[2i], x[2i+1]) — the llama layout in GGUF. kNeox rotates
// (x[i], x[i + d/2]) — qwen2. Angles follow ggml: theta_i = pos * base^(-2i/d) (computed by
// repeated multiplication in float, as ggml does), divided by freq_factors[i] when given
// (Llama 3 rope scaling), times freq_scale.
#pragma once

#include <cstdint>

namespace tandem::kernels {

enum class RopeMode { kNormal, kNeox };

struct RopeParams {
  RopeMode mode = RopeMode::kNormal;
  int64_t head_dim = 0;
  int64_t n_rot = 0;  // rotated dims (<= head_dim); usually head_dim
  float freq_base = 10000.0f;
  float freq_scale = 1.0f;
  const float* freq_factors = nullptr;  // n_rot / 2 entries or null
};

// x holds n_heads * head_dim floats for one position.
void Rope(const RopeParams& p, float* x, int64_t n_heads, int64_t pos);
void RopeReference(const RopeParams& p, float* x, int64_t n_heads, int64_t pos);

}  // namespace tandem::kernels
