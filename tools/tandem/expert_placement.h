// Expert placement for expert parallelism, EPLB-style: from the measured load of each
// (layer, expert), give the hottest experts extra replicas and pack all replicas onto the ranks
// so that each rank serves about the same number of tokens.
//
// Load: tandem_expert_tokens_total{layer, expert} from one or more /metrics scrapes (series of
// several workers are summed). A token routed to an expert with r replicas is assumed to go to
// each replica with probability 1/r, so a replica carries load / r.
//
// Placement, per layer: replicas first, one per expert, then `redundant` more, each to the
// expert whose per-replica load is highest (at most one replica per rank); then the replicas,
// heaviest first, each to the least-loaded rank that has a free slot and does not hold that
// expert yet. Every rank gets (n_expert + redundant) / ranks slots.
// Imbalance of a layer: the most-loaded rank's load over the mean rank load (1 is perfect).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/runtime/expert_parallel.h"
#include "nlohmann/json.hpp"

namespace tandem::tools {

struct ExpertLoad {
  int32_t n_layer = 0;
  int32_t n_expert = 0;
  std::vector<double> tokens;  // [layer * n_expert + expert]
  double at(int32_t layer, int32_t expert) const {
    return tokens[size_t(layer) * n_expert + expert];
  }
};

// The tandem_expert_tokens_total series of a Prometheus text exposition. INVALID_ARGUMENT when
// there are none, or a layer/expert label is missing or not a number.
absl::StatusOr<ExpertLoad> ParseExpertLoad(std::string_view exposition);

using Placement = engine::ExpertPlacement;

// INVALID_ARGUMENT unless ranks >= 1, redundant >= 0, (n_expert + redundant) divides by ranks
// and each expert can fit its replicas on distinct ranks.
absl::StatusOr<Placement> PlaceExperts(const ExpertLoad& load, int32_t ranks, int32_t redundant);

double Imbalance(const ExpertLoad& load, const Placement& p, int32_t layer);


// `tandem place-experts`: the load of every scrape file summed, the placement written to
// out_path as ExpertPlacement::ToJson (with "imbalance": per layer, before (contiguous) and
// after), and a summary on stdout.
struct PlaceExpertsOptions {
  std::vector<std::string> load_paths;  // /metrics scrapes of the workers
  int32_t ranks = 2;
  int32_t redundant = 0;
  std::string out_path;
};
absl::Status RunPlaceExperts(const PlaceExpertsOptions& o);

}  // namespace tandem::tools
