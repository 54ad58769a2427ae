// Top-k / top-p sampling on the GPU: one CTA per row of logits, with the semantics of
// kernels::SampleTopKTopPReference (tandem/kernels/topk_topp.h) given each row's uniform draw.
// Nothing sorts the vocabulary: the top-k and top-p cut-offs are found by a bisection over the
// 32-bit order-preserving keys of the logits (one counting pass per bit), then a block-wide
// scan in id order makes the draw. Weights are summed in float, so a draw within float rounding
// of a boundary may pick the neighbouring id.
// Ownership: device arrays owned by the caller. Threading and errors: see cuda_common.h.
#pragma once

#include <cstdint>

#include "tandem/cuda/cuda_common.h"

namespace tandem::kernels::cuda {

struct SampleParams {
  const float* logits = nullptr;  // [n_rows][vocab], rows `stride` floats apart (0: vocab)
  int64_t stride = 0;
  int32_t n_rows = 0;
  int32_t vocab = 0;
  const float* temperature = nullptr;  // n_rows each; <= 0: greedy
  const int32_t* top_k = nullptr;      // n_rows each; <= 0: off
  const float* top_p = nullptr;        // n_rows each; 1: off
  const float* u = nullptr;            // n_rows uniform draws in [0, 1)
  int32_t* out = nullptr;              // n_rows token ids
};

absl::Status SampleTopKTopP(const SampleParams& p, Stream stream);

}  // namespace tandem::kernels::cuda
