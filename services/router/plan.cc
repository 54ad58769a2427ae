#include "services/router/plan.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "services/router/slo.h"

namespace tandem::router::plan {
namespace {

// Linear-interpolation percentile of sorted values.
double Quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

double Mean(const Histogram& h) {
  double s = 0, w = 0;
  for (const auto& [len, weight] : h.bins) {
    s += len * weight;
    w += weight;
  }
  return w > 0 ? s / w : 0;
}

int CeilAtLeastOne(double x) { return std::max(1, static_cast<int>(std::ceil(x - 1e-9))); }

}  // namespace

absl::StatusOr<Histogram> ParseHistogram(const std::string& spec) {
  Histogram h;
  for (absl::string_view part : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    std::vector<absl::string_view> f = absl::StrSplit(part, ':');
    int32_t len = 0;
    double weight = 1;
    if (f.size() > 2 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(f[0]), &len) || len < 1 ||
        (f.size() == 2 &&
         (!absl::SimpleAtod(absl::StripAsciiWhitespace(f[1]), &weight) || !(weight > 0)))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "length histogram '", spec, "': want LEN or LEN:WEIGHT,... with LEN >= 1, WEIGHT > 0"));
    }
    h.bins.emplace_back(len, weight);
  }
  if (h.bins.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("length histogram '", spec, "' is empty"));
  }
  return h;
}

absl::StatusOr<Prediction> Evaluate(const Workload& w, const Slo& slo, const Options& o,
                                    int prefill, int decode, int colocated) {
  if (!(w.rate > 0)) return absl::InvalidArgumentError("the rate must be > 0");
  if (w.input.bins.empty() || w.output.bins.empty()) {
    return absl::InvalidArgumentError("input and output length histograms must not be empty");
  }
  if (!(w.prefix_hit >= 0 && w.prefix_hit < 1)) {
    return absl::InvalidArgumentError("the prefix-hit fraction must be in [0, 1)");
  }
  // 30 s of arrivals, within [sim_requests, 4 * sim_requests].
  const int n = static_cast<int>(
      std::clamp(30 * w.rate, static_cast<double>(o.sim_requests), 4.0 * o.sim_requests));
  std::mt19937_64 rng(o.seed);
  std::exponential_distribution<double> gap(w.rate);
  auto draw = [&](const Histogram& h) {
    std::vector<double> weights;
    for (const auto& b : h.bins) weights.push_back(b.second);
    return std::discrete_distribution<size_t>(weights.begin(), weights.end());
  };
  auto in_pick = draw(w.input), out_pick = draw(w.output);
  std::vector<sim::Request> reqs(static_cast<size_t>(n));
  double t = 0;
  for (sim::Request& r : reqs) {
    t += gap(rng);
    r.arrival_s = t;
    r.prompt_tokens = w.input.bins[in_pick(rng)].first;
    r.output_tokens = w.output.bins[out_pick(rng)].first;
    r.cached_tokens = static_cast<int32_t>(w.prefix_hit * r.prompt_tokens);
  }
  sim::Options so;
  so.costs = o.costs;
  so.topology = o.shape;
  so.topology.prefill = prefill;
  so.topology.decode = decode;
  so.topology.colocated = colocated;
  so.router = o.router;
  so.keep_itl = false;
  absl::StatusOr<std::vector<sim::Result>> res = sim::Simulate(so, reqs);
  if (!res.ok()) return res.status();
  Prediction p;
  p.prefill = prefill;
  p.decode = decode;
  p.colocated = colocated;
  std::vector<double> ttft, tpot;
  size_t good = 0;
  double end = 0;
  for (size_t i = 0; i < res->size(); ++i) {
    const sim::Result& r = (*res)[i];
    end = std::max(end, reqs[i].arrival_s + r.e2e_s);
    if (!r.ok) continue;
    ttft.push_back(r.ttft_s);
    const double tp =
        reqs[i].output_tokens > 1 ? (r.e2e_s - r.ttft_s) / (reqs[i].output_tokens - 1) : 0;
    if (reqs[i].output_tokens > 1) tpot.push_back(tp);
    good += (slo.ttft_s <= 0 || r.ttft_s <= slo.ttft_s) && (slo.tpot_s <= 0 || tp <= slo.tpot_s);
  }
  std::sort(ttft.begin(), ttft.end());
  std::sort(tpot.begin(), tpot.end());
  p.attained = static_cast<double>(good) / static_cast<double>(n);
  p.goodput = end > 0 ? static_cast<double>(good) / end : 0;
  p.meets = p.attained >= o.attainment;
  p.ttft_p50_s = Quantile(ttft, 0.5);
  p.ttft_p99_s = Quantile(ttft, 0.99);
  p.tpot_p50_s = Quantile(tpot, 0.5);
  p.tpot_p99_s = Quantile(tpot, 0.99);
  return p;
}

