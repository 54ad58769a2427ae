// Expert parallelism (EP) on the engine's side: an MoE model's experts split across the ranks of
// a worker group, each rank holding and computing only its own.
//
// Shape: rank 0 (the group's leader) runs everything but the experts it does not hold: the
// scheduler, attention with the KV cache, the router and its own experts; ranks 1..N-1 hold
// only experts. At each MoE layer MoeFfn routes the step's tokens, hands each remote rank the
// input rows of the (token, slot) pairs routed to its experts (ExpertPeers::Send), computes its
// own pairs meanwhile, then collects the remote rows (ExpertPeers::Receive) and sums every
// token's slots in slot order. A rank computes a group of rows with exactly the code rank 0
// would have run for it (ExpertRunner), so EP gives the tokens, and the bits, of one process
// when no expert is replicated. An expert held by several ranks (EPLB's redundant replicas)
// has its rows split between them in contiguous runs, lowest rank first.
//
// What carries the rows (UCX in the services, services/common/expert_group.h) is behind
// ExpertPeers, so this file knows nothing of transports or processes.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/util/thread_pool.h"
#include "engine/model/model.h"
#include "engine/runtime/weight_matmul.h"
#include "nlohmann/json.hpp"

namespace tandem::engine {

// Which experts each rank holds, per layer. JSON (`tandem place-experts --out`, and
// --expert-placement): {"ranks": N, "n_expert": E, "layers": [[[experts of rank 0], [rank 1],
// ...], ...]}; other keys are ignored.
struct ExpertPlacement {
  int32_t ranks = 0;
  int32_t n_expert = 0;
  std::vector<std::vector<std::vector<int32_t>>> layers;  // [layer][rank] -> experts, ascending

  // Expert e on rank e / (n_expert / ranks). INVALID_ARGUMENT unless ranks divides n_expert.
  static absl::StatusOr<ExpertPlacement> Contiguous(int32_t n_layer, int32_t n_expert,
                                                    int32_t ranks);
  // INVALID_ARGUMENT naming what is wrong: not the model's layer or expert count, not `ranks`
  // ranks, an expert id out of range, one held twice by a rank, or one no rank holds.
  static absl::StatusOr<ExpertPlacement> FromJson(const nlohmann::json& j, int32_t n_layer,
                                                  int32_t n_expert, int32_t ranks);
  static absl::StatusOr<ExpertPlacement> ReadFile(const std::string& path, int32_t n_layer,
                                                  int32_t n_expert, int32_t ranks);
  nlohmann::json ToJson() const;
  bool Holds(int32_t rank, int32_t layer, int32_t expert) const;
};

// The ranks holding each (layer, expert), ascending: a lookup table built once.
class ExpertHolders {
 public:
  ExpertHolders() = default;
  explicit ExpertHolders(const ExpertPlacement& p);
  std::span<const int32_t> of(int32_t layer, int32_t expert) const {
    const size_t i = size_t(layer) * n_expert_ + expert;
    return {ranks_.data() + begin_[i], size_t(begin_[i + 1] - begin_[i])};
  }

 private:
  int32_t n_expert_ = 0;
  std::vector<int32_t> begin_;  // [layer * n_expert + expert], then one past the end
  std::vector<int32_t> ranks_;
};

// One rank's share of one MoE layer: groups of input rows, each group for one expert, rows
// back to back in group order.
struct ExpertWork {
  int32_t layer = 0;
  // Every row is the same token's (a one-token step): the input then holds that row once.
  bool same_input = false;
  std::vector<int32_t> expert;  // per group
  std::vector<int64_t> rows;    // per group, > 0
  int64_t total_rows() const;
  int64_t input_rows() const { return same_input ? (expert.empty() ? 0 : 1) : total_rows(); }
  void Clear(int32_t l, bool one_token) {
    layer = l;
    same_input = one_token;
    expert.clear();
    rows.clear();
  }
};

// Computes expert groups: out row r = down(act(gate(in_r), up(in_r))) with its group's expert
// (biases added after each projection where the model has them), unweighted. The same code on
// every rank, so a group's rows have the same bits wherever they are computed.
class ExpertRunner {
 public:
  // in: [input_rows][n_embd]; out: [total_rows][n_embd]. The layer must hold every expert the
  // work names (its views loaded).
  void Run(const ModelConfig& c, const LayerWeights& w, const ExpertWork& work, const float* in,
           float* out, util::ThreadPool* pool);

 private:
  std::vector<float> gate_, up_;
  std::vector<Projection> gate_up_;
};

// The other ranks of an expert-parallel group, as rank 0 sees them. Called by one thread at a
// time (the engine's stepping thread); Send and Receive alternate per rank.
class ExpertPeers {
 public:
  virtual ~ExpertPeers() = default;
  virtual int32_t ranks() const = 0;
  virtual const ExpertHolders& holders() const = 0;
  // Hands rank `rank` (1..ranks-1) its work for a layer, with work.input_rows() rows of
  // n_embd floats at `in`; returns once they are in that rank's memory. UNAVAILABLE when the
  // rank is not in the group (it died, or has not joined), DEADLINE_EXCEEDED past the
  // group's deadline.
  virtual absl::Status Send(int32_t rank, const ExpertWork& work, const float* in) = 0;
  // Waits for the rank's output rows of the work sent last ([total_rows][n_embd]), within the
  // group's deadline. The rows stay valid until the next Send to that rank. UNAVAILABLE when
  // the rank left the group meanwhile, DEADLINE_EXCEEDED, or the rank's own error.
  virtual absl::StatusOr<const float*> Receive(int32_t rank, int64_t rows) = 0;
};

}  // namespace tandem::engine
