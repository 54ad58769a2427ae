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
#include "tests/fakes/child_process.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;

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
    ChildProcess p(bin, {"--help"}, Path(std::string(bin) + ".log"));
    EXPECT_EQ(p.Wait(absl::Seconds(20)), 0) << p.Log();
    EXPECT_NE(p.Log().find("--port-file"), std::string::npos) << p.Log();
    EXPECT_NE(p.Log().find("--transport"), std::string::npos);
  }
  ChildProcess bad("tandem-decode", {"--model", "/nonexistent.gguf", "--transport", "none"},
              Path("bad.log"));
  EXPECT_EQ(bad.Wait(absl::Seconds(20)), 1);
  EXPECT_NE(bad.Log().find("nonexistent"), std::string::npos) << bad.Log();
}

// Test hooks live in the test twin only: the product binaries refuse them at parse time.
TEST_F(WorkerBinariesTest, ProductBinariesTakeNoTestHooks) {
  for (const auto& [bin, flag] : std::vector<std::pair<std::string, std::string>>{
           {"tandem-prefill", "--test-step-delay-ms"},
           {"tandem-prefill", "--test-fault-flip-bit-every"},
           {"tandem-decode", "--test-fault-flip-bit-every"}}) {
    ChildProcess p(bin, {flag, "1", "--model", "/nonexistent.gguf"}, Path(bin + "-hook.log"));
    EXPECT_NE(p.Wait(absl::Seconds(20)), 0) << bin << " took " << flag;
    EXPECT_NE(p.Log().find(flag), std::string::npos) << p.Log();
    EXPECT_EQ(p.Log().find("nonexistent"), std::string::npos) << "refused only at model load";
  }
  ChildProcess twin("tandem-prefill-test-hooks",
                    {"--test-step-delay-ms", "1", "--model", "/nonexistent.gguf"},
                    Path("twin.log"));
  EXPECT_EQ(twin.Wait(absl::Seconds(20)), 1);
  EXPECT_NE(twin.Log().find("nonexistent"), std::string::npos) << twin.Log();
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

  ChildProcess d("tandem-decode", dflags, Path("d1.log"));
  ChildProcess p("tandem-prefill", pflags, Path("p1.log"));
  const int dport = WaitForPortFile(Path("d1.port"));
  const int pport = WaitForPortFile(Path("p1.port"));
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
  // A long grace, so a shutdown that waited for idle clients would show (see the end).
  for (auto* flags : {&dflags, &pflags}) {
    *(std::find(flags->begin(), flags->end(), "--grace-ms") + 1) = "10000";
  }
  ChildProcess d("tandem-decode", dflags, Path("d2.log"));
  ChildProcess p("tandem-prefill", pflags, Path("p2.log"));
  const int dport = WaitForPortFile(Path("d2.port"));
  const int pport = WaitForPortFile(Path("p2.port"));
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
  // Nothing in this process polls our idle connections to the workers, so they would read the
  // workers' GOAWAY only at gRPC's 5 s backup poll: the workers must not wait for that.
  const absl::Time t0 = absl::Now();
  d.Signal(SIGTERM);
  p.Signal(SIGTERM);
  EXPECT_EQ(d.Wait(absl::Seconds(20)), 0) << d.Log();
  EXPECT_EQ(p.Wait(absl::Seconds(20)), 0) << p.Log();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3)) << "shutdown waited for idle clients";
}

v1::WorkerStats StatsOf(v1::DecodeWorker::Stub* d, v1::PrefillWorker::Stub* p) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::WorkerStats s;
  const grpc::Status st = d != nullptr ? d->Stats(&ctx, v1::WorkerStatsRequest(), &s)
                                       : p->Stats(&ctx, v1::WorkerStatsRequest(), &s);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return s;
}

