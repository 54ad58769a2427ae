// The real tandem-decode and tandem-prefill processes on loopback port 0: --help works, they
// serve health and Stats, register with a registry (roles, addresses), deregister and exit 0 on
// SIGTERM; and across processes over UCX the handoff yields the one-process tokens.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "services/common/grpc_server.h"
#include "services/common/sampling_convert.h"
#include "services/common/transport_factory.h"
#include "tests/component/services/cluster_fixture.h"
#include "tests/component/services/fake_registry.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;

class Process {
 public:
  Process(const std::string& binary, const std::vector<std::string>& args, const std::string& log)
      : log_(log) {
    // Everything the child needs is built before fork: between fork and exec only
    // async-signal-safe calls are allowed, since the test process has threads.
    const std::string path = std::string(TANDEM_BIN_DIR) + "/" + binary;
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(path.c_str()));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
      execv(path.c_str(), argv.data());
      _exit(127);
    }
  }
  ~Process() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  void Signal(int sig) { kill(pid_, sig); }
  // Exit status, or -1 when the process is still running after `timeout`.
  int Wait(absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return -1;
  }
  std::string Log() const {
    std::ifstream f(log_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  bool exited_ = false;
};

class WorkerBinariesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tandem-bin-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    model_path_ = (dir_ / "tiny.gguf").string();
    ASSERT_TRUE(WriteTinyModel(TinyModelOptions(), model_path_).ok());
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // Waits for a port file (explicit timeout); 0 on timeout.
  int WaitForPort(const std::string& file, absl::Duration timeout = absl::Seconds(30)) {
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      std::ifstream f(file);
      int port = 0;
      if (f >> port && port > 0) return port;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return 0;
  }

  std::vector<std::string> CommonFlags(const std::string& name) const {
    return {"--model",     model_path_, "--port",     "0",   "--port-file", Path(name + ".port"),
            "--threads",   "1",         "--ctx-size", "256", "--max-seqs",  "4",
            "--worker-id", name,        "--grace-ms", "2000"};
  }

  fs::path dir_;
  std::string model_path_;
};

TEST_F(WorkerBinariesTest, HelpExitsZero) {
  for (const char* bin : {"tandem-decode", "tandem-prefill"}) {
    Process p(bin, {"--help"}, Path(std::string(bin) + ".log"));
    EXPECT_EQ(p.Wait(absl::Seconds(20)), 0) << p.Log();
    EXPECT_NE(p.Log().find("--port-file"), std::string::npos) << p.Log();
    EXPECT_NE(p.Log().find("--transport"), std::string::npos);
  }
  Process bad("tandem-decode", {"--model", "/nonexistent.gguf", "--transport", "none"},
              Path("bad.log"));
  EXPECT_EQ(bad.Wait(absl::Seconds(20)), 1);
  EXPECT_NE(bad.Log().find("nonexistent"), std::string::npos) << bad.Log();
}

