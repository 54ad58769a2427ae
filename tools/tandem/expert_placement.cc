#include "tools/tandem/expert_placement.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tandem::tools {
namespace {

// The value of label `name` in a series' {...} label set, or empty.
std::string_view Label(std::string_view labels, std::string_view name) {
  const std::string key = std::string(name) + "=\"";
  size_t at = 0;
  while ((at = labels.find(key, at)) != std::string_view::npos) {
    if (at == 0 || labels[at - 1] == '{' || labels[at - 1] == ',') {
      const size_t begin = at + key.size();
      const size_t end = labels.find('"', begin);
      if (end == std::string_view::npos) return {};
      return labels.substr(begin, end - begin);
    }
    at += key.size();
  }
  return {};
}

}  // namespace

absl::StatusOr<ExpertLoad> ParseExpertLoad(std::string_view exposition) {
  constexpr std::string_view kName = "tandem_expert_tokens_total{";
  std::map<std::pair<int32_t, int32_t>, double> sums;
  int32_t max_layer = -1, max_expert = -1;
  for (size_t begin = 0; begin < exposition.size();) {
    size_t end = exposition.find('\n', begin);
    if (end == std::string_view::npos) end = exposition.size();
    const std::string_view line = exposition.substr(begin, end - begin);
    begin = end + 1;
    if (!line.starts_with(kName)) continue;
    const size_t close = line.find('}');
    if (close == std::string_view::npos) {
      return absl::InvalidArgumentError("malformed series: " + std::string(line));
    }
    const std::string_view labels = line.substr(0, close + 1);
    int32_t layer = 0, expert = 0;
    double value = 0;
    const std::string layer_s(Label(labels, "layer")), expert_s(Label(labels, "expert"));
    const std::string value_s(line.substr(close + 1));
    if (!absl::SimpleAtoi(layer_s, &layer) || !absl::SimpleAtoi(expert_s, &expert) || layer < 0 ||
        expert < 0 || !absl::SimpleAtod(value_s, &value)) {
      return absl::InvalidArgumentError("malformed series: " + std::string(line));
    }
    sums[{layer, expert}] += value;
    max_layer = std::max(max_layer, layer);
    max_expert = std::max(max_expert, expert);
  }
  if (sums.empty()) {
    return absl::InvalidArgumentError("no tandem_expert_tokens_total series (not an MoE worker?)");
  }
  ExpertLoad load;
  load.n_layer = max_layer + 1;
  load.n_expert = max_expert + 1;
  load.tokens.assign(size_t(load.n_layer) * load.n_expert, 0.0);
  for (const auto& [key, v] : sums) load.tokens[size_t(key.first) * load.n_expert + key.second] = v;
  return load;
}

absl::StatusOr<Placement> PlaceExperts(const ExpertLoad& load, int32_t ranks, int32_t redundant) {
  const int32_t ne = load.n_expert;
  if (ranks < 1 || redundant < 0 || (ne + redundant) % ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat("expert placement: ", ne, " experts plus ",
                                                   redundant, " redundant replicas must fill ",
                                                   ranks, " ranks evenly"));
  }
  if (ne + redundant > int64_t{ne} * ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert placement: ", redundant, " redundant replicas of ", ne,
                     " experts cannot all sit on distinct ranks of ", ranks));
  }
  const int32_t slots = (ne + redundant) / ranks;
  Placement p;
  p.ranks = ranks;
  p.n_expert = ne;
  for (int32_t l = 0; l < load.n_layer; ++l) {
    std::vector<int32_t> replicas(ne, 1);
    for (int32_t k = 0; k < redundant; ++k) {
      int32_t best = -1;
      for (int32_t e = 0; e < ne; ++e) {
        if (replicas[e] >= ranks) continue;
        if (best < 0 || load.at(l, e) / replicas[e] > load.at(l, best) / replicas[best]) best = e;
      }
      ++replicas[best];
    }
    std::vector<std::pair<double, int32_t>> items;  // (per-replica load, expert)
    for (int32_t e = 0; e < ne; ++e) {
      for (int32_t r = 0; r < replicas[e]; ++r) items.emplace_back(load.at(l, e) / replicas[e], e);
    }
    std::stable_sort(items.begin(), items.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    std::vector<std::vector<int32_t>> rank_experts(ranks);
    std::vector<double> rank_load(ranks, 0.0);
    for (const auto& [w, e] : items) {
      int32_t pick = -1;
      for (int32_t r = 0; r < ranks; ++r) {
        const auto& held = rank_experts[r];
        if (static_cast<int32_t>(held.size()) >= slots) continue;
        if (std::find(held.begin(), held.end(), e) != held.end()) continue;
        if (pick < 0 || rank_load[r] < rank_load[pick]) pick = r;
      }
      if (pick < 0) {
        // Every rank with a free slot holds e already: refuse rather than put two replicas of
        // one expert on one rank.
        return absl::InternalError(
            absl::StrCat("expert placement: no rank left for a replica of "
                         "expert ",
                         e, " in layer ", l));
      }
      rank_experts[pick].push_back(e);
      rank_load[pick] += w;
    }
    for (auto& held : rank_experts) std::sort(held.begin(), held.end());
    p.layers.push_back(std::move(rank_experts));
  }
  return p;
}

