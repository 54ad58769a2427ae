// Top-k / top-p selection and one draw from a row of logits, given the uniform number u of the
// draw: the plain reference the CUDA sampler (tandem/cuda/sampling.h) is checked against. The
// semantics are engine/sampling/sampler.h's, minus penalties and min-p:
//   temperature <= 0: argmax, lowest id on ties.
//   top-k (0 < top_k < n): keep the logits >= the k-th largest logit (ties at it are all kept).
//   weights w_i = exp((l_i - max l) / temperature) of the kept ids.
//   top-p (top_p < 1): keep the kept ids whose logit is >= t, for the largest t at which those
//   ids still hold at least top_p of the kept weight (the smallest prefix of the ids sorted by
//   weight that reaches top_p, widened to ties).
//   draw: walk the survivors in id order; the first id at which the running weight exceeds
//   u * total weight (the last survivor if rounding leaves none).
// Everything is computed in double. Pure; thread-safe. n >= 1, 0 <= u < 1, 0 < top_p <= 1.
#pragma once

#include <cstdint>

namespace tandem::kernels {

struct TopKTopPParams {
  float temperature = 1.0f;
  int32_t top_k = 0;   // <= 0: off
  float top_p = 1.0f;  // 1: off
};

int32_t SampleTopKTopPReference(const float* logits, int32_t n, const TopKTopPParams& p,
                                double u);

}  // namespace tandem::kernels
