// The mixture-of-experts FFN of one layer on the CPU (ModelConfig::is_moe).
//
// Route: each token's router logits (ffn_gate_inp . x) go through a softmax over all experts;
// the n_expert_used highest probabilities pick its experts, in descending order (ties to the
// lower expert id), and are its weights, renormalised to sum 1 when expert_weights_norm. This
// is llama.cpp's build_moe_ffn with the softmax gating function.
//
// Forward: tokens are grouped by expert, so each chosen expert's gate, up and down matrices
// are read once per step whatever the number of tokens routed to it, and experts no token
// chose are not read at all (a batch-1 decode reads n_expert_used of them). A token's output is
// the sum over its slots, in slot order, of weight * down(silu(gate(x)) * up(x)), plus the
// shared expert scaled by sigmoid(ffn_gate_inp_shexp . x) when the model has one.
#pragma once

#include <cstdint>
#include <vector>

#include "common/util/thread_pool.h"
#include "engine/model/model.h"

namespace tandem::engine {

struct Routing {
  int32_t k = 0;                // slots per token (n_expert_used)
  std::vector<int32_t> expert;  // [token * k + slot]
  std::vector<float> weight;    // [token * k + slot]
};

// Routes T tokens from their router logits ([T][n_expert], row-major); softmax gating.
void RouteTokens(const float* logits, int64_t T, int32_t n_expert, int32_t k, bool normalize,
                 Routing* out);

class MoeFfn {
 public:
  // out[T][n_embd] = the layer's MoE FFN of xn[T][n_embd] (out is overwritten).
  void Forward(const ModelConfig& c, const LayerWeights& w, const float* xn, int64_t T, float* out,
               util::ThreadPool* pool);
  // Tokens routed to each expert of the last Forward's layer, n_expert entries.
  const std::vector<int64_t>& last_expert_tokens() const { return counts_; }

 private:
  Routing routing_;
  std::vector<float> logits_, in_, gate_, up_, slot_out_, shared_;
  std::vector<int64_t> counts_, offsets_;
  std::vector<int64_t> rows_;  // per expert group: (token * k + slot), grouped by expert
};

}  // namespace tandem::engine
