// Rotary position embedding, applied in place to one token's heads.
//
// kNormal rotates adjacent pairs (x[2i], x[2i+1]) — the llama layout in GGUF. kNeox rotates
// (x[i], x[i + d/2]) — qwen2. Angles follow ggml: theta_i = pos * base^(-2i/d) (computed by
// repeated multiplication in float, as ggml does), divided by freq_factors[i] when given
// (Llama 3 rope scaling), times freq_scale.
// YaRN (ext_factor != 0): pair i's angle blends the scaled angle with the unscaled one by
// ramp(i) * ext_factor, where ramp is 1 below corr_dims[0], 0 above corr_dims[1] and linear
// between (pairs that turn fast keep their angle, slow ones are interpolated), and cos and sin
// are multiplied by attn_factor * (1 + 0.1 ln(1 / freq_scale)); ggml's rope_yarn.
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
  float ext_factor = 0.0f;              // YaRN: 1
  float attn_factor = 1.0f;             // multiplies cos and sin
  float corr_dims[2] = {0.0f, 0.0f};    // YaRN: YarnCorrDims
};

// ggml_rope_yarn_corr_dims: the first and last pair index (as floats, floor and ceil) whose
// wavelength over the original context lies between beta_fast and beta_slow rotations.
void YarnCorrDims(int64_t n_rot, int64_t n_ctx_orig, float freq_base, float beta_fast,
                  float beta_slow, float out[2]);

// x holds n_heads * head_dim floats for one position.
void Rope(const RopeParams& p, float* x, int64_t n_heads, int64_t pos);
void RopeReference(const RopeParams& p, float* x, int64_t n_heads, int64_t pos);

}  // namespace tandem::kernels
