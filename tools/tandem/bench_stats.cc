#include "tools/tandem/bench_stats.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tandem::tools::bench {

absl::StatusOr<Slo> ParseSlo(const std::string& spec) {
  Slo slo;
  if (spec.empty()) return slo;
  for (absl::string_view part : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    std::vector<absl::string_view> kv = absl::StrSplit(part, ':');
    double v = 0;
    if (kv.size() != 2 || !absl::SimpleAtod(kv[1], &v) || !(v > 0) || !std::isfinite(v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--slo: '", std::string(part), "' is not KEY:MS with MS > 0 (e.g. ttft:500,tpot:50)"));
    }
    const std::string key = absl::AsciiStrToLower(absl::StripAsciiWhitespace(kv[0]));
    if (key == "ttft") {
      slo.ttft_ms = v;
    } else if (key == "tpot") {
      slo.tpot_ms = v;
    } else if (key == "e2e" || key == "e2el") {
      slo.e2e_ms = v;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--slo: unknown metric '", key, "' (ttft, tpot or e2e)"));
    }
  }
  return slo;
}

double PercentileLinear(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = std::clamp(q, 0.0, 100.0) / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return v[lo] + (v[hi] - v[lo]) * frac;
}

Summary Summarize(const std::vector<double>& values) {
  Summary s;
  s.count = values.size();
  if (values.empty()) return s;
  double sum = 0;
  for (double x : values) sum += x;
  s.mean = sum / static_cast<double>(values.size());
  if (std::is_sorted(values.begin(), values.end())) {
    // ComputeStats' vectors come sorted: read them in place, no copy to sort (a simulated run
    // has millions of values).
    auto at = [&](double q) {
      const double pos = q / 100.0 * static_cast<double>(values.size() - 1);
      const size_t lo = static_cast<size_t>(std::floor(pos));
      const size_t hi = std::min(lo + 1, values.size() - 1);
      return values[lo] + (values[hi] - values[lo]) * (pos - static_cast<double>(lo));
    };
    s.p50 = at(50);
    s.p90 = at(90);
    s.p99 = at(99);
  } else {
    s.p50 = PercentileLinear(values, 50);
    s.p90 = PercentileLinear(values, 90);
    s.p99 = PercentileLinear(values, 99);
  }
  s.min = *std::min_element(values.begin(), values.end());
  s.max = *std::max_element(values.begin(), values.end());
  return s;
}

double Tpot(const RequestResult& r) {
  if (r.output_tokens < 2) return -1;
  return (r.e2e_s - r.ttft_s) / static_cast<double>(r.output_tokens - 1);
}

bool MeetsSlo(const RequestResult& r, const Slo& slo) {
  if (!r.ok) return false;
  if (slo.ttft_ms > 0 && r.ttft_s * 1000 > slo.ttft_ms) return false;
  if (slo.tpot_ms > 0 && std::max(Tpot(r), 0.0) * 1000 > slo.tpot_ms) return false;
  if (slo.e2e_ms > 0 && r.e2e_s * 1000 > slo.e2e_ms) return false;
  return true;
}

BenchStats ComputeStats(const std::vector<RequestResult>& results, double duration_s,
                        const Slo& slo) {
  BenchStats s;
  s.duration_s = duration_s;
  for (const RequestResult& r : results) {
    if (!r.ok) {
      s.failed++;
      continue;
    }
    s.completed++;
    s.total_input_tokens += r.prompt_tokens;
    s.total_output_tokens += r.output_tokens;
    if (r.output_tokens > 0) s.ttft_values_ms.push_back(r.ttft_s * 1000);
    s.e2e_values_ms.push_back(r.e2e_s * 1000);
    if (const double t = Tpot(r); t >= 0) s.tpot_values_ms.push_back(t * 1000);
    for (double g : r.itl_s) s.itl_values_ms.push_back(g * 1000);
    if (MeetsSlo(r, slo)) s.good_requests++;
    s.spec_verify_steps += r.spec_verify_steps;
    s.spec_draft_tokens += r.spec_draft_tokens;
    s.spec_accepted_tokens += r.spec_accepted_tokens;
  }
  if (s.spec_draft_tokens > 0) {
    s.spec_acceptance_rate =
        static_cast<double>(s.spec_accepted_tokens) / static_cast<double>(s.spec_draft_tokens);
  }
  if (s.spec_verify_steps > 0) {
    s.spec_mean_accept_length = 1.0 + static_cast<double>(s.spec_accepted_tokens) /
                                          static_cast<double>(s.spec_verify_steps);
  }
  for (auto* v : {&s.ttft_values_ms, &s.tpot_values_ms, &s.itl_values_ms, &s.e2e_values_ms}) {
    std::sort(v->begin(), v->end());
  }
  s.ttft_ms = Summarize(s.ttft_values_ms);
  s.tpot_ms = Summarize(s.tpot_values_ms);
  s.itl_ms = Summarize(s.itl_values_ms);
  s.e2e_ms = Summarize(s.e2e_values_ms);
  if (duration_s > 0) {
    s.request_throughput = static_cast<double>(s.completed) / duration_s;
    s.output_token_throughput = static_cast<double>(s.total_output_tokens) / duration_s;
    s.total_token_throughput =
        static_cast<double>(s.total_input_tokens + s.total_output_tokens) / duration_s;
    s.goodput = static_cast<double>(s.good_requests) / duration_s;
  }
  return s;
}

nlohmann::json SummaryJson(const Summary& s) {
  return {{"count", s.count}, {"mean", s.mean}, {"p50", s.p50}, {"p90", s.p90},
          {"p99", s.p99},     {"min", s.min},   {"max", s.max}};
}

nlohmann::json StatsJson(const BenchStats& s) {
  return {{"completed", s.completed},
          {"failed", s.failed},
          {"duration_s", s.duration_s},
          {"total_input_tokens", s.total_input_tokens},
          {"total_output_tokens", s.total_output_tokens},
          {"request_throughput", s.request_throughput},
          {"output_token_throughput", s.output_token_throughput},
          {"total_token_throughput", s.total_token_throughput},
          {"goodput", s.goodput},
          {"good_requests", s.good_requests},
          {"ttft_ms", SummaryJson(s.ttft_ms)},
          {"tpot_ms", SummaryJson(s.tpot_ms)},
          {"itl_ms", SummaryJson(s.itl_ms)},
          {"e2e_ms", SummaryJson(s.e2e_ms)},
          {"speculative",
           {{"verify_steps", s.spec_verify_steps},
            {"draft_tokens", s.spec_draft_tokens},
            {"accepted_tokens", s.spec_accepted_tokens},
            {"acceptance_rate", s.spec_acceptance_rate},
            {"mean_accept_length", s.spec_mean_accept_length}}}};
}

}  // namespace tandem::tools::bench
