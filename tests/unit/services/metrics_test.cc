// services/common/metrics: the DESIGN.md family names and labels, series creation, counters
// that follow external totals, scrape hooks, and the /metrics HTTP endpoint.
#include "services/common/metrics.h"

#include <algorithm>
#include <set>

#include "gtest/gtest.h"
#include "prometheus/check_names.h"
#include "tests/unit/services/metrics_scrape.h"

namespace tandem::services {
namespace {

using ::tandem::testing::HttpGet;
using ::tandem::testing::SampleLines;
using ::tandem::testing::SampleValue;

const char kBase[] = "{model_name=\"m\",role=\"decode\"}";

TEST(MetricsTest, ContractNamesAreLegalForPrometheusCpp) {
  // The contract prefix is tandem_: Prometheus reserves colons for recording rules. A colon is
  // never legal in a label name.
  EXPECT_TRUE(prometheus::CheckMetricName("tandem_time_to_first_token_seconds"));
  EXPECT_FALSE(prometheus::CheckLabelName("model:role"));
}

TEST(MetricsTest, FamiliesAppearOnlyWithSeries) {
  Metrics m;
  EXPECT_EQ(m.Render(), "");
  m.Serving("m", "decode");
  EXPECT_NE(m.Render(), "");
}

TEST(MetricsTest, ServingCreatesEveryDesignFamilyWithBothLabels) {
  Metrics m;
  m.Serving("m", "decode");
  const std::string text = m.Render();
  const std::pair<const char*, const char*> families[] = {
      {"time_to_first_token_seconds", "histogram"},
      {"inter_token_latency_seconds", "histogram"},
      {"e2e_request_latency_seconds", "histogram"},
      {"request_queue_time_seconds", "histogram"},
      {"kv_transfer_seconds", "histogram"},
      {"kv_transfer_bytes", "histogram"},
      {"num_requests_running", "gauge"},
      {"num_requests_waiting", "gauge"},
      {"kv_cache_usage_perc", "gauge"},
      {"prefix_cache_queries_total", "counter"},
      {"prefix_cache_hits_total", "counter"},
      {"kv_integrity_failures_total", "counter"},
      {"kv_invariant_violations_total", "counter"},
      {"request_success_total", "counter"},
      {"migrations_total", "counter"},
  };
  for (const auto& [name, type] : families) {
    const std::string full = std::string("tandem_") + name;
    EXPECT_NE(text.find("# TYPE " + full + " " + type + "\n"), std::string::npos) << full;
    EXPECT_NE(text.find("# HELP " + full + " "), std::string::npos) << full;
  }
  // Scalars carry exactly the two contract labels; histograms add le, request_success
  // finished_reason.
  for (const char* name :
       {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "prefix_cache_queries_total", "prefix_cache_hits_total", "kv_integrity_failures_total",
        "kv_invariant_violations_total", "migrations_total", "e2e_request_latency_seconds_count", "kv_transfer_bytes_sum"}) {
    EXPECT_EQ(SampleValue(text, std::string("tandem_") + name + kBase), 0.0) << name << "\n"
                                                                             << text;
  }
  for (const char* reason : kFinishReasons) {
    const std::string series = std::string("tandem_request_success_total{finished_reason=\"") +
                               reason + "\",model_name=\"m\",role=\"decode\"}";
    EXPECT_EQ(SampleValue(text, series), 0.0) << series << "\n" << text;
  }
  // Every sample is a tandem_ series with both labels.
  for (const std::string& line : SampleLines(text)) {
    EXPECT_EQ(line.rfind("tandem_", 0), 0u) << line;
    EXPECT_NE(line.find("model_name=\"m\""), std::string::npos) << line;
    EXPECT_NE(line.find("role=\"decode\""), std::string::npos) << line;
  }
  // kvstore_tier_bytes has no series on a worker.
  EXPECT_EQ(text.find("kvstore_tier_bytes"), std::string::npos);
}

TEST(MetricsTest, RecordingMovesTheRenderedSeries) {
  Metrics m;
  ServingMetrics& s = m.Serving("m", "decode");
  EXPECT_EQ(&s, &m.Serving("m", "decode"));
  EXPECT_NE(&s, &m.Serving("m", "prefill"));
  s.e2e_request_latency.Observe(0.3);
  s.e2e_request_latency.Observe(7.0);
  s.num_requests_running.Set(3);
  s.RequestSuccess("length").Increment();
  s.RequestSuccess("length").Increment();
  s.RequestSuccess("other").Increment();
  s.kv_integrity_failures.Increment();
  const std::string text = m.Render();
  EXPECT_EQ(SampleValue(text, std::string("tandem_e2e_request_latency_seconds_count") + kBase), 2);
  EXPECT_DOUBLE_EQ(
      *SampleValue(text, std::string("tandem_e2e_request_latency_seconds_sum") + kBase), 7.3);
  EXPECT_EQ(SampleValue(text, std::string("tandem_num_requests_running") + kBase), 3);
  EXPECT_EQ(SampleValue(text,
                        "tandem_request_success_total{finished_reason=\"length\","
                        "model_name=\"m\",role=\"decode\"}"),
            2);
  EXPECT_EQ(SampleValue(text,
                        "tandem_request_success_total{finished_reason=\"other\","
                        "model_name=\"m\",role=\"decode\"}"),
            1);
  EXPECT_EQ(SampleValue(text, std::string("tandem_kv_integrity_failures_total") + kBase), 1);
  // The other role's series did not move.
  EXPECT_EQ(SampleValue(text,
                        "tandem_e2e_request_latency_seconds_count{model_name=\"m\","
                        "role=\"prefill\"}"),
            0);
}

TEST(MetricsTest, BucketsAreStrictlyIncreasingAndSpanTheirRanges) {
  struct Case {
    const std::vector<double>* b;
    double lo, hi;
  };
  const Case cases[] = {{&TtftBuckets(), 0.001, 120},
                        {&InterTokenBuckets(), 0.0005, 5},
                        {&RequestLatencyBuckets(), 0.005, 1800},
                        {&KvTransferSecondsBuckets(), 0.00005, 30},
                        {&KvTransferBytesBuckets(), 4096, 16.0 * (1ull << 30)}};
  for (const Case& c : cases) {
    ASSERT_GE(c.b->size(), 10u);
    EXPECT_TRUE(std::adjacent_find(c.b->begin(), c.b->end(), std::greater_equal<double>()) ==
                c.b->end());
    EXPECT_DOUBLE_EQ(c.b->front(), c.lo);
    EXPECT_DOUBLE_EQ(c.b->back(), c.hi);
  }
}

TEST(MetricsTest, AdvanceCounterToFollowsATotalAndNeverGoesBack) {
  Metrics m;
  prometheus::Counter& c = m.KvIntegrityFailures("m", "kvstore");
  AdvanceCounterTo(c, 5);
  EXPECT_EQ(c.Value(), 5);
  AdvanceCounterTo(c, 3);
  EXPECT_EQ(c.Value(), 5);
  AdvanceCounterTo(c, 7);
  EXPECT_EQ(c.Value(), 7);
}

TEST(MetricsTest, ScrapeHooksRefreshBeforeEachRender) {
  Metrics m;
  int runs = 0;
  prometheus::Gauge& g = m.KvStoreTierBytes("m", "kvstore", "host");
  m.AddScrapeHook([&] { g.Set(100.0 * ++runs); });
  const std::string series =
      "tandem_kvstore_tier_bytes{model_name=\"m\",role=\"kvstore\","
      "tier=\"host\"}";
  EXPECT_EQ(SampleValue(m.Render(), series), 100);
  EXPECT_EQ(SampleValue(m.Render(), series), 200);
  EXPECT_EQ(runs, 2);
}

TEST(MetricsTest, ModelNameIsTheFileStem) {
  EXPECT_EQ(ModelNameFromPath("/x/models/stories260K.gguf"), "stories260K");
  EXPECT_EQ(ModelNameFromPath("qwen2.5-0.5b-q8_0.gguf"), "qwen2.5-0.5b-q8_0");
}

TEST(MetricsServerTest, ServesTheRegistryOnAnEphemeralPort) {
  Metrics m;
  ServingMetrics& s = m.Serving("m", "decode");
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Start("127.0.0.1", 0, &m);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  EXPECT_EQ((*server)->url(), "http://127.0.0.1:" + std::to_string(port) + "/metrics");

  const std::string running = std::string("tandem_num_requests_running") + kBase;
  testing::HttpReply r = HttpGet(port, "/metrics");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(SampleValue(r.body, running), 0) << r.body;
  s.num_requests_running.Set(2);
  s.RequestSuccess("stop").Increment();
  r = HttpGet(port, "/metrics");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(SampleValue(r.body, running), 2) << r.body;
  EXPECT_EQ(SampleValue(r.body,
                        "tandem_request_success_total{finished_reason=\"stop\","
                        "model_name=\"m\",role=\"decode\"}"),
            1);
  EXPECT_EQ(HttpGet(port, "/other").status, 404);

  // The port is taken: a second server there fails with a status, not an exception.
  absl::StatusOr<std::unique_ptr<MetricsServer>> again =
      MetricsServer::Start("127.0.0.1", port, &m);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();

  server->reset();
  EXPECT_EQ(HttpGet(port, "/metrics").status, 0);  // nothing listens any more
}

TEST(MetricsServerTest, RejectsBadArguments) {
  Metrics m;
  EXPECT_EQ(MetricsServer::Start("127.0.0.1", -1, &m).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsServer::Start("127.0.0.1", 70000, &m).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsServer::Start("127.0.0.1", 0, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::services