absl::StatusOr<Workload> ObservedWorkload(std::vector<double> prompt_tokens,
                                          std::vector<double> output_tokens, double span_s) {
  if (prompt_tokens.empty() || prompt_tokens.size() != output_tokens.size() || !(span_s > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("an observed workload needs as many prompt as output lengths (",
                     prompt_tokens.size(), ", ", output_tokens.size(),
                     "), at least one, over a span > 0 s (", span_s, ")"));
  }
  auto histogram = [](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    constexpr size_t kBins = 32;
    const size_t n = std::min(kBins, v.size());
    Histogram h;
    for (size_t i = 0; i < n; ++i) {
      const double len = v[(2 * i + 1) * v.size() / (2 * n)];  // the middle of the i-th slice
      h.bins.emplace_back(std::max<int32_t>(1, static_cast<int32_t>(std::lround(len))), 1.0);
    }
    return h;
  };
  Workload w;
  w.rate = static_cast<double>(prompt_tokens.size()) / span_s;
  w.input = histogram(prompt_tokens);
  w.output = histogram(output_tokens);
  return w;
}

std::optional<sim::StepCoefficients> MeanFittedCost(const std::vector<WorkerRegistry::Load>& pool,
                                                    bool prefill) {
  sim::StepCoefficients sum;
  int n = 0;
  for (const WorkerRegistry::Load& l : pool) {
    const v1::StepCost& c = l.cost;
    if (!(prefill ? FittedForPrefill(c) : FittedForDecode(c))) continue;
    ++n;
    sum.intercept_s += FittedIntercept(c);
    sum.prefill_token_s += c.prefill_token_s();
    sum.decode_seq_s += c.decode_seq_s();
    sum.decode_kv_token_s += c.decode_kv_token_s();
  }
  if (n == 0) return std::nullopt;
  for (double* x :
       {&sum.intercept_s, &sum.prefill_token_s, &sum.decode_seq_s, &sum.decode_kv_token_s}) {
    *x /= n;
  }
  return sum;
}

