#include "tools/tandem/bench_report.h"

#include <algorithm>
#include <cstdio>
#include <utility>

namespace tandem::tools::bench {

Slo ClassSlo(const Slo& run_slo, const RequestClass& c) {
  Slo s = run_slo;
  if (c.ttft_ms > 0) s.ttft_ms = c.ttft_ms;
  if (c.tpot_ms > 0) s.tpot_ms = c.tpot_ms;
  return s;
}

void ComputeRunStats(Run& run, std::span<const int> cls, const std::vector<RequestClass>& classes,
                     double duration, const Slo& slo) {
  run.stats = ComputeStats(run.results, duration, slo);
  if (classes.empty()) return;
  run.stats.good_requests = 0;
  for (size_t k = 0; k < classes.size(); ++k) {
    std::vector<RequestResult> mine;
    size_t refused = 0;
    for (size_t i = 0; i < cls.size(); ++i) {
      if (cls[i] != static_cast<int>(k)) continue;
      mine.push_back(run.results[i]);
      refused += run.results[i].status_code == kResourceExhausted;
    }
    run.class_stats.push_back(ComputeStats(mine, duration, ClassSlo(slo, classes[k])));
    run.class_refused.push_back(refused);
    run.stats.good_requests += run.class_stats.back().good_requests;
  }
  run.stats.goodput = duration > 0 ? static_cast<double>(run.stats.good_requests) / duration : 0;
}

nlohmann::json RunJson(const Run& run, std::span<const int> cls,
                       const std::vector<RequestClass>& classes, size_t max_request_records) {
  nlohmann::json j = StatsJson(run.stats);
  j["label"] = run.label;
  j["mode"] = run.open_loop ? "open" : "closed";
  j["request_rate"] = run.open_loop ? nlohmann::json(run.rate) : nlohmann::json(nullptr);
  j["concurrency"] = run.concurrency;
  // The router's own view of where TTFT went (means over successful requests, ms).
  double q = 0, pf = 0, kv = 0, ob = 0, fd = 0;
  int ok = 0;
  nlohmann::json reqs = nlohmann::json::array();
  std::vector<std::string> errors;
  for (size_t i = 0; i < run.results.size(); ++i) {
    const RequestResult& r = run.results[i];
    if (!r.ok) {
      if (errors.size() < 5) errors.push_back(r.error);
    } else {
      ok++;
      q += r.server_queue_s;
      pf += r.server_prefill_s;
      kv += r.server_kv_transfer_s;
      ob += r.server_onboarding_s;
      fd += r.server_first_decode_s;
    }
    if (i >= max_request_records) continue;  // counted, not recorded
    nlohmann::json e = {{"ok", r.ok},
                        {"start_s", r.start_s},
                        {"prompt_tokens", r.prompt_tokens},
                        {"output_tokens", r.output_tokens},
                        {"ttft_ms", r.ttft_s * 1000},
                        {"e2e_ms", r.e2e_s * 1000},
                        {"tpot_ms", std::max(Tpot(r), 0.0) * 1000}};
    if (cls[i] >= 0) e["class"] = classes[static_cast<size_t>(cls[i])].name;
    if (r.session >= 0) {
      e["session"] = r.session;
      e["turn"] = r.turn;
    }
    if (r.ok) {
      e["kv_transfer_bytes"] = r.kv_transfer_bytes;
      e["decode_held_tokens"] = r.decode_held_tokens;
    }
    if (r.ok) {  // the router's breakdown of this request's TTFT
      e["server_queue_ms"] = r.server_queue_s * 1000;
      e["server_prefill_ms"] = r.server_prefill_s * 1000;
    } else {
      e["error"] = r.error;
    }
    reqs.push_back(std::move(e));
  }
  const double k = ok > 0 ? 1000.0 / ok : 0;
  j["server_ttft_breakdown_ms"] = {{"queue", q * k},
                                   {"prefill_compute", pf * k},
                                   {"kv_transfer", kv * k},
                                   {"prefix_onboarding", ob * k},
                                   {"first_decode_step", fd * k}};
  j["errors"] = errors;
  if (!classes.empty()) {
    j["classes"] = nlohmann::json::array();
    for (size_t k = 0; k < classes.size(); ++k) {
      nlohmann::json c = StatsJson(run.class_stats[k]);
      c["name"] = classes[k].name;
      c["weight"] = classes[k].weight;
      c["ttft_target_ms"] = classes[k].ttft_ms;
      c["tpot_target_ms"] = classes[k].tpot_ms;
      c["refused"] = run.class_refused[k];
      j["classes"].push_back(std::move(c));
    }
  }
  j["requests"] = std::move(reqs);
  if (run.results.size() > max_request_records) {
    j["requests_omitted"] = run.results.size() - max_request_records;
  }
  return j;
}

void PrintSummary(const Run& run, const Slo& slo, const std::vector<RequestClass>& classes,
                  const char* title) {
  const BenchStats& s = run.stats;
  std::printf("============ %s: %s ============\n", title, run.label.c_str());
  std::printf("%-34s %zu\n%-34s %zu\n%-34s %.2f\n", "Successful requests:", s.completed,
              "Failed requests:", s.failed, "Duration (s):", s.duration_s);
  std::printf("%-34s %lld\n%-34s %lld\n",
              "Total input tokens:", static_cast<long long>(s.total_input_tokens),
              "Total generated tokens:", static_cast<long long>(s.total_output_tokens));
  std::printf("%-34s %.2f\n%-34s %.2f\n%-34s %.2f\n",
              "Request throughput (req/s):", s.request_throughput,
              "Output token throughput (tok/s):", s.output_token_throughput,
              "Total token throughput (tok/s):", s.total_token_throughput);
  if (slo.any() || !classes.empty()) {
    std::printf("%-34s %.2f\n", "Request goodput (req/s):", s.goodput);
  }
  if (s.spec_verify_steps > 0) {
    std::printf("%-34s %lld of %lld (%.1f%%)\n%-34s %.2f\n",
                "Draft tokens accepted:", static_cast<long long>(s.spec_accepted_tokens),
                static_cast<long long>(s.spec_draft_tokens), 100.0 * s.spec_acceptance_rate,
                "Mean tokens per verify step:", s.spec_mean_accept_length);
  }
  const std::pair<const char*, const Summary*> rows[] = {
      {"TTFT", &s.ttft_ms}, {"TPOT", &s.tpot_ms}, {"ITL", &s.itl_ms}, {"E2E", &s.e2e_ms}};
  for (const auto& [name, sum] : rows) {
    std::printf("%-5s (ms): mean %9.2f  p50 %9.2f  p90 %9.2f  p99 %9.2f\n", name, sum->mean,
                sum->p50, sum->p90, sum->p99);
  }
  for (size_t k = 0; k < classes.size(); ++k) {
    const BenchStats& c = run.class_stats[k];
    std::printf(
        "class %-11s ok %4zu  refused %4zu  goodput %7.2f req/s  TTFT p50 %8.1f  p90 %8.1f ms\n",
        classes[k].name.c_str(), c.completed, run.class_refused[k], c.goodput, c.ttft_ms.p50,
        c.ttft_ms.p90);
  }
  std::fflush(stdout);
}

}  // namespace tandem::tools::bench
