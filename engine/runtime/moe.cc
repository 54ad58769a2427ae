#include "engine/runtime/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "engine/runtime/weight_matmul.h"
#include "tandem/kernels/activation.h"

namespace tandem::engine {
namespace {

void Grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// The smallest normal f16: llama.cpp clamps the sum of the chosen weights to it before dividing.
constexpr float kMinWeightSum = 6.103515625e-5f;

// Softmax as ggml computes it: shift by the max, sum the exponentials in double, scale.
void Softmax(const float* in, int64_t n, float* out) {
  const float mx = *std::max_element(in, in + n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (out[i] = std::exp(in[i] - mx));
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) out[i] *= inv;
}

}  // namespace

void SwiGluOai(const float* gate, const float* up, float* out, int64_t n) {
  constexpr float kAlpha = 1.702f, kLimit = 7.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = std::min(gate[i], kLimit);
    const float y = std::clamp(up[i], -kLimit, kLimit);
    out[i] = x / (1.0f + std::exp(kAlpha * (-x))) * (y + 1.0f);
  }
}

void RouteTokens(const float* logits, int64_t T, int32_t n_expert, int32_t k,
                 ExpertGating gating, bool normalize, Routing* out) {
  out->k = k;
  out->expert.resize(size_t(T) * k);
  out->weight.resize(size_t(T) * k);
  std::vector<float> probs(n_expert), chosen_logits(k), chosen_weights(k);
  std::vector<int32_t> order(n_expert);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * n_expert;
    if (gating == ExpertGating::kSoftmax) {
      Softmax(l, n_expert, probs.data());
    } else {
      std::copy(l, l + n_expert, probs.begin());  // chosen on the logits themselves
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
    });
    for (int32_t s = 0; s < k; ++s) out->expert[t * k + s] = order[s];
    if (gating == ExpertGating::kSoftmaxWeight) {
      for (int32_t s = 0; s < k; ++s) chosen_logits[s] = probs[order[s]];
      Softmax(chosen_logits.data(), k, chosen_weights.data());
      for (int32_t s = 0; s < k; ++s) out->weight[t * k + s] = chosen_weights[s];
      continue;
    }
    float chosen = 0;
    for (int32_t s = 0; s < k; ++s) chosen += probs[order[s]];
    const float scale = normalize ? 1.0f / std::max(chosen, kMinWeightSum) : 1.0f;
    for (int32_t s = 0; s < k; ++s) {
      out->weight[t * k + s] = normalize ? probs[order[s]] * scale : probs[order[s]];
    }
  }
}

