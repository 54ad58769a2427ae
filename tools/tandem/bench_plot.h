// PNG plots of `tandem bench` results, drawn by gnuplot (Debian's gnuplot-nox).
//
// One image: four latency CDFs (TTFT, TPOT, ITL, E2E in ms; a curve per run) and, with
// load_panels, two more panels of p50/p90 TTFT and TPOT against the offered request rate.
// The data and the script go to a temporary folder that is removed afterwards.
//
// Threading: call from one thread. Errors: NOT_FOUND when gnuplot is not installed (callers
// treat that as "plot skipped"), INTERNAL when gnuplot fails or writes no image.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tools/tandem/bench_stats.h"

namespace tandem::tools::bench {

struct PlotRun {
  std::string label;        // legend entry, e.g. "rate 2/s" or "concurrency 4"
  double offered_rate = 0;  // requests/s (load panels)
  const BenchStats* stats = nullptr;
};

bool GnuplotAvailable();

absl::Status WritePlot(const std::vector<PlotRun>& runs, bool load_panels,
                       const std::string& png_path);

}  // namespace tandem::tools::bench
