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

absl::Status MoeFfn::Forward(const ModelConfig& c, const LayerWeights& w, int32_t layer,
                             const float* xn, int64_t T, float* out, util::ThreadPool* pool,
                             ExpertPeers* peers) {
  const int64_t d = c.n_embd;
  const int32_t ne = c.n_expert, k = c.n_expert_used;
  Grow(logits_, size_t(T) * ne);
  MatmulRows(w.ffn_gate_inp, xn, T, logits_.data(), pool);
  if (!w.gate_inp_b.empty()) {
    for (int64_t t = 0; t < T; ++t) {
      kernels::AddInPlace(logits_.data() + t * ne, w.gate_inp_b.data(), ne);
    }
  }
  RouteTokens(logits_.data(), T, ne, k, c.expert_gating, c.expert_weights_norm, &routing_);

  // Group the (token, slot) pairs by expert, in token order within each group.
  counts_.assign(ne, 0);
  for (int32_t e : routing_.expert) ++counts_[e];
  offsets_.assign(ne + 1, 0);
  for (int32_t e = 0; e < ne; ++e) offsets_[e + 1] = offsets_[e] + counts_[e];
  rows_.resize(size_t(T) * k);
  fill_.assign(offsets_.begin(), offsets_.end() - 1);
  for (int64_t i = 0; i < T * k; ++i) rows_[fill_[routing_.expert[i]]++] = i;

  // Each rank's groups: an expert's pairs go to the rank holding it, split in contiguous runs
  // between the ranks holding a replica.
  const int32_t ranks = peers != nullptr ? peers->ranks() : 1;
  const bool one_token = T == 1;
  work_.resize(ranks);
  work_slots_.resize(ranks);
  work_in_.resize(ranks);
  for (int32_t r = 0; r < ranks; ++r) {
    work_[r].Clear(layer, one_token);
    work_slots_[r].clear();
  }
  for (int32_t e = 0; e < ne; ++e) {
    const int64_t n = counts_[e];
    if (n == 0) continue;
    const int32_t only = 0;
    std::span<const int32_t> holders =
        peers != nullptr ? peers->holders().of(layer, e) : std::span<const int32_t>(&only, 1);
    const int64_t h = std::min<int64_t>(static_cast<int64_t>(holders.size()), n);
    int64_t begin = offsets_[e];
    for (int64_t i = 0; i < h; ++i) {
      const int64_t len = n / h + (i < n % h ? 1 : 0);
      const int32_t r = holders[i];
      work_[r].expert.push_back(e);
      work_[r].rows.push_back(len);
      work_slots_[r].insert(work_slots_[r].end(), rows_.begin() + begin,
                            rows_.begin() + begin + len);
      begin += len;
    }
  }
  // The remote ranks' inputs go out first, so they compute while this rank does.
  auto gather = [&](int32_t r) -> const float* {
    if (one_token) return xn;
    const std::vector<int64_t>& slots = work_slots_[r];
    Grow(work_in_[r], slots.size() * d);
    for (size_t i = 0; i < slots.size(); ++i) {
      std::memcpy(work_in_[r].data() + i * d, xn + (slots[i] / k) * d, d * sizeof(float));
    }
    return work_in_[r].data();
  };
  for (int32_t r = 1; r < ranks; ++r) {
    if (work_[r].expert.empty()) continue;
    if (absl::Status st = peers->Send(r, work_[r], gather(r)); !st.ok()) return st;
  }
  auto scatter = [&](int32_t r, const float* rows) {
    const std::vector<int64_t>& slots = work_slots_[r];
    for (size_t i = 0; i < slots.size(); ++i) {
      std::memcpy(slot_out_.data() + slots[i] * d, rows + i * d, d * sizeof(float));
    }
  };
  Grow(slot_out_, size_t(T) * k * d);
  if (!work_[0].expert.empty()) {
    Grow(local_out_, work_slots_[0].size() * d);
    runner_.Run(c, w, work_[0], gather(0), local_out_.data(), pool);
    scatter(0, local_out_.data());
  }
  for (int32_t r = 1; r < ranks; ++r) {
    if (work_[r].expert.empty()) continue;
    absl::StatusOr<const float*> rows =
        peers->Receive(r, static_cast<int64_t>(work_slots_[r].size()));
    if (!rows.ok()) return rows.status();
    scatter(r, *rows);
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
  return absl::OkStatus();
}

}  // namespace tandem::engine
