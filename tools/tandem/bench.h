// `tandem bench`: a load generator for a tandem cluster, speaking the router's streaming gRPC
// Generate (as `tandem client` does).
//
// Modes: closed loop (--concurrency C: C clients, each sending its next request when the last
// one ends) or open loop (--request-rate R[,R2,...]: requests sent at bench_workload.h's arrival
// times whatever the replies; with several rates, one run per rate, in order; --concurrency
// then caps requests in flight). Workloads and arrivals: bench_workload.h. Every request asks
// for exactly output_len tokens (ignore_eos, greedy).
// Output: a summary table on stdout; JSON results (--out) with the config, one entry per run
// (bench_stats.h's fields, per-request records, the router's mean TTFT breakdown) and the first
// run's aggregate fields copied to the top level; a PNG (--plot) made by gnuplot: latency CDFs
// (TTFT, TPOT, ITL, E2E; a curve per run) and, with several rates, p50/p90 latency against
// offered load. Without gnuplot the JSON is still written and the plot is reported skipped.
// With a class mix (--mix) every request carries its class's priority and targets, and each run
// also reports per class (JSON "classes"): the class's stats, goodput judged by the class's
// targets (over --slo), and how many were refused (RESOURCE_EXHAUSTED); the run's goodput is
// then the sum of the classes'. --no-send-targets keeps the targets for judging only (a run
// without SLO admission, on the same trace).
// Progress on stderr: a bar on a terminal, else a line at every 10%.
//
// Connections use the process's TLS settings (services/common/tls.h), like `tandem client`.
//
// Threading: runs its own client threads; call from one thread. Errors: INVALID_ARGUMENT for bad
// options, UNAVAILABLE when the router cannot be reached; failed requests are counted, not fatal.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tandem::tools {

struct BenchOptions {
  std::string router;  // host:port
  std::string model;   // empty: the router's first model
  int num_requests = 16;
  std::string out_json;  // empty: no JSON file
  std::string plot_png;  // empty: no plot
  int concurrency = 0;   // closed loop when no rates (0 there means 1); cap in open loop
  std::vector<double> request_rates;  // open loop when non-empty
  std::string arrival = "poisson";
  int burst_size = 8;
  std::string workload = "random";
  int input_len = 32;
  int output_len = 16;
  int prefix_len = 64;
  int turns = 3;
  // multi-turn: tokens of each conversation's first turn before its input_len (a character
  // card or system prompt, its own per conversation); 0: none.
  int first_turn_len = 0;
  // multi-turn: each turn carries the session id "bench-SEED-N", and its history is the
  // conversation as it happened (turn k-1's prompt and its actual reply), as a chat client
  // sends it, instead of a stand-in reply.
  bool sessions = false;
  std::string slo;  // "ttft:500,tpot:50"
  uint64_t seed = 0;
  int64_t timeout_ms = 600000;  // per request
  bool quiet = false;           // no progress output
  std::string api_key;          // sent as "authorization: Bearer KEY" when set
  // Class mix (bench_workload.h's ParseMix): each request's priority, and its class's TTFT and
  // TPOT targets, which judge its goodput and, with send_targets, travel with it.
  std::string mix;
  bool send_targets = true;
};

absl::Status RunBench(const BenchOptions& o);

// "1,2.5,4" -> {1, 2.5, 4}; INVALID_ARGUMENT for anything not a positive number.
absl::Status ParseRates(const std::string& spec, std::vector<double>* out);

}  // namespace tandem::tools