// What the router does when a client cancels while its prefill runs: Cancel on both workers.
// Separate processes, KV over UCX shared memory, a prefill slowed to 150 ms a step so the
// cancel lands after some layers were written and before the last. Both pools must return to
// their baseline: the prefill's once its in-flight writes drain, the decode's after its
// quarantine (so the writes still landing cannot reach another request's blocks).
TEST_F(WorkerBinariesTest, CancelDuringPrefillReturnsBothPoolsToBaseline) {
  const std::vector<std::string> have = services::AvailableTransports();
  if (std::find(have.begin(), have.end(), "ucx") == have.end()) {
    GTEST_SKIP() << "this build has no UCX transport";
  }
  constexpr int kQuarantineMs = 500;
  std::vector<std::string> dflags = CommonFlags("d3");
  for (const char* f : {"--transport", "ucx", "--ucx-tls", "shm"}) dflags.push_back(f);
  dflags.push_back("--quarantine-ms");
  dflags.push_back(std::to_string(kQuarantineMs));
  std::vector<std::string> pflags = CommonFlags("p3");
  for (const char* f : {"--transport", "ucx", "--ucx-tls", "shm", "--max-batch-tokens", "24",
                        "--test-step-delay-ms", "150"}) {
    pflags.push_back(f);
  }
  ChildProcess d("tandem-decode", dflags, Path("d3.log"));
  ChildProcess p("tandem-prefill-test-hooks", pflags, Path("p3.log"));
  const int dport = WaitForPortFile(Path("d3.port"));
  const int pport = WaitForPortFile(Path("p3.port"));
  ASSERT_GT(dport, 0) << d.Log();
  ASSERT_GT(pport, 0) << p.Log();
  auto dstub = v1::DecodeWorker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(dport),
                                                             grpc::InsecureChannelCredentials()));
  auto pstub = v1::PrefillWorker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(pport),
                                                              grpc::InsecureChannelCredentials()));
  const v1::WorkerStats d0 = StatsOf(dstub.get(), nullptr);
  const v1::WorkerStats p0 = StatsOf(nullptr, pstub.get());
  ASSERT_EQ(d0.kv_blocks_free(), d0.kv_blocks_total());
  ASSERT_EQ(p0.kv_blocks_free(), p0.kv_blocks_total());

  const std::vector<int32_t> prompt = TestPrompt(130, 7);  // 6 steps of 24 tokens: ~900 ms
  v1::ReserveRequest rr;
  rr.set_request_id("doomed");
  rr.set_prompt_tokens(130);
  rr.set_max_tokens(12);
  v1::ReserveResponse res;
  {
    grpc::ClientContext c;
    ASSERT_TRUE(dstub->Reserve(&c, rr, &res).ok());
  }
  v1::PrefillRequest pr;
  pr.set_request_id("doomed");
  for (int32_t t : prompt) pr.add_prompt_token_ids(t);
  *pr.mutable_destination() = res.destination();
  grpc::Status prefill_st;
  std::thread caller([&] {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::PrefillResponse resp;
    prefill_st = pstub->Prefill(&c, pr, &resp);
  });
  // Wait until KV is crossing: the prefill holds local blocks and has written some layers.
  bool writing = false;
  for (const absl::Time end = absl::Now() + absl::Seconds(20); !writing && absl::Now() < end;) {
    const v1::WorkerStats s = StatsOf(nullptr, pstub.get());
    writing = s.transport_bytes_written() > p0.transport_bytes_written() &&
              s.kv_blocks_free() < s.kv_blocks_total();
    if (!writing) absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(writing) << p.Log();
  const absl::Time cancelled = absl::Now();
  for (bool on_prefill : {true, false}) {
    grpc::ClientContext c;
    v1::CancelRequest creq;
    creq.set_request_id("doomed");
    v1::CancelResponse cresp;
    const grpc::Status st =
        on_prefill ? pstub->Cancel(&c, creq, &cresp) : dstub->Cancel(&c, creq, &cresp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_TRUE(cresp.found()) << (on_prefill ? "prefill" : "decode");
  }
  caller.join();
  EXPECT_EQ(prefill_st.error_code(), grpc::StatusCode::CANCELLED) << prefill_st.error_message();
  // A late Decode is refused, naming the cancel.
  {
    v1::DecodeRequest dr;
    dr.set_request_id("doomed");
    *dr.mutable_prompt_token_ids() = pr.prompt_token_ids();
    for (int i = 0; i < res.destination().block_ids_size(); ++i) dr.add_block_checksums(i);
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto reader = dstub->Decode(&c, dr);
    v1::GenerateResponse msg;
    EXPECT_FALSE(reader->Read(&msg));
    const grpc::Status st = reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
    EXPECT_NE(st.error_message().find("cancelled"), std::string::npos) << st.error_message();
  }
  // Both pools back at their baseline (explicit timeout); the decode one not before the
  // quarantine ended.
  bool prefill_at_rest = false, decode_at_rest = false;
  absl::Time decode_back;
  for (const absl::Time end = absl::Now() + absl::Seconds(20);
       !(prefill_at_rest && decode_at_rest) && absl::Now() < end;) {
    if (!prefill_at_rest) {
      const v1::WorkerStats s = StatsOf(nullptr, pstub.get());
      prefill_at_rest =
          s.kv_blocks_free() == p0.kv_blocks_free() && s.running() == 0 && s.waiting() == 0;
    }
    if (!decode_at_rest) {
      const v1::WorkerStats s = StatsOf(dstub.get(), nullptr);
      decode_at_rest = s.kv_blocks_free() == d0.kv_blocks_free() && s.reservations() == 0;
      if (decode_at_rest) decode_back = absl::Now();
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(prefill_at_rest) << StatsOf(nullptr, pstub.get()).DebugString();
  ASSERT_TRUE(decode_at_rest) << StatsOf(dstub.get(), nullptr).DebugString();
  EXPECT_GE(decode_back - cancelled, absl::Milliseconds(kQuarantineMs));
  EXPECT_EQ(StatsOf(dstub.get(), nullptr).kv_integrity_failures(), 0u);
  // The cancel landed mid-prefill: not every layer of the prompt was written.
  const uint64_t slot_bytes = res.destination().block_bytes() / res.destination().block_size();
  const uint64_t whole = 2 * uint64_t(res.destination().num_layers()) * 130 * slot_bytes;
  EXPECT_LT(StatsOf(nullptr, pstub.get()).transport_bytes_written() - p0.transport_bytes_written(),
            whole);
  d.Signal(SIGTERM);
  p.Signal(SIGTERM);
  EXPECT_EQ(d.Wait(absl::Seconds(20)), 0) << d.Log();
  EXPECT_EQ(p.Wait(absl::Seconds(20)), 0) << p.Log();
}

}  // namespace
}  // namespace tandem::testing
