// `tandem bench` against a real local cluster (`tandem cluster up` on stories260K, 1 prefill +
// 1 decode worker): a closed-loop run and an open-loop sweep of two rates. Checks the JSON
// results are complete and sane (every request succeeded, latencies ordered and positive,
// throughput consistent with the token counts), that the PNG exists with the PNG signature,
// and that the router's /metrics (its HTTP port) counted the requests with role="router".
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/fakes/child_process.h"
#include "nlohmann/json.hpp"
#include "tests/unit/services/metrics_scrape.h"
#include "tests/fakes/shell_util.h"

namespace {

using ::tandem::testing::Quote;
using ::tandem::testing::Slurp;

namespace fs = std::filesystem;
using nlohmann::json;
using ::tandem::testing::FreePort;

const fs::path kModel = fs::path(TANDEM_SHARED_MODELS_DIR) / "stories260K" / "stories260K.gguf";
const std::string kBin = TANDEM_BIN_DIR;

// Runs `tandem ARGS`; returns the exit code, stdout+stderr in *out.
int Tandem(const std::string& args, std::string* out, int timeout_s = 60) {
  const fs::path log =
      fs::temp_directory_path() / absl::StrCat("tandem-bench-test-", getpid(), ".log");
  const int st = std::system(absl::StrCat("timeout -k 5 ", timeout_s, " ", kBin, "/tandem ", args,
                                          " >", Quote(log.string()), " 2>&1")
                                 .c_str());
  *out = Slurp(log);
  fs::remove(log);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}


bool IsPng(const fs::path& p) {
  const std::string head = Slurp(p).substr(0, 8);
  return head == std::string("\x89PNG\r\n\x1a\n", 8);
}

void ExpectSaneRun(const json& run, int requests, int output_len) {
  EXPECT_EQ(run["completed"].get<int>(), requests) << run["errors"].dump();
  EXPECT_EQ(run["failed"].get<int>(), 0);
  EXPECT_EQ(run["total_output_tokens"].get<int>(), requests * output_len);
  EXPECT_GT(run["duration_s"].get<double>(), 0);
  EXPECT_NEAR(run["request_throughput"].get<double>(), requests / run["duration_s"].get<double>(),
              1e-6);
  EXPECT_GT(run["output_token_throughput"].get<double>(), 0);
  for (const char* m : {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}) {
    const json& s = run[m];
    EXPECT_GT(s["count"].get<int>(), 0) << m;
    EXPECT_GT(s["mean"].get<double>(), 0) << m;
    EXPECT_LE(s["p50"].get<double>(), s["p90"].get<double>()) << m;
    EXPECT_LE(s["p90"].get<double>(), s["p99"].get<double>()) << m;
    EXPECT_LE(s["p99"].get<double>(), s["max"].get<double>() + 1e-9) << m;
  }
  EXPECT_EQ(run["itl_ms"]["count"].get<int>(), requests * (output_len - 1));
  EXPECT_GE(run["e2e_ms"]["mean"].get<double>(), run["ttft_ms"]["mean"].get<double>());
  EXPECT_EQ(run["requests"].size(), static_cast<size_t>(requests));
  // The router's breakdown reached the client: a disaggregated cluster has prefill compute.
  EXPECT_GT(run["server_ttft_breakdown_ms"]["prefill_compute"].get<double>(), 0);
}

TEST(BenchIntegrationTest, ClosedAndOpenLoopAgainstARealCluster) {
  if (!fs::exists(kModel)) GTEST_SKIP() << kModel << " is missing";
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("tandem-bench-it-", getpid());
  fs::remove_all(dir);
  const int http_port = FreePort();
  std::string out;
  ASSERT_EQ(Tandem(absl::StrCat("cluster up --model ", Quote(kModel.string()),
                                " --prefill 1 --decode 1 --dir ", Quote(dir.string()),
                                " --router-port 0 --http-port ", http_port,
                                " --threads 1 --timeout-ms 30000"),
                   &out),
            0)
      << out;
  struct Down {
    fs::path dir;
    ~Down() {
      std::string o;
      Tandem(absl::StrCat("cluster down --grace-ms 3000 --dir ", Quote(dir.string())), &o);
      if (!::testing::Test::HasFailure()) fs::remove_all(dir);
    }
  } down{dir};
  const json state = json::parse(Slurp(dir / "cluster.json"));
  const std::string router = state["router"].get<std::string>();

  // Closed loop, with SLOs: one generous (all good), so goodput equals throughput.
  const fs::path results = dir / "results.json", plot = dir / "results.png";
  constexpr int kRequests = 8, kOut = 8;
  ASSERT_EQ(Tandem(absl::StrCat("bench --router ", router, " --num-requests ", kRequests,
                                " --concurrency 2 --input-len 24 --output-len ", kOut,
                                " --slo ttft:60000,tpot:60000 --seed 3 --out ",
                                Quote(results.string()), " --plot ", Quote(plot.string())),
                   &out),
            0)
      << out;
  const json j = json::parse(Slurp(results));
  ASSERT_EQ(j["runs"].size(), 1u);
  ExpectSaneRun(j["runs"][0], kRequests, kOut);
  EXPECT_EQ(j["completed"].get<int>(), kRequests);  // the top-level copy
  EXPECT_EQ(j["runs"][0]["mode"], "closed");
  EXPECT_DOUBLE_EQ(j["goodput"].get<double>(), j["request_throughput"].get<double>());
  EXPECT_EQ(j["runs"][0]["requests"][0]["prompt_tokens"].get<int>(), 24);
  if (j.contains("plot_skipped")) {
    GTEST_SKIP() << "plot skipped: " << j["plot_skipped"];  // no gnuplot on this machine
  }
  ASSERT_TRUE(fs::exists(plot)) << out;
  EXPECT_TRUE(IsPng(plot));

  // The router counted those requests (its HTTP front door serves /metrics).
  tandem::testing::HttpReply m = tandem::testing::HttpGet(http_port, "/metrics");
  ASSERT_EQ(m.status, 200);
  const std::string series =
      "tandem_time_to_first_token_seconds_count{model_name=\"stories260K\",role=\"router\"}";
  EXPECT_EQ(tandem::testing::SampleValue(m.body, series).value_or(-1), kRequests) << m.body;

  // Open loop, two rates, shared-prefix: a run per rate and the load panels.
  const fs::path sweep = dir / "sweep.json", sweep_png = dir / "sweep.png";
  ASSERT_EQ(Tandem(absl::StrCat("bench --router ", router,
                                " --num-requests 6 --request-rate 20,40 --arrival poisson",
                                " --workload shared-prefix --prefix-len 32 --input-len 8",
                                " --output-len 4 --slo ttft:0.001 --out ", Quote(sweep.string()),
                                " --plot ", Quote(sweep_png.string())),
                   &out),
            0)
      << out;
  const json s = json::parse(Slurp(sweep));
  ASSERT_EQ(s["runs"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    ExpectSaneRun(s["runs"][i], 6, 4);
    EXPECT_EQ(s["runs"][i]["mode"], "open");
    EXPECT_EQ(s["runs"][i]["requests"][0]["prompt_tokens"].get<int>(), 40);
    // A 1 us TTFT target is beyond any real request: goodput stays below throughput.
    EXPECT_LT(s["runs"][i]["goodput"].get<double>(),
              s["runs"][i]["request_throughput"].get<double>());
  }
  EXPECT_DOUBLE_EQ(s["runs"][1]["request_rate"].get<double>(), 40);
  ASSERT_TRUE(fs::exists(sweep_png));
  EXPECT_TRUE(IsPng(sweep_png));
}

// `tandem simulate` replays a measured run with the step costs the cluster's own workers
// fitted, and writes the JSON `tandem bench` writes: every field of the measured run's summary
// and per-request records is there, for every request.
TEST(BenchIntegrationTest, SimulateReplaysAMeasuredRunWithTheWorkersOwnCosts) {
  if (!fs::exists(kModel)) GTEST_SKIP() << kModel << " is missing";
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("tandem-sim-it-", getpid());
  fs::remove_all(dir);
  std::string out;
  ASSERT_EQ(Tandem(absl::StrCat("cluster up --model ", Quote(kModel.string()),
                                " --prefill 1 --decode 1 --dir ", Quote(dir.string()),
                                " --router-port 0 --threads 1 --timeout-ms 30000"),
                   &out),
            0)
      << out;
  struct Down {
    fs::path dir;
    ~Down() {
      std::string o;
      Tandem(absl::StrCat("cluster down --grace-ms 3000 --dir ", Quote(dir.string())), &o);
      if (!::testing::Test::HasFailure()) fs::remove_all(dir);
    }
  } down{dir};
  const std::string router =
      json::parse(Slurp(dir / "cluster.json"))["router"].get<std::string>();
  const fs::path measured = dir / "measured.json", simulated = dir / "simulated.json";
  constexpr int kRequests = 40;
  ASSERT_EQ(Tandem(absl::StrCat("bench --router ", router, " --num-requests ", kRequests,
                                " --request-rate 20 --input-len 24 --output-len 6",
                                " --mix interactive:1:ttft=5000,batch:1 --seed 4 --quiet --out ",
                                Quote(measured.string())),
                   &out),
            0)
      << out;
  // Heartbeats carry the fits: wait for one after the run.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  ASSERT_EQ(Tandem(absl::StrCat("simulate --cost-from ", router, " --trace ",
                                Quote(measured.string()), " --prefill 1 --decode 1 --out ",
                                Quote(simulated.string())),
                   &out),
            0)
      << out;
  const json m = json::parse(Slurp(measured)), s = json::parse(Slurp(simulated));
  for (const auto& [key, value] : m["runs"][0].items()) {
    EXPECT_TRUE(s["runs"][0].contains(key)) << key;
  }
  for (const auto& [key, value] : m["runs"][0]["requests"][0].items()) {
    EXPECT_TRUE(s["runs"][0]["requests"][0].contains(key)) << key;
  }
  ASSERT_EQ(s["runs"][0]["requests"].size(), static_cast<size_t>(kRequests));
  EXPECT_EQ(s["completed"].get<int>(), kRequests) << s["runs"][0]["errors"].dump();
  EXPECT_EQ(s["runs"][0]["classes"].size(), 2u);
  EXPECT_EQ(s["runs"][0]["classes"][0]["ttft_target_ms"].get<double>(),
            m["runs"][0]["classes"][0]["ttft_target_ms"].get<double>());
  for (size_t i = 0; i < kRequests; ++i) {
    EXPECT_EQ(s["runs"][0]["requests"][i]["start_s"], m["runs"][0]["requests"][i]["start_s"]);
    EXPECT_GT(s["runs"][0]["requests"][i]["ttft_ms"].get<double>(), 0);
  }
  const std::string source = s["simulated"]["costs"]["source"].get<std::string>();
  EXPECT_NE(source.find(router), std::string::npos) << source;
  // Every prompt had 24 tokens: the fit may put the whole prefill in its intercept.
  const json& p = s["simulated"]["costs"]["prefill"];
  EXPECT_GT(p["intercept_s"].get<double>() + 24 * p["prefill_token_s"].get<double>(), 0);
  for (const char* role : {"prefill", "decode", "colocated"}) {
    for (const auto& [k, v] : s["simulated"]["costs"][role].items()) EXPECT_GE(v.get<double>(), 0);
  }
}

