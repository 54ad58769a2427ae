// RoPE with ggml's angle arithmetic (and its YaRN blend when ext_factor != 0): theta starts at
// the position
// and is multiplied by theta_scale = base^(-2/n_rot) once per pair, all in float; each pair's
// angle is theta / freq_factor * freq_scale. Rope computes the cos/sin table once per call and
// applies it to every head; RopeReference recomputes the angles per head.
#include "tandem/kernels/rope.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace tandem::kernels {
namespace {

void PairAngle(const RopeParams& p, float theta, int64_t pair, float* c, float* s) {
  const float ff = p.freq_factors ? p.freq_factors[pair] : 1.0f;
  const float extrap = theta / ff;
  float angle = p.freq_scale * extrap;
  float mscale = p.attn_factor;
  if (p.ext_factor != 0.0f) {
    // pair == i0 / 2 of ggml's loop over dimension pairs.
    const float y = (static_cast<float>(pair) - p.corr_dims[0]) /
                    std::max(0.001f, p.corr_dims[1] - p.corr_dims[0]);
    const float mix = (1.0f - std::min(1.0f, std::max(0.0f, y))) * p.ext_factor;
    angle = angle * (1.0f - mix) + extrap * mix;
    mscale *= 1.0f + 0.1f * std::log(1.0f / p.freq_scale);
  }
  *c = std::cos(angle) * mscale;
  *s = std::sin(angle) * mscale;
}

void Rotate(const RopeParams& p, float* head, int64_t pair, float c, float s) {
  // kNormal pairs neighbours; kNeox pairs dimension i with i + n_rot/2.
  const int64_t i0 = p.mode == RopeMode::kNormal ? 2 * pair : pair;
  const int64_t i1 = p.mode == RopeMode::kNormal ? 2 * pair + 1 : pair + p.n_rot / 2;
  const float x0 = head[i0];
  const float x1 = head[i1];
  head[i0] = x0 * c - x1 * s;
  head[i1] = x0 * s + x1 * c;
}

}  // namespace

void YarnCorrDims(int64_t n_rot, int64_t n_ctx_orig, float freq_base, float beta_fast,
                  float beta_slow, float out[2]) {
  auto dim = [&](float rotations) {
    const float turns = rotations * 2.0f * static_cast<float>(M_PI);
    return static_cast<float>(n_rot) * std::log(static_cast<float>(n_ctx_orig) / turns) /
           (2.0f * std::log(freq_base));
  };
  out[0] = std::max(0.0f, std::floor(dim(beta_fast)));
  out[1] = std::min(static_cast<float>(n_rot - 1), std::ceil(dim(beta_slow)));
}

void Rope(const RopeParams& p, float* x, int64_t n_heads, int64_t pos) {
  const int64_t pairs = p.n_rot / 2;
  thread_local std::vector<float> table;
  table.resize(2 * pairs);
  const float theta_scale = std::pow(p.freq_base, -2.0f / static_cast<float>(p.n_rot));
  float theta = static_cast<float>(pos);
  for (int64_t i = 0; i < pairs; ++i) {
    PairAngle(p, theta, i, &table[2 * i], &table[2 * i + 1]);
    theta *= theta_scale;
  }
  for (int64_t h = 0; h < n_heads; ++h) {
    float* head = x + h * p.head_dim;
    for (int64_t i = 0; i < pairs; ++i) Rotate(p, head, i, table[2 * i], table[2 * i + 1]);
  }
}

void RopeReference(const RopeParams& p, float* x, int64_t n_heads, int64_t pos) {
  const float theta_scale = std::pow(p.freq_base, -2.0f / static_cast<float>(p.n_rot));
  for (int64_t h = 0; h < n_heads; ++h) {
    float theta = static_cast<float>(pos);
    for (int64_t i = 0; i < p.n_rot / 2; ++i) {
      float c, s;
      PairAngle(p, theta, i, &c, &s);
      Rotate(p, x + h * p.head_dim, i, c, s);
      theta *= theta_scale;
    }
  }
}

}  // namespace tandem::kernels
