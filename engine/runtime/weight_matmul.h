// Matmuls of a model's WeightViews (engine/model/model.h) by float activation rows, shared by
// the dense and MoE forward passes.
#pragma once

#include <cstdint>
#include <span>
#include <utility>

#include "common/util/thread_pool.h"
#include "engine/model/model.h"

namespace tandem::engine {

// out[b][r] = w[r] . in[b] for b < batch (rows of w.cols floats in, w.rows floats out).
void MatmulRows(const WeightView& w, const float* in, int64_t batch, float* out,
                util::ThreadPool* pool);

// Projections of the same input (Q/K/V, gate/up, several experts' gate/up): one pool hand-off
// for all when their weight types, widths and layouts agree (they do in most GGUF files;
// mixed-type ones go one by one). Each output is written as MatmulRows would.
using Projection = std::pair<const WeightView*, float*>;
void MatmulSameInput(std::span<const Projection> outs, const float* in, int64_t batch,
                     util::ThreadPool* pool);

}  // namespace tandem::engine
