// `tandem simulate`: runs a workload through the cluster simulator (services/router/sim.h) and
// reports it as `tandem bench` reports a measured run (the same summary and JSON, plus a
// "simulated" object: topology, costs and how long the simulation took).
//
// Workload: `tandem bench`'s flags (--num-requests, --input-len, --output-len, --workload
// random or shared-prefix, --arrival, --mix, --slo, --seed) at --rate R, or --duration S of
// arrivals at R (num_requests = R * S); or --trace FILE, a `tandem bench --out` JSON whose first
// run's requests (send time, prompt and output tokens, class) are replayed.
//
// Step costs (StepCosts, JSON): {"prefill": C, "decode": C, "colocated": C, "dispatch_s": x,
// "transfer_s_per_token": y, "prefill_request_s": z, "source": "..."} where C = {"intercept_s",
// "prefill_token_s", "decode_seq_s", "decode_kv_token_s"}; "step": C stands for any role not given.
// Where they come from, one of:
//   --cost FILE          such a file (docs/perf/costs/ holds measured and published ones);
//   --cost-from ROUTER   the fits a running cluster's workers report (Registry.ListWorkers),
//                        averaged per role: simulate the cluster as it runs now;
//   --model M.gguf       fitted here: the engine runs steps of many shapes on this machine
//                        with --threads threads (a few seconds), the fit written with
//                        --save-cost FILE.
// dispatch_s and transfer_s_per_token are given by the file, or by --dispatch-ms and
// --transfer-us-per-token (flags win).
//
// `tandem plan` takes the same cost sources (RunPlan below).
//
// Threading: call from one thread. Errors: INVALID_ARGUMENT for bad options, NOT_FOUND for a
// missing file, UNAVAILABLE for a router that cannot be reached.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "services/router/sim.h"

namespace tandem::tools {

struct CostSources {
  std::string cost_file;
  std::string cost_from;  // router host:port
  std::string model;      // GGUF to calibrate on this machine (or, with device, its shape)
  // A GPU by name (tools/tandem/device_costs.h): costs from its published peaks and the
  // model's shape instead of a fit on this machine.
  std::string device;
  double device_memory_efficiency = 0.75;
  double device_compute_efficiency = 0.5;
  int threads = 1;
  int max_batch_tokens = 512;
  std::string save_cost;              // write the costs used here
  double dispatch_ms = -1;            // < 0: from the source (0 when it has none)
  double transfer_us_per_token = -1;  // < 0: from the source
};

// Loads, fetches or fits the costs as the sources say (exactly one of file, router, model).
absl::StatusOr<router::sim::Costs> LoadCosts(const CostSources& s, std::string* source);

struct SimulateOptions {
  // The workload, as `tandem bench` takes it.
  int num_requests = 0;  // 0: rate * duration
  double rate = 0;       // requests/s
  double duration_s = 0;
  std::string arrival = "poisson";
  int burst_size = 8;
  std::string workload = "random";
  int input_len = 32;
  int output_len = 16;
  int prefix_len = 64;
  std::string slo;
  std::string mix;
  uint64_t seed = 0;
  std::string trace;  // a tandem bench JSON to replay instead
  // The cluster.
  router::sim::Topology topology;
  router::sim::RouterConfig router;
  std::string policy = "least-load";
  CostSources costs;
  std::string out_json;
  bool quiet = false;
};

absl::Status RunSimulate(const SimulateOptions& o);

// `tandem plan`: the pool sizes a workload needs (services/router/plan.h), printed as a table,
// or as JSON with --json.
struct PlanOptions {
  double rate = 0;
  std::string isl = "512";  // histograms: "512" or "128:3,1024:1"
  std::string osl = "128";
  double prefix_hit = 0;
  std::string slo;  // "ttft:MS,tpot:MS"
  double attainment = 0.99;
  int max_workers = 64;
  router::sim::Topology shape;
  router::sim::RouterConfig router;
  std::string policy = "least-load";
  CostSources costs;
  uint64_t seed = 1;
  bool json = false;
};

absl::Status RunPlan(const PlanOptions& o);

}  // namespace tandem::tools
