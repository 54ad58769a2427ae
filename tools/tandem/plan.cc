#include "services/router/plan.h"

#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"
#include "nlohmann/json.hpp"
#include "tools/tandem/bench_stats.h"
#include "tools/tandem/simulate.h"

namespace tandem::tools {
namespace {

nlohmann::json PredictionJson(const router::plan::Prediction& p) {
  if (p.workers() == 0) return nullptr;
  return {{"prefill", p.prefill},
          {"decode", p.decode},
          {"colocated", p.colocated},
          {"workers", p.workers()},
          {"attained", p.attained},
          {"goodput", p.goodput},
          {"ttft_p50_ms", p.ttft_p50_s * 1000},
          {"ttft_p99_ms", p.ttft_p99_s * 1000},
          {"tpot_p50_ms", p.tpot_p50_s * 1000},
          {"tpot_p99_ms", p.tpot_p99_s * 1000}};
}

void PrintPrediction(const char* name, const router::plan::Prediction& p) {
  if (p.workers() == 0) {
    std::printf("%-14s none within the worker limit\n", name);
    return;
  }
  const std::string shape = p.colocated > 0 ? absl::StrCat(p.colocated, " colocated")
                                            : absl::StrCat(p.prefill, "P + ", p.decode, "D");
  std::printf(
      "%-14s %-14s TTFT p50 %8.1f p99 %8.1f ms  TPOT p50 %7.2f p99 %7.2f ms  "
      "goodput %8.2f req/s (%.1f%% within)\n",
      name, shape.c_str(), p.ttft_p50_s * 1000, p.ttft_p99_s * 1000, p.tpot_p50_s * 1000,
      p.tpot_p99_s * 1000, p.goodput, p.attained * 100);
}

}  // namespace

absl::Status RunPlan(const PlanOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  router::plan::Workload w;
  w.rate = o.rate;
  TANDEM_ASSIGN_OR_RETURN(w.input, router::plan::ParseHistogram(o.isl));
  TANDEM_ASSIGN_OR_RETURN(w.output, router::plan::ParseHistogram(o.osl));
  w.prefix_hit = o.prefix_hit;
  TANDEM_ASSIGN_OR_RETURN(bench::Slo s, bench::ParseSlo(o.slo));
  if (s.ttft_ms <= 0 && s.tpot_ms <= 0) {
    return absl::InvalidArgumentError("--slo needs a ttft or tpot target, e.g. ttft:500,tpot:50");
  }
  router::plan::Slo slo{s.ttft_ms / 1000, s.tpot_ms / 1000};
  router::plan::Options po;
  std::string source;
  TANDEM_ASSIGN_OR_RETURN(po.costs, LoadCosts(o.costs, &source));
  po.shape = o.shape;
  po.router = o.router;
  TANDEM_RETURN_IF_ERROR(router::ParsePolicy(o.policy, &po.router.policy));
  po.max_workers = o.max_workers;
  po.attainment = o.attainment;
  po.seed = o.seed;
  TANDEM_ASSIGN_OR_RETURN(router::plan::Answer a, router::plan::Plan(w, slo, po));
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (o.json) {
    nlohmann::json j = {{"disaggregated", PredictionJson(a.disaggregated)},
                        {"colocated", PredictionJson(a.colocated)},
                        {"pick", a.prefer_colocated ? "colocated" : "disaggregated"},
                        {"simulations", a.simulations},
                        {"wall_s", wall},
                        {"costs_source", source}};
    std::printf("%s\n", j.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf(
      "workload: %.2f req/s, input %s, output %s tokens, prefix hit %.0f%%; "
      "SLO TTFT %.0f ms, TPOT %.1f ms for %.1f%% of requests\n",
      o.rate, o.isl.c_str(), o.osl.c_str(), o.prefix_hit * 100, s.ttft_ms, s.tpot_ms,
      o.attainment * 100);
  PrintPrediction("disaggregated", a.disaggregated);
  PrintPrediction("colocated", a.colocated);
  std::printf("pick: %s (%d simulations, %.2f s; costs: %s)\n",
              a.prefer_colocated ? "colocated" : "disaggregated", a.simulations, wall,
              source.c_str());
  return absl::OkStatus();
}

}  // namespace tandem::tools