absl::StatusOr<Answer> Plan(const Workload& w, const Slo& slo, const Options& o) {
  if (o.max_workers < 1) return absl::InvalidArgumentError("max_workers must be >= 1");
  if (!(o.attainment > 0 && o.attainment <= 1)) {
    return absl::InvalidArgumentError("attainment must be in (0, 1]");
  }
  if (slo.ttft_s < 0 || slo.tpot_s < 0) return absl::InvalidArgumentError("SLOs must be >= 0");
  Answer a;
  // Capacity bounds from the costs.
  const double in = Mean(w.input) * (1 - w.prefix_hit), out = Mean(w.output);
  const double budget = o.shape.max_batch_tokens, seqs = o.shape.max_seqs;
  const double kv = Mean(w.input) + out / 2;  // positions a decoding sequence holds, on average
  const double prefill_tps = budget / o.costs.prefill.Seconds(o.shape.max_batch_tokens, 0, 0);
  const double decode_tps =
      seqs / o.costs.decode.Seconds(0, o.shape.max_seqs, static_cast<int64_t>(seqs * kv));
  const int p_min = CeilAtLeastOne(w.rate * in / prefill_tps);
  const int d_min = CeilAtLeastOne(w.rate * std::max(0.0, out - 1) / decode_tps);
  // A colocated worker spends step time on both.
  const double col_prefill_s =
      in / (budget / o.costs.colocated.Seconds(o.shape.max_batch_tokens, 0, 0));
  const double col_decode_s =
      std::max(0.0, out - 1) /
      (seqs / o.costs.colocated.Seconds(0, o.shape.max_seqs, static_cast<int64_t>(seqs * kv)));
  const int c_min = CeilAtLeastOne(w.rate * (col_prefill_s + col_decode_s));

  auto better = [](const Prediction& x, const Prediction& y) {
    return x.attained != y.attained ? x.attained > y.attained : x.ttft_p99_s < y.ttft_p99_s;
  };
  Prediction best_tried;
  absl::Status failed;
  // The best split of `total` workers among those near the split of the two pools' lower
  // bounds (within 2 of it either way); workers() == 0 when none meets the SLOs.
  auto best_split = [&](int total) {
    Prediction best;
    const double share = static_cast<double>(p_min) / (p_min + d_min);
    const int p0 = std::clamp(static_cast<int>(std::lround(total * share)), p_min, total - d_min);
    for (int p = std::max(p_min, p0 - 2); p <= std::min(total - d_min, p0 + 2); ++p) {
      absl::StatusOr<Prediction> e = Evaluate(w, slo, o, p, total - p, 0);
      ++a.simulations;
      if (!e.ok()) {
        failed = e.status();
        return best;
      }
      if (best_tried.workers() == 0 || better(*e, best_tried)) best_tried = *e;
      if (e->meets && (best.workers() == 0 || better(*e, best))) best = *e;
    }
    return best;
  };
  auto colocated = [&](int c) {
    absl::StatusOr<Prediction> e = Evaluate(w, slo, o, 0, 0, c);
    ++a.simulations;
    if (!e.ok()) {
      failed = e.status();
      return Prediction{};
    }
    return e->meets ? *e : Prediction{};
  };
  // The smallest count in [lo, max_workers] that meets the SLOs, assuming more workers never
  // do worse: steps of 1, 2, 4, ... up from the lower bound, then bisection.
  auto smallest = [&](int lo, const std::function<Prediction(int)>& eval) {
    Prediction found;
    int miss = lo - 1, step = 1, n = lo;
    while (n <= o.max_workers && failed.ok()) {
      found = eval(n);
      if (found.workers() > 0) break;
      miss = n;
      if (n == o.max_workers) return Prediction{};
      n = std::min(o.max_workers, n + step);
      step *= 2;
    }
    if (found.workers() == 0) return found;
    int hit = n;
    while (hit - miss > 1 && failed.ok()) {
      const int mid = miss + (hit - miss) / 2;
      Prediction m = eval(mid);
      if (m.workers() > 0) {
        hit = mid;
        found = m;
      } else {
        miss = mid;
      }
    }
    return found;
  };
  if (p_min + d_min <= o.max_workers) a.disaggregated = smallest(p_min + d_min, best_split);
  if (failed.ok() && o.colocated) a.colocated = smallest(std::min(c_min, o.max_workers), colocated);
  if (!failed.ok()) return failed;
  const bool dis = a.disaggregated.workers() > 0, col = a.colocated.workers() > 0;
  if (!dis && !col) {
    if (best_tried.workers() > 0) a.disaggregated = best_tried;
    return absl::FailedPreconditionError(
        absl::StrCat("no cluster of up to ", o.max_workers, " workers meets the SLOs for ",
                     o.attainment * 100, "% of requests (best tried: ", best_tried.prefill, "P+",
                     best_tried.decode, "D, ", best_tried.attained * 100, "% within)"));
  }
  a.prefer_colocated = col && (!dis || a.colocated.workers() < a.disaggregated.workers() ||
                               (a.colocated.workers() == a.disaggregated.workers() &&
                                a.colocated.goodput >= a.disaggregated.goodput));
  return a;
}

}  // namespace tandem::router::plan
