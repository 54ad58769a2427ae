#include "tools/tandem/bench_plot.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace tandem::tools::bench {
namespace {

namespace fs = std::filesystem;

// Sorted values as "value fraction" lines: an empirical CDF.
void WriteCdf(const fs::path& path, const std::vector<double>& sorted) {
  std::ofstream f(path);
  const size_t n = sorted.size();
  for (size_t i = 0; i < n; ++i) f << sorted[i] << ' ' << static_cast<double>(i + 1) / n << '\n';
}

std::string Quote(const std::string& s) {
  return absl::StrCat("'", absl::StrReplaceAll(s, {{"'", "''"}}), "'");
}

std::string ShellQuote(const std::string& s) {
  return absl::StrCat("'", absl::StrReplaceAll(s, {{"'", "'\\''"}}), "'");
}

}  // namespace

bool GnuplotAvailable() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

absl::Status WritePlot(const std::vector<PlotRun>& runs, bool load_panels,
                       const std::string& png_path) {
  if (!GnuplotAvailable()) {
    return absl::NotFoundError("gnuplot is not installed (apt-get install gnuplot-nox)");
  }
  std::error_code ec;
  const fs::path dir =
      fs::temp_directory_path() / absl::StrCat("tandem-bench-plot-", getpid(), "-", rand());
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir.string()));

  struct Metric {
    const char* name;
    const char* title;
    std::vector<double> BenchStats::*values;
  };
  const Metric metrics[] = {{"ttft", "TTFT (ms)", &BenchStats::ttft_values_ms},
                            {"tpot", "TPOT (ms)", &BenchStats::tpot_values_ms},
                            {"itl", "ITL (ms)", &BenchStats::itl_values_ms},
                            {"e2e", "E2E latency (ms)", &BenchStats::e2e_values_ms}};
  for (size_t r = 0; r < runs.size(); ++r) {
    for (const Metric& m : metrics) {
      WriteCdf(dir / absl::StrCat(m.name, "-", r, ".dat"), runs[r].stats->*(m.values));
    }
  }
  if (load_panels) {
    std::ofstream f(dir / "load.dat");
    for (const PlotRun& r : runs) {
      f << r.offered_rate << ' ' << r.stats->ttft_ms.p50 << ' ' << r.stats->ttft_ms.p90 << ' '
        << r.stats->tpot_ms.p50 << ' ' << r.stats->tpot_ms.p90 << ' ' << r.stats->goodput << '\n';
    }
  }

  std::string script = absl::StrCat(
      "set terminal pngcairo size ", 1200, ",", load_panels ? 1200 : 800, " font 'sans,10'\n",
      "set output ", Quote(png_path), "\n", "set multiplot layout ", load_panels ? 3 : 2,
      ",2 title 'tandem bench'\n", "set grid\nset key bottom right\n",
      "set ylabel 'cumulative fraction'\nset yrange [0:1]\n");
  for (const Metric& m : metrics) {
    absl::StrAppend(&script, "set title '", m.title, " CDF'\nset xlabel '", m.title, "'\nplot ");
    bool first = true;
    for (size_t r = 0; r < runs.size(); ++r) {
      const fs::path data = dir / absl::StrCat(m.name, "-", r, ".dat");
      if ((runs[r].stats->*(m.values)).empty()) continue;
      absl::StrAppend(&script, first ? "" : ", ", Quote(data.string()),
                      " using 1:2 with steps lw 2 title ", Quote(runs[r].label));
      first = false;
    }
    // gnuplot needs something to plot: an empty metric gets a flat placeholder.
    if (first) absl::StrAppend(&script, "0 notitle");
    absl::StrAppend(&script, "\n");
  }
  if (load_panels) {
    const std::string load = Quote((dir / "load.dat").string());
    absl::StrAppend(
        &script, "set yrange [*:*]\nset key top left\nset xlabel 'offered load (requests/s)'\n",
        "set ylabel 'ms'\nset title 'TTFT against load'\nplot ", load,
        " using 1:2 with linespoints lw 2 title 'p50', ", load,
        " using 1:3 with linespoints lw 2 title 'p90'\n", "set title 'TPOT against load'\nplot ",
        load, " using 1:4 with linespoints lw 2 title 'p50', ", load,
        " using 1:5 with linespoints lw 2 title 'p90'\n");
  }
  absl::StrAppend(&script, "unset multiplot\n");
  const fs::path script_path = dir / "plot.gp";
  {
    std::ofstream f(script_path);
    f << script;
  }
  fs::remove(png_path, ec);
  const std::string log = (dir / "gnuplot.log").string();
  const int rc = std::system(
      absl::StrCat("gnuplot ", ShellQuote(script_path.string()), " > ", ShellQuote(log), " 2>&1")
          .c_str());
  std::string err;
  if (rc != 0 || !fs::exists(png_path) || fs::file_size(png_path, ec) == 0) {
    std::ifstream f(log);
    err.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  fs::remove_all(dir, ec);
  if (!err.empty() || rc != 0) {
    return absl::InternalError(absl::StrCat("gnuplot failed (exit ", rc, "): ", err));
  }
  return absl::OkStatus();
}

}  // namespace tandem::tools::bench
