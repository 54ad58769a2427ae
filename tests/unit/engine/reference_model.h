// A plain double-precision forward pass (llama, qwen2, qwen3 and their MoE variants) over a
// whole sequence, written straight from the architectures' definitions with no paging, batching
// or SIMD: the ground truth that Engine::Step is compared against.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/model/model.h"

namespace tandem::testing {

// Logits (n_vocab) after the last token of `tokens`.
std::vector<double> ReferenceForward(const engine::Model& m, const std::vector<int32_t>& tokens);

}  // namespace tandem::testing
