// What `tandem bench` and `tandem simulate` report for a run: its results summarised overall and
// per request class, as a table on stdout and as the JSON both tools write (bench.h describes
// the fields), so a simulated run reads like a measured one.
//
// Threading: pure functions. Errors: none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "tools/tandem/bench_stats.h"
#include "tools/tandem/bench_workload.h"

namespace tandem::tools::bench {

inline constexpr int kResourceExhausted = 8;  // the gRPC code of a refusal

struct Run {
  std::string label;
  bool open_loop = false;
  double rate = 0;
  int concurrency = 0;
  std::vector<RequestResult> results;
  BenchStats stats;
  std::vector<BenchStats> class_stats;  // per class of the mix
  std::vector<size_t> class_refused;    // RESOURCE_EXHAUSTED answers per class
};

// A class's SLO: the run's --slo, with the class's own targets over it.
Slo ClassSlo(const Slo& run_slo, const RequestClass& c);

// Fills run.stats from run.results, and with classes run.class_stats and run.class_refused:
// `cls[i]` is request i's class (an index into `classes`, -1 for none). With classes the run's
// goodput is the sum of the classes', each judged by its own targets.
void ComputeRunStats(Run& run, std::span<const int> cls, const std::vector<RequestClass>& classes,
                     double duration, const Slo& slo);

// The run's JSON entry; per-request records for the first `max_request_records` requests
// (the rest counted in "requests_omitted").
nlohmann::json RunJson(const Run& run, std::span<const int> cls,
                       const std::vector<RequestClass>& classes,
                       size_t max_request_records = std::numeric_limits<size_t>::max());

void PrintSummary(const Run& run, const Slo& slo, const std::vector<RequestClass>& classes,
                  const char* title = "tandem bench");

}  // namespace tandem::tools::bench
