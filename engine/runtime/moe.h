// The mixture-of-experts FFN of one layer on the CPU (ModelConfig::is_moe).
//
// Route: each token's router logits (ffn_gate_inp . x, plus its bias if any) pick its
// n_expert_used experts, in descending order (ties to the lower expert id). With
// ExpertGating::kSoftmax the weights are the experts' probabilities under a softmax over all
// experts, renormalised to sum 1 when expert_weights_norm; with kSoftmaxWeight (gpt-oss) they
// are a softmax over the chosen experts' logits. This is llama.cpp's build_moe_ffn.
//
// Forward: tokens are grouped by expert, so each chosen expert's gate, up and down matrices
// are read once per step whatever the number of tokens routed to it, and experts no token
// chose are not read at all (a batch-1 decode reads n_expert_used of them). A token's output is
// the sum over its slots, in slot order, of weight * down(act(gate(x), up(x))), plus the
// shared expert scaled by sigmoid(ffn_gate_inp_shexp . x) when the model has one. act is
// SwiGLU, or gpt-oss's clamped variant (ModelConfig::swiglu_oai); expert biases, when the
// model has them, are added after each projection.
//
// Expert parallelism (engine/runtime/expert_parallel.h): given ExpertPeers, the experts other
// ranks hold are computed there, while this rank computes its own.
#pragma once

#include <cstdint>
#include <vector>

#include "common/util/thread_pool.h"
#include "absl/status/status.h"
#include "engine/model/model.h"
#include "engine/runtime/expert_parallel.h"

namespace tandem::engine {

struct Routing {
  int32_t k = 0;                // slots per token (n_expert_used)
  std::vector<int32_t> expert;  // [token * k + slot]
  std::vector<float> weight;    // [token * k + slot]
};

// Routes T tokens from their router logits ([T][n_expert], row-major).
void RouteTokens(const float* logits, int64_t T, int32_t n_expert, int32_t k,
                 ExpertGating gating, bool normalize, Routing* out);

// gpt-oss's expert activation (ModelConfig::swiglu_oai), as ggml's swiglu_oai with alpha 1.702
// and limit 7.
void SwiGluOai(const float* gate, const float* up, float* out, int64_t n);

class MoeFfn {
 public:
  // out[T][n_embd] = layer `layer`'s MoE FFN of xn[T][n_embd] (out is overwritten). With
  // peers, this rank computes only the experts the placement gives rank 0; an error is the
  // peers' (UNAVAILABLE, DEADLINE_EXCEEDED), and out is then undefined.
  absl::Status Forward(const ModelConfig& c, const LayerWeights& w, int32_t layer,
                       const float* xn, int64_t T, float* out, util::ThreadPool* pool,
                       ExpertPeers* peers = nullptr);
  // Tokens routed to each expert of the last Forward's layer, n_expert entries.
  const std::vector<int64_t>& last_expert_tokens() const { return counts_; }

 private:
  Routing routing_;
  std::vector<float> logits_, gate_, up_, slot_out_, shared_;
  std::vector<int64_t> counts_, offsets_;
  std::vector<int64_t> rows_;  // per expert group: (token * k + slot), grouped by expert
  std::vector<int64_t> fill_;   // next free index of each expert's group while grouping
  // Per rank: its work, the (token * k + slot) of each of its rows, its gathered inputs and
  // (rank 0) outputs.
  std::vector<ExpertWork> work_;
  std::vector<std::vector<int64_t>> work_slots_;
  std::vector<std::vector<float>> work_in_;
  std::vector<float> local_out_;
  ExpertRunner runner_;
};

}  // namespace tandem::engine