TEST_F(WorkerBinariesTest, ServeRegisterAndExitCleanlyOnSigterm) {
  FakeRegistry registry(/*lease_ms=*/600);
  services::GrpcServerOptions so;
  so.services = {&registry};
  auto reg_server = std::move(*services::GrpcServer::Start(so));

  std::vector<std::string> dflags = CommonFlags("d1");
  for (const char* f : {"--transport", "inproc", "--role", "both", "--router"}) dflags.push_back(f);
  dflags.push_back(reg_server->address());
  // Pinning: to the first CPU this test may use.
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  int cpu = 0;
  while (!CPU_ISSET(cpu, &set)) ++cpu;
  dflags.push_back("--cpus");
  dflags.push_back(std::to_string(cpu));
  std::vector<std::string> pflags = CommonFlags("p1");
  for (const char* f : {"--transport", "inproc", "--router"}) pflags.push_back(f);
  pflags.push_back(reg_server->address());

  Process d("tandem-decode", dflags, Path("d1.log"));
  Process p("tandem-prefill", pflags, Path("p1.log"));
  const int dport = WaitForPort(Path("d1.port"));
  const int pport = WaitForPort(Path("p1.port"));
  ASSERT_GT(dport, 0) << d.Log();
  ASSERT_GT(pport, 0) << p.Log();

  auto dstub = v1::DecodeWorker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(dport),
                                                             grpc::InsecureChannelCredentials()));
  auto pstub = v1::PrefillWorker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(pport),
                                                              grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    v1::WorkerStats s;
    ASSERT_TRUE(dstub->Stats(&ctx, v1::WorkerStatsRequest(), &s).ok());
    EXPECT_EQ(s.kv_blocks_total(), 4 * 256 / 16);
    grpc::ClientContext pctx;
    ASSERT_TRUE(pstub->Stats(&pctx, v1::WorkerStatsRequest(), &s).ok());
    EXPECT_EQ(s.kv_blocks_total(), 4 * 256 / 16);
  }
  // A colocated request served by the process itself.
  {
    v1::DecodeRequest dr;
    dr.set_request_id("colo");
    for (int32_t t : TestPrompt(20, 1)) dr.add_prompt_token_ids(t);
    engine::SamplingParams sp;
    sp.temperature = 0;
    sp.max_tokens = 6;
    sp.ignore_eos = true;
    *dr.mutable_sampling() = services::SamplingToProto(sp);
    dr.set_prefill_locally(true);
    grpc::ClientContext ctx;
    auto reader = dstub->Decode(&ctx, dr);
    v1::GenerateResponse msg;
    std::vector<int32_t> tokens;
    while (reader->Read(&msg))
      tokens.insert(tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_EQ(
        tokens,
        ReferenceRun(LoadTestModel("tiny"), kernels::DType::kF32, TestPrompt(20, 1), sp).tokens);
  }

  ASSERT_TRUE(registry.WaitFor(
      [&] {
        return registry.Count("heartbeat", "d1") >= 2 && registry.Count("heartbeat", "p1") >= 2;
      },
      absl::Seconds(20)));
  for (const v1::RegisterRequest& r : registry.registrations()) {
    if (r.worker_id() == "d1") {
      EXPECT_EQ(r.role(), v1::WORKER_ROLE_BOTH);
      EXPECT_EQ(r.address(), "127.0.0.1:" + std::to_string(dport));
      EXPECT_EQ(r.kv_blocks_total(), 64);
    } else {
      EXPECT_EQ(r.worker_id(), "p1");
      EXPECT_EQ(r.role(), v1::WORKER_ROLE_PREFILL);
      EXPECT_EQ(r.address(), "127.0.0.1:" + std::to_string(pport));
    }
    EXPECT_EQ(r.model(), "tiny.gguf");
  }

  d.Signal(SIGTERM);
  p.Signal(SIGINT);
  EXPECT_EQ(d.Wait(absl::Seconds(20)), 0) << d.Log();
  EXPECT_EQ(p.Wait(absl::Seconds(20)), 0) << p.Log();
  EXPECT_EQ(registry.Count("deregister", "d1"), 1);
  EXPECT_EQ(registry.Count("deregister", "p1"), 1);
  EXPECT_NE(d.Log().find("serving on"), std::string::npos) << d.Log();
}

