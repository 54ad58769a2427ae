// --metrics-port on the real tandem-decode, tandem-prefill and tandem-kvstore processes: each
// serves /metrics on loopback with its role's series, a request moves the decode worker's
// counters, and a metrics port that is taken stops the process with a clear error.
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "services/common/sampling_convert.h"
#include "services/kvstore/memory_tiers.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "tests/component/services/cluster_fixture.h"
#include "tests/fakes/child_process.h"
#include "tests/fakes/tiny_model.h"
#include "tests/unit/services/metrics_scrape.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;

class MetricsBinariesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tandem-metrics-bin-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    model_path_ = (dir_ / "tiny.gguf").string();
    ASSERT_TRUE(WriteTinyModel(TinyModelOptions(), model_path_).ok());
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }


  std::vector<std::string> WorkerFlags(const std::string& name, int metrics_port) const {
    return {"--model",        model_path_,
            "--port",         "0",
            "--port-file",    Path(name + ".port"),
            "--threads",      "1",
            "--ctx-size",     "256",
            "--max-seqs",     "2",
            "--worker-id",    name,
            "--grace-ms",     "2000",
            "--metrics-port", std::to_string(metrics_port)};
  }

  fs::path dir_;
  std::string model_path_;
};

TEST_F(MetricsBinariesTest, DecodeServesMetricsThatARequestMoves) {
  const int mport = FreePort();
  ASSERT_GT(mport, 0);
  std::vector<std::string> args = WorkerFlags("dec", mport);
  for (const char* a : {"--role", "both", "--transport", "none"}) args.push_back(a);
  ChildProcess c("tandem-decode", args, Path("dec.log"));
  const int port = WaitForPortFile(Path("dec.port"), &c);
  ASSERT_GT(port, 0) << c.Log();
  EXPECT_NE(c.Log().find("metrics on http://127.0.0.1:" + std::to_string(mport) + "/metrics"),
            std::string::npos)
      << c.Log();

  HttpReply r = HttpGet(mport, "/metrics");
  ASSERT_EQ(r.status, 200) << c.Log();
  const std::string running = "tandem_num_requests_running{model_name=\"tiny\",role=\"both\"}";
  const std::string length =
      "tandem_request_success_total{finished_reason=\"length\",model_name=\"tiny\","
      "role=\"both\"}";
  EXPECT_EQ(SampleValue(r.body, running), 0) << r.body;
  EXPECT_EQ(SampleValue(r.body, length), 0) << r.body;

  auto stub = v1::DecodeWorker::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  v1::DecodeRequest req;
  req.set_request_id("m-1");
  for (int32_t t : TestPrompt(12, 4)) req.add_prompt_token_ids(t);
  engine::SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 5;
  sp.ignore_eos = true;
  *req.mutable_sampling() = services::SamplingToProto(sp);
  req.set_prefill_locally(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = stub->Decode(&ctx, req);
  v1::GenerateResponse msg;
  int tokens = 0;
  while (reader->Read(&msg)) tokens += msg.token_ids_size();
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(tokens, 5);

  r = HttpGet(mport, "/metrics");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(SampleValue(r.body, length), 1) << r.body;
  EXPECT_EQ(SampleValue(r.body,
                        "tandem_inter_token_latency_seconds_count{model_name=\"tiny\","
                        "role=\"both\"}"),
            4)
      << r.body;
  c.Signal(SIGTERM);
  EXPECT_EQ(c.Wait(absl::Seconds(20)), 0) << c.Log();
  EXPECT_EQ(HttpGet(mport, "/metrics").status, 0);  // gone with the process
}

TEST_F(MetricsBinariesTest, PrefillAndKvStoreServeTheirRoles) {
  const int pport = FreePort(), kport = FreePort();
  ASSERT_GT(pport, 0);
  ASSERT_GT(kport, 0);
  ASSERT_NE(pport, kport);
  std::vector<std::string> pargs = WorkerFlags("pre", pport);
  for (const char* a : {"--transport", "inproc"}) pargs.push_back(a);
  ChildProcess p("tandem-prefill", pargs, Path("pre.log"));
  ChildProcess k("tandem-kvstore",
          {"--port", "0", "--port-file", Path("kv.port"), "--device-mb", "1", "--host-mb", "1",
           "--metrics-port", std::to_string(kport), "--model-name", "tiny"},
          Path("kv.log"));
  ASSERT_GT(WaitForPortFile(Path("pre.port"), &p), 0) << p.Log();
  ASSERT_GT(WaitForPortFile(Path("kv.port"), &k), 0) << k.Log();

  HttpReply r = HttpGet(pport, "/metrics");
  ASSERT_EQ(r.status, 200) << p.Log();
  EXPECT_EQ(SampleValue(r.body,
                        "tandem_num_requests_running{model_name=\"tiny\","
                        "role=\"prefill\"}"),
            0)
      << r.body;
  EXPECT_EQ(SampleValue(r.body,
                        "tandem_kv_transfer_bytes_count{model_name=\"tiny\","
                        "role=\"prefill\"}"),
            0)
      << r.body;

  r = HttpGet(kport, "/metrics");
  ASSERT_EQ(r.status, 200) << k.Log();
  EXPECT_EQ(SampleValue(r.body,
                        "tandem_kvstore_tier_bytes{model_name=\"tiny\",role=\"kvstore\","
                        "tier=\"" +
                            kvstore::DeviceTierLabel() + "\"}"),
            0)
      << r.body;
  EXPECT_EQ(SampleValue(r.body,
                        "tandem_kv_integrity_failures_total{model_name=\"tiny\","
                        "role=\"kvstore\"}"),
            0)
      << r.body;

  p.Signal(SIGTERM);
  k.Signal(SIGTERM);
  EXPECT_EQ(p.Wait(absl::Seconds(20)), 0) << p.Log();
  EXPECT_EQ(k.Wait(absl::Seconds(20)), 0) << k.Log();
}

TEST_F(MetricsBinariesTest, ATakenMetricsPortStopsTheWorker) {
  // Hold a port open.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int taken = ntohs(a.sin_port);

  std::vector<std::string> args = WorkerFlags("dec", taken);
  for (const char* x : {"--transport", "none"}) args.push_back(x);
  ChildProcess c("tandem-decode", args, Path("dec.log"));
  EXPECT_EQ(c.Wait(absl::Seconds(30)), 1) << c.Log();
  EXPECT_NE(c.Log().find("tandem-decode: --metrics-port:"), std::string::npos) << c.Log();
  EXPECT_FALSE(fs::exists(Path("dec.port")));  // never announced itself
  close(fd);
}

}  // namespace
}  // namespace tandem::testing