void MoeFfn::Forward(const ModelConfig& c, const LayerWeights& w, const float* xn, int64_t T,
                     float* out, util::ThreadPool* pool) {
  const int64_t d = c.n_embd, ff = c.n_ff_exp;
  const int32_t ne = c.n_expert, k = c.n_expert_used;
  Grow(logits_, size_t(T) * ne);
  MatmulRows(w.ffn_gate_inp, xn, T, logits_.data(), pool);
  if (!w.gate_inp_b.empty()) {
    for (int64_t t = 0; t < T; ++t) {
      kernels::AddInPlace(logits_.data() + t * ne, w.gate_inp_b.data(), ne);
    }
  }
  RouteTokens(logits_.data(), T, ne, k, c.expert_gating, c.expert_weights_norm, &routing_);
  // The expert activation, after each projection's bias.
  auto activate = [&](int32_t e, float* gate, float* up, int64_t rows) {
    if (!w.exp_gate_b.empty()) {
      for (int64_t r = 0; r < rows; ++r) {
        kernels::AddInPlace(gate + r * ff, w.exp_gate_b.data() + e * ff, ff);
        kernels::AddInPlace(up + r * ff, w.exp_up_b.data() + e * ff, ff);
      }
    }
    if (c.swiglu_oai) {
      SwiGluOai(gate, up, gate, rows * ff);
    } else {
      kernels::SwiGlu(gate, up, gate, rows * ff);
    }
  };
  auto down_bias = [&](int32_t e, float* out_rows, int64_t rows) {
    if (w.exp_down_b.empty()) return;
    for (int64_t r = 0; r < rows; ++r) {
      kernels::AddInPlace(out_rows + r * d, w.exp_down_b.data() + e * d, d);
    }
  };

  // Group the (token, slot) pairs by expert, in token order within each group.
  counts_.assign(ne, 0);
  for (int32_t e : routing_.expert) ++counts_[e];
  offsets_.assign(ne + 1, 0);
  for (int32_t e = 0; e < ne; ++e) offsets_[e + 1] = offsets_[e] + counts_[e];
  rows_.resize(size_t(T) * k);
  fill_.assign(offsets_.begin(), offsets_.end() - 1);
  for (int64_t i = 0; i < T * k; ++i) rows_[fill_[routing_.expert[i]]++] = i;
  const int64_t most = *std::max_element(counts_.begin(), counts_.end());
  Grow(slot_out_, size_t(T) * k * d);
  Grow(in_, size_t(std::max(most, T)) * std::max(d, ff));
  Grow(gate_, size_t(std::max(most, T)) * ff);
  Grow(up_, size_t(std::max(most, T)) * ff);

  if (T == 1) {
    // One token: every chosen expert sees the same input, so their gate and up projections go
    // to the pool in one hand-off, and their down projections one expert per task.
    Grow(gate_, size_t(k) * ff);
    Grow(up_, size_t(k) * ff);
    gate_up_.clear();
    for (int32_t s = 0; s < k; ++s) {
      const int32_t e = routing_.expert[s];
      gate_up_.push_back({&w.exp_gate[e], gate_.data() + s * ff});
      gate_up_.push_back({&w.exp_up[e], up_.data() + s * ff});
    }
    MatmulSameInput(gate_up_, xn, 1, pool);
    for (int32_t s = 0; s < k; ++s) {
      activate(routing_.expert[s], gate_.data() + s * ff, up_.data() + s * ff, 1);
    }
    pool->ParallelFor(k, [&](int64_t b, int64_t end, int) {
      for (int64_t s = b; s < end; ++s) {
        const int32_t e = routing_.expert[s];
        MatmulRows(w.exp_down[e], gate_.data() + s * ff, 1, slot_out_.data() + s * d, nullptr);
        down_bias(e, slot_out_.data() + s * d, 1);
      }
    });
  } else {
    for (int32_t e = 0; e < ne; ++e) {
      const int64_t n = counts_[e];
      if (n == 0) continue;
      const int64_t* group = rows_.data() + offsets_[e];
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(in_.data() + i * d, xn + (group[i] / k) * d, d * sizeof(float));
      }
      const Projection gate_up[] = {{&w.exp_gate[e], gate_.data()}, {&w.exp_up[e], up_.data()}};
      MatmulSameInput(gate_up, in_.data(), n, pool);
      activate(e, gate_.data(), up_.data(), n);
      MatmulRows(w.exp_down[e], gate_.data(), n, in_.data(), pool);
      down_bias(e, in_.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(slot_out_.data() + group[i] * d, in_.data() + i * d, d * sizeof(float));
      }
    }
  }

  // Each token's output: its slots' weighted outputs summed in slot order, as llama.cpp adds
  // its per-slot views.
  for (int64_t t = 0; t < T; ++t) {
    float* o = out + t * d;
    for (int32_t s = 0; s < k; ++s) {
      const float wt = routing_.weight[t * k + s];
      const float* y = slot_out_.data() + (t * k + s) * d;
      if (s == 0) {
        for (int64_t i = 0; i < d; ++i) o[i] = y[i] * wt;
      } else {
        for (int64_t i = 0; i < d; ++i) o[i] += y[i] * wt;
      }
    }
  }

  if (c.n_ff_shexp > 0) {
    const int64_t sff = c.n_ff_shexp;
    Grow(gate_, size_t(T) * sff);
    Grow(up_, size_t(T) * sff);
    Grow(shared_, size_t(T) * d);
    const Projection gate_up[] = {{&w.sh_gate, gate_.data()}, {&w.sh_up, up_.data()}};
    MatmulSameInput(gate_up, xn, T, pool);
    kernels::SwiGlu(gate_.data(), up_.data(), gate_.data(), T * sff);
    MatmulRows(w.sh_down, gate_.data(), T, shared_.data(), pool);
    for (int64_t t = 0; t < T; ++t) {
      double g = 0;
      for (int64_t i = 0; i < d; ++i) g += double(w.sh_gate_inp[i]) * xn[t * d + i];
      const float gate = static_cast<float>(1.0 / (1.0 + std::exp(-g)));
      for (int64_t i = 0; i < d; ++i) out[t * d + i] += shared_[t * d + i] * gate;
    }
  }
}

}  // namespace tandem::engine