// Separate processes, KV over UCX shared memory: what the cluster does, minus the router (the
// test makes the router's three calls itself).
TEST_F(WorkerBinariesTest, DisaggregatedOverUcxAcrossProcesses) {
  const std::vector<std::string> have = services::AvailableTransports();
  if (std::find(have.begin(), have.end(), "ucx") == have.end()) {
    GTEST_SKIP() << "this build has no UCX transport";
  }
  std::vector<std::string> dflags = CommonFlags("d2");
  for (const char* f : {"--transport", "ucx", "--ucx-tls", "shm"}) dflags.push_back(f);
  std::vector<std::string> pflags = CommonFlags("p2");
  for (const char* f : {"--transport", "ucx", "--ucx-tls", "shm", "--max-batch-tokens", "24"}) {
    pflags.push_back(f);
  }
  // A gRPC server in this process keeps threads polling every connection, as a router's do.
  // Without one nothing here reads the workers' GOAWAY at shutdown, and each worker's
  // Shutdown then waits its whole --grace-ms for our idle connections to close.
  FakeRegistry idle_registry(1000);
  services::GrpcServerOptions so;
  so.services = {&idle_registry};
  auto poller = std::move(*services::GrpcServer::Start(so));
  Process d("tandem-decode", dflags, Path("d2.log"));
  Process p("tandem-prefill", pflags, Path("p2.log"));
  const int dport = WaitForPort(Path("d2.port"));
  const int pport = WaitForPort(Path("p2.port"));
  ASSERT_GT(dport, 0) << d.Log();
  ASSERT_GT(pport, 0) << p.Log();
  auto dstub = v1::DecodeWorker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(dport),
                                                             grpc::InsecureChannelCredentials()));
  auto pstub = v1::PrefillWorker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(pport),
                                                              grpc::InsecureChannelCredentials()));

  auto model = LoadTestModel("tiny");
  int n = 0;
  for (int len : {7, 50, 130}) {
    engine::SamplingParams sp;
    sp.temperature = 0.7f;
    sp.seed = 42 + len;
    sp.max_tokens = 12;
    sp.ignore_eos = true;
    const std::vector<int32_t> prompt = TestPrompt(len, len);
    const std::string id = "x" + std::to_string(n++);
    v1::ReserveRequest rr;
    rr.set_request_id(id);
    rr.set_prompt_tokens(len);
    rr.set_max_tokens(sp.max_tokens);
    v1::ReserveResponse res;
    grpc::ClientContext c1;
    ASSERT_TRUE(dstub->Reserve(&c1, rr, &res).ok());
    v1::PrefillRequest pr;
    pr.set_request_id(id);
    for (int32_t t : prompt) pr.add_prompt_token_ids(t);
    *pr.mutable_sampling() = services::SamplingToProto(sp);
    *pr.mutable_destination() = res.destination();
    v1::PrefillResponse presp;
    grpc::ClientContext c2;
    c2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Status st = pstub->Prefill(&c2, pr, &presp);
    ASSERT_TRUE(st.ok()) << st.error_message() << "\n" << p.Log();
    EXPECT_NE(presp.transport().find("ucx"), std::string::npos) << presp.transport();
    v1::DecodeRequest dr;
    dr.set_request_id(id);
    *dr.mutable_prompt_token_ids() = pr.prompt_token_ids();
    *dr.mutable_sampling() = pr.sampling();
    dr.set_first_token_id(presp.first_token_id());
    *dr.mutable_block_checksums() = presp.block_checksums();
    grpc::ClientContext c3;
    c3.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = dstub->Decode(&c3, dr);
    v1::GenerateResponse msg;
    std::vector<int32_t> tokens;
    while (reader->Read(&msg))
      tokens.insert(tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    st = reader->Finish();
    ASSERT_TRUE(st.ok()) << st.error_message() << "\n" << d.Log();
    EXPECT_EQ(tokens, ReferenceRun(model, kernels::DType::kF32, prompt, sp).tokens) << len;
  }
  grpc::ClientContext ctx;
  v1::WorkerStats s;
  ASSERT_TRUE(dstub->Stats(&ctx, v1::WorkerStatsRequest(), &s).ok());
  EXPECT_EQ(s.kv_blocks_free(), s.kv_blocks_total());
  EXPECT_EQ(s.kv_integrity_failures(), 0u);
  d.Signal(SIGTERM);
  p.Signal(SIGTERM);
  EXPECT_EQ(d.Wait(absl::Seconds(20)), 0) << d.Log();
  EXPECT_EQ(p.Wait(absl::Seconds(20)), 0) << p.Log();
}

}  // namespace
}  // namespace tandem::testing