// `tandem simulate --model` fits the step costs here, and `tandem plan` sizes pools from them.
TEST(BenchIntegrationTest, SimulateFitsCostsFromTheModelAndPlanUsesThem) {
  if (!fs::exists(kModel)) GTEST_SKIP() << kModel << " is missing";
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("tandem-plan-it-", getpid());
  fs::create_directories(dir);
  const fs::path costs = dir / "costs.json", simulated = dir / "sim.json";
  std::string out;
  ASSERT_EQ(Tandem(absl::StrCat("simulate --model ", Quote(kModel.string()),
                                " --save-cost ", Quote(costs.string()),
                                " --colocated 2 --rate 50 --num-requests 300 --input-len 64",
                                " --output-len 8 --slo ttft:1000 --quiet --out ",
                                Quote(simulated.string())),
                   &out),
            0)
      << out;
  const json c = json::parse(Slurp(costs));
  for (const char* role : {"prefill", "decode", "colocated"}) {
    EXPECT_GT(c[role]["prefill_token_s"].get<double>(), 0) << c.dump();
    // A decode step costs something; the fit may put it in any of these terms (on a fast
    // machine it put all of it in the per-KV-token one).
    const json& r = c[role];
    EXPECT_GT(r["intercept_s"].get<double>() + r["decode_seq_s"].get<double>() +
                  68 * r["decode_kv_token_s"].get<double>(),
              0)
        << c.dump();
  }
  const json s = json::parse(Slurp(simulated));
  EXPECT_EQ(s["completed"].get<int>(), 300);
  EXPECT_EQ(s["simulated"]["colocated"].get<int>(), 2);
  ASSERT_EQ(Tandem(absl::StrCat("plan --cost ", Quote(costs.string()),
                                " --rate 20 --isl 64 --osl 8 --slo ttft:500,tpot:100 --json"),
                   &out),
            0)
      << out;
  const json p = json::parse(out);
  EXPECT_TRUE(p["pick"] == "colocated" || p["pick"] == "disaggregated") << out;
  EXPECT_GE(p["colocated"]["attained"].get<double>(), 0.99) << out;
  EXPECT_LE(p["wall_s"].get<double>(), 5.0);
  // Options it cannot use are refused.
  EXPECT_NE(Tandem(absl::StrCat("plan --cost ", Quote(costs.string()),
                                " --rate 20 --isl 0 --slo ttft:500"),
                   &out),
            0);
  EXPECT_NE(out.find("histogram"), std::string::npos) << out;
  EXPECT_NE(Tandem("simulate --colocated 1 --rate 5 --num-requests 5", &out), 0);
  EXPECT_NE(out.find("exactly one of"), std::string::npos) << out;
  fs::remove_all(dir);
}

}  // namespace