double Imbalance(const ExpertLoad& load, const Placement& p, int32_t layer) {
  std::vector<int32_t> replicas(load.n_expert, 0);
  for (const auto& held : p.layers[layer]) {
    for (int32_t e : held) ++replicas[e];
  }
  double total = 0, most = 0;
  for (const auto& held : p.layers[layer]) {
    double rank = 0;
    for (int32_t e : held) rank += load.at(layer, e) / replicas[e];
    total += rank;
    most = std::max(most, rank);
  }
  return total > 0 ? most / (total / p.ranks) : 1.0;
}

absl::Status RunPlaceExperts(const PlaceExpertsOptions& o) {
  if (o.load_paths.empty() || o.out_path.empty()) {
    return absl::InvalidArgumentError("place-experts: --load and --out are required");
  }
  std::string text;
  for (const std::string& path : o.load_paths) {
    std::ifstream in(path);
    if (!in) return absl::NotFoundError(absl::StrCat("place-experts: cannot read ", path));
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    text.push_back('\n');
  }
  absl::StatusOr<ExpertLoad> load = ParseExpertLoad(text);
  if (!load.ok()) return load.status();
  absl::StatusOr<Placement> placed = PlaceExperts(*load, o.ranks, o.redundant);
  if (!placed.ok()) return placed.status();
  absl::StatusOr<Placement> before = Placement::Contiguous(load->n_layer, load->n_expert, o.ranks);
  nlohmann::json out = placed->ToJson();
  double sum_before = 0, sum_after = 0, max_before = 0, max_after = 0;
  for (int32_t l = 0; l < load->n_layer; ++l) {
    const double a = Imbalance(*load, *placed, l);
    const double b = before.ok() ? Imbalance(*load, *before, l) : 0.0;
    out["imbalance"].push_back({{"layer", l}, {"contiguous", b}, {"placed", a}});
    sum_before += b;
    sum_after += a;
    max_before = std::max(max_before, b);
    max_after = std::max(max_after, a);
  }
  std::ofstream f(o.out_path);
  f << out.dump(1) << "\n";
  if (!f) return absl::InternalError(absl::StrCat("place-experts: cannot write ", o.out_path));
  const double n = load->n_layer;
  std::printf("%d layers, %d experts, %d ranks, %d redundant replicas\n", load->n_layer,
              load->n_expert, o.ranks, o.redundant);
  if (before.ok()) {
    std::printf("imbalance (max rank load / mean), contiguous: mean %.3f, worst %.3f\n",
                sum_before / n, max_before);
  }
  std::printf("imbalance (max rank load / mean), placed:     mean %.3f, worst %.3f\n",
              sum_after / n, max_after);
  return absl::OkStatus();
}

}  // namespace tandem::tools
