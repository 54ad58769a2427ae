#include "engine/runtime/expert_parallel.h"

#include <algorithm>
#include <fstream>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "engine/runtime/moe.h"
#include "tandem/kernels/activation.h"

namespace tandem::engine {

absl::StatusOr<ExpertPlacement> ExpertPlacement::Contiguous(int32_t n_layer, int32_t n_expert,
                                                            int32_t ranks) {
  if (ranks < 1 || n_expert % ranks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(n_expert, " experts do not split evenly over ", ranks, " ranks"));
  }
  ExpertPlacement p;
  p.ranks = ranks;
  p.n_expert = n_expert;
  const int32_t per = n_expert / ranks;
  std::vector<std::vector<int32_t>> layer(ranks);
  for (int32_t e = 0; e < n_expert; ++e) layer[e / per].push_back(e);
  p.layers.assign(n_layer, layer);
  return p;
}

absl::StatusOr<ExpertPlacement> ExpertPlacement::FromJson(const nlohmann::json& j,
                                                          int32_t n_layer, int32_t n_expert,
                                                          int32_t ranks) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("expert placement: ", parts...));
  };
  if (!j.is_object() || !j.contains("layers") || !j["layers"].is_array()) {
    return bad("not an object with a \"layers\" array");
  }
  ExpertPlacement p;
  p.ranks = ranks;
  p.n_expert = n_expert;
  if (j.contains("ranks") && j["ranks"] != ranks) {
    return bad("written for ", j["ranks"].dump(), " ranks, the group has ", ranks);
  }
  if (j.contains("n_expert") && j["n_expert"] != n_expert) {
    return bad("written for ", j["n_expert"].dump(), " experts, the model has ", n_expert);
  }
  const nlohmann::json& layers = j["layers"];
  if (static_cast<int64_t>(layers.size()) != n_layer) {
    return bad(layers.size(), " layers, the model has ", n_layer);
  }
  for (int32_t l = 0; l < n_layer; ++l) {
    const nlohmann::json& lj = layers[l];
    if (!lj.is_array() || static_cast<int64_t>(lj.size()) != ranks) {
      return bad("layer ", l, " does not list ", ranks, " ranks");
    }
    std::vector<int32_t> held(n_expert, 0);
    std::vector<std::vector<int32_t>> layer(ranks);
    for (int32_t r = 0; r < ranks; ++r) {
      if (!lj[r].is_array()) return bad("layer ", l, " rank ", r, " is not a list of experts");
      for (const nlohmann::json& e : lj[r]) {
        if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() >= n_expert) {
          return bad("layer ", l, " rank ", r, ": ", e.dump(), " is not an expert id below ",
                     n_expert);
        }
        const int32_t id = e.get<int32_t>();
        if (std::find(layer[r].begin(), layer[r].end(), id) != layer[r].end()) {
          return bad("layer ", l, " rank ", r, " holds expert ", id, " twice");
        }
        layer[r].push_back(id);
        ++held[id];
      }
      std::sort(layer[r].begin(), layer[r].end());
    }
    for (int32_t e = 0; e < n_expert; ++e) {
      if (held[e] == 0) return bad("layer ", l, ": no rank holds expert ", e);
    }
    p.layers.push_back(std::move(layer));
  }
  return p;
}

absl::StatusOr<ExpertPlacement> ExpertPlacement::ReadFile(const std::string& path,
                                                          int32_t n_layer, int32_t n_expert,
                                                          int32_t ranks) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("expert placement: cannot read ", path));
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat("expert placement: ", path, " is not JSON"));
  }
  return FromJson(j, n_layer, n_expert, ranks);
}

nlohmann::json ExpertPlacement::ToJson() const {
  nlohmann::json ls = nlohmann::json::array();
  for (const auto& layer : layers) ls.push_back(layer);
  return {{"ranks", ranks}, {"n_expert", n_expert}, {"layers", ls}};
}

bool ExpertPlacement::Holds(int32_t rank, int32_t layer, int32_t expert) const {
  const std::vector<int32_t>& held = layers[layer][rank];
  return std::binary_search(held.begin(), held.end(), expert);
}

ExpertHolders::ExpertHolders(const ExpertPlacement& p) : n_expert_(p.n_expert) {
  const size_t n = p.layers.size() * size_t(p.n_expert);
  std::vector<std::vector<int32_t>> by(n);
  for (size_t l = 0; l < p.layers.size(); ++l) {
    for (int32_t r = 0; r < p.ranks; ++r) {
      for (int32_t e : p.layers[l][r]) by[l * p.n_expert + e].push_back(r);
    }
  }
  begin_.reserve(n + 1);
  for (const auto& rs : by) {
    begin_.push_back(static_cast<int32_t>(ranks_.size()));
    ranks_.insert(ranks_.end(), rs.begin(), rs.end());
  }
  begin_.push_back(static_cast<int32_t>(ranks_.size()));
}

int64_t ExpertWork::total_rows() const {
  return std::accumulate(rows.begin(), rows.end(), int64_t{0});
}

void ExpertRunner::Run(const ModelConfig& c, const LayerWeights& w, const ExpertWork& work,
                       const float* in, float* out, util::ThreadPool* pool) {
  const int64_t d = c.n_embd, ff = c.n_ff_exp;
  const size_t groups = work.expert.size();
  if (groups == 0) return;
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

  if (work.same_input) {
    // One token: every group is one row of the same input, so all the gate and up projections
    // go to the pool in one hand-off, and the down projections one expert per task.
    if (gate_.size() < groups * ff) gate_.resize(groups * ff);
    if (up_.size() < groups * ff) up_.resize(groups * ff);
    gate_up_.clear();
    for (size_t s = 0; s < groups; ++s) {
      const int32_t e = work.expert[s];
      gate_up_.push_back({&w.exp_gate[e], gate_.data() + s * ff});
      gate_up_.push_back({&w.exp_up[e], up_.data() + s * ff});
    }
    MatmulSameInput(gate_up_, in, 1, pool);
    for (size_t s = 0; s < groups; ++s) {
      activate(work.expert[s], gate_.data() + s * ff, up_.data() + s * ff, 1);
    }
    pool->ParallelFor(static_cast<int64_t>(groups), [&](int64_t b, int64_t end, int) {
      for (int64_t s = b; s < end; ++s) {
        const int32_t e = work.expert[s];
        MatmulRows(w.exp_down[e], gate_.data() + s * ff, 1, out + s * d, nullptr);
        down_bias(e, out + s * d, 1);
      }
    });
    return;
  }
  const int64_t most = *std::max_element(work.rows.begin(), work.rows.end());
  if (gate_.size() < size_t(most * ff)) gate_.resize(most * ff);
  if (up_.size() < size_t(most * ff)) up_.resize(most * ff);
  int64_t row = 0;
  for (size_t g = 0; g < groups; ++g) {
    const int32_t e = work.expert[g];
    const int64_t n = work.rows[g];
    const Projection gate_up[] = {{&w.exp_gate[e], gate_.data()}, {&w.exp_up[e], up_.data()}};
    MatmulSameInput(gate_up, in + row * d, n, pool);
    activate(e, gate_.data(), up_.data(), n);
    MatmulRows(w.exp_down[e], gate_.data(), n, out + row * d, pool);
    down_bias(e, out + row * d, n);
    row += n;
  }
}

}  // namespace tandem::engine
