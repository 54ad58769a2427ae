// deploy/grafana/tandem-dashboard.json: valid JSON shaped like a Grafana dashboard, every
// PromQL expression names only metrics some service registers (the family name, without the
// `tandem_` prefix, appears as a string literal in services/), and the metrics the dashboard
// exists for are all on it.
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/fakes/shell_util.h"

namespace {

using ::tandem::testing::Slurp;

namespace fs = std::filesystem;

// Family names used in the dashboard's expressions, histogram series suffixes removed.
std::set<std::string> DashboardFamilies(const nlohmann::json& dash, int* exprs) {
  std::set<std::string> out;
  const std::regex name(R"(tandem_([A-Za-z_][A-Za-z0-9_]*))");
  const std::regex suffix(R"(_(bucket|sum|count)$)");
  for (const auto& panel : dash.at("panels")) {
    for (const auto& t : panel.at("targets")) {
      const std::string expr = t.at("expr").get<std::string>();
      ++*exprs;
      for (std::sregex_iterator it(expr.begin(), expr.end(), name), end; it != end; ++it) {
        out.insert(std::regex_replace((*it)[1].str(), suffix, ""));
      }
    }
  }
  return out;
}

TEST(DashboardTest, ExpressionsReferenceOnlyExportedMetrics) {
  const fs::path root = TANDEM_SOURCE_DIR;
  const std::string text = Slurp(root / "deploy" / "grafana" / "tandem-dashboard.json");
  ASSERT_FALSE(text.empty());
  nlohmann::json dash;
  ASSERT_NO_THROW(dash = nlohmann::json::parse(text));
  ASSERT_TRUE(dash.contains("panels"));
  EXPECT_FALSE(dash.value("title", "").empty());
  std::set<int> ids;
  for (const auto& p : dash["panels"]) {
    EXPECT_TRUE(ids.insert(p.at("id").get<int>()).second) << "duplicate panel id";
    EXPECT_FALSE(p.at("targets").empty()) << p.at("title");
  }

  // Every string literal of the services' sources.
  std::string sources;
  for (const auto& e : fs::recursive_directory_iterator(root / "services")) {
    const std::string ext = e.path().extension().string();
    if (e.is_regular_file() && (ext == ".cc" || ext == ".h")) sources += Slurp(e.path());
  }
  int exprs = 0;
  const std::set<std::string> families = DashboardFamilies(dash, &exprs);
  EXPECT_GE(exprs, 15);
  for (const std::string& f : families) {
    EXPECT_NE(sources.find("\"" + f + "\""), std::string::npos)
        << "the dashboard uses tandem_" << f << ", which no service registers";
  }
  // What the dashboard is for.
  for (const char* want :
       {"time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_success_total", "num_requests_running",
        "num_requests_waiting", "kv_cache_usage_perc", "kvstore_tier_bytes",
        "kv_integrity_failures_total", "ttft_breakdown_seconds", "recommended_replicas",
        "prefix_cache_hits_total", "kv_transfer_seconds", "migrations_total",
        "model_bandwidth_utilization", "model_flops_utilization", "engine_step_seconds",
        "slo_rejected_total"}) {
    EXPECT_TRUE(families.count(want)) << "the dashboard has no panel for tandem_" << want;
  }
}

}  // namespace
