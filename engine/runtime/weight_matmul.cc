#include "engine/runtime/weight_matmul.h"

#include <vector>

#include "tandem/kernels/matmul.h"

namespace tandem::engine {

void MatmulRows(const WeightView& w, const float* in, int64_t batch, float* out,
                util::ThreadPool* pool) {
  kernels::MatmulParams p;
  p.weight_type = w.type;
  p.weight = w.data;
  p.rows = w.rows;
  p.cols = w.cols;
  p.input = in;
  p.input_stride = w.cols;
  p.batch = batch;
  p.output = out;
  p.output_stride = w.rows;
  p.packed = w.packed;
  kernels::Matmul(p, pool);
}

void MatmulSameInput(std::span<const Projection> outs, const float* in, int64_t batch,
                     util::ThreadPool* pool) {
  if (outs.empty()) return;
  const WeightView& first = *outs.front().first;
  bool same = true;
  for (const auto& [w, out] : outs) {
    same = same && w->type == first.type && w->cols == first.cols && w->packed == first.packed;
  }
  if (!same) {
    for (const auto& [w, out] : outs) MatmulRows(*w, in, batch, out, pool);
    return;
  }
  std::vector<kernels::MatmulTarget> targets;
  targets.reserve(outs.size());
  for (const auto& [w, out] : outs) targets.push_back({w->data, w->rows, out, w->rows});
  kernels::MatmulMulti(first.type, first.cols, in, first.cols, batch, targets, pool, first.packed);
}

}  // namespace tandem::engine
