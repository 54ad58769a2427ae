// Scaling a decode pool down under load, the way Kubernetes does it: SIGTERM to a real
// tandem-decode process of a `tandem cluster up` cluster (1 prefill, 2 decode, the real
// stories260K model) while several long streams run on it and new requests keep arriving.
// The worker must deregister, finish every stream it holds and exit well within its grace
// (--grace-ms); no request may fail, and none that starts after the router dropped the worker
// may be sent to it. Skips without ../shared/models.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/v1/inference.grpc.pb.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "tests/fakes/shell_util.h"

namespace {

using ::tandem::testing::Slurp;

namespace fs = std::filesystem;
namespace v1 = tandem::v1;

const fs::path kModel = fs::path(TANDEM_SHARED_MODELS_DIR) / "stories260K" / "stories260K.gguf";
const std::string kBin = TANDEM_BIN_DIR;
constexpr int kCtx = 4096;
// The drain lasts as long as the streams still decoding on the worker: 2200 tokens took 9.6 to
// 15 s beside the short-request load on a loaded 2-core machine, so the grace leaves twice that.
constexpr int kGraceMs = 30000;
// Long enough that every stream is still decoding when the signal lands (1200 tokens once
// ended first on a loaded machine, after attention got faster).
constexpr int kLongTokens = 2200;
constexpr int kStreams = 6;

// Runs the tandem CLI, killed after `timeout_s`; returns its exit code, output in *out.
int RunTandem(const std::string& args, std::string* out, int timeout_s = 120) {
  const fs::path log = fs::temp_directory_path() / absl::StrCat("tandem-drain-test-", getpid());
  const std::string cmd = absl::StrCat("timeout -k 5 ", timeout_s, " ", kBin, "/tandem ", args,
                                       " >", log.string(), " 2>&1");
  const int st = std::system(cmd.c_str());
  *out = Slurp(log);
  fs::remove(log);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// Alive and not a zombie (an orphaned worker may wait unreaped under a non-reaping init).
bool ProcessRunning(pid_t pid) {
  if (kill(pid, 0) != 0) return false;
  const std::string stat = Slurp(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

template <typename Pred>
bool WaitFor(absl::Duration timeout, Pred pred) {
  for (const absl::Time end = absl::Now() + timeout;; absl::SleepFor(absl::Milliseconds(10))) {
    if (pred()) return true;
    if (absl::Now() >= end) return false;
  }
}

struct Stream {
  grpc::Status status;
  int tokens = 0;
  bool finished = false;
  v1::FinishReason reason = v1::FINISH_REASON_UNSPECIFIED;
  std::string decode_worker;
  absl::Time started;
  std::atomic<bool> first_token{false};
  std::atomic<bool> done{false};
};

v1::GenerateRequest Request(const std::string& prompt, int max_tokens) {
  v1::GenerateRequest req;
  req.set_text(prompt);
  req.mutable_sampling()->set_temperature(0);
  req.mutable_sampling()->set_max_tokens(max_tokens);
  req.mutable_sampling()->set_ignore_eos(true);
  return req;
}

void RunStream(v1::Inference::Stub& stub, const v1::GenerateRequest& req, Stream* s) {
  grpc::ClientContext cc;
  cc.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  s->started = absl::Now();
  auto reader = stub.Generate(&cc, req);
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
    s->tokens += m.token_ids_size();
    // Written once, before first_token is raised: other threads read it after seeing that.
    if (s->decode_worker.empty()) s->decode_worker = m.decode_worker();
    s->first_token = true;
    if (m.finished()) {
      s->finished = true;
      s->reason = m.finish_reason();
    }
  }
  s->status = reader->Finish();
  s->done = true;
}

class DrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kModel)) {
      GTEST_SKIP() << "no real model at " << kModel << " (../shared/models is absent)";
    }
    for (const char* b : {"tandem", "tandem-router", "tandem-prefill", "tandem-decode"}) {
      ASSERT_TRUE(fs::exists(fs::path(kBin) / b)) << b << " is not built in " << kBin;
    }
    dir_ = fs::temp_directory_path() / absl::StrCat("tandem-drain-", getpid());
    fs::remove_all(dir_);
  }

  void TearDown() override {
    if (dir_.empty() || !fs::exists(dir_)) return;
    std::string out;
    EXPECT_EQ(RunTandem(absl::StrCat("cluster down --grace-ms 5000 --dir ", dir_.string()), &out,
                        60),
              0)
        << out;
    if (HasFailure()) {
      for (const auto& e : fs::directory_iterator(dir_)) {
        if (e.path().extension() != ".log") continue;
        std::string log = Slurp(e.path());
        if (log.size() > 3000) log = "..." + log.substr(log.size() - 3000);
        std::fprintf(stderr, "==== %s ====\n%s\n", e.path().c_str(), log.c_str());
      }
    } else {
      fs::remove_all(dir_);
    }
  }

  fs::path dir_;
};

TEST_F(DrainTest, SigtermedDecodeWorkerFinishesItsStreamsAndGetsNoNewRequests) {
  std::string out;
  ASSERT_EQ(RunTandem(absl::StrCat("cluster up --model ", kModel.string(),
                                   " --prefill 1 --decode 2 --dir ", dir_.string(),
                                   " --router-port 0 --http-port 0 --threads 1 --transport ucx",
                                   " --ucx-tls shm --ctx-size ", kCtx,
                                   // The drained worker deregisters itself; the lease only
                                   // covers heartbeats, which a loaded CI machine once
                                   // delayed past 2 s.
                                   " --lease-ms 5000 --worker-arg=--grace-ms=", kGraceMs),
                      &out, 90),
            0)
      << out;
  const nlohmann::json state = nlohmann::json::parse(Slurp(dir_ / "cluster.json"));
  auto channel = grpc::CreateChannel(state["router"].get<std::string>(),
                                     grpc::InsecureChannelCredentials());
  auto inference = v1::Inference::NewStub(channel);
  auto registry = v1::Registry::NewStub(channel);
  auto registered = [&](const std::string& id) {
    grpc::ClientContext cc;
    cc.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ListWorkersResponse resp;
    EXPECT_TRUE(registry->ListWorkers(&cc, v1::ListWorkersRequest(), &resp).ok());
    for (const v1::WorkerInfo& w : resp.workers()) {
      if (w.worker_id() == id) return true;
    }
    return false;
  };

  // Several long streams; least-load spreads them over both decode workers.
  std::vector<Stream> streams(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      RunStream(*inference, Request(absl::StrCat("Once upon a time, story ", i), kLongTokens),
          &streams[i]);
    });
  }
  ASSERT_TRUE(WaitFor(absl::Seconds(20), [&] {
    for (const Stream& s : streams) {
      if (!s.first_token && !s.done) return false;
    }
    return true;
  }));
  const std::string victim = "decode-0";
  int on_victim = 0;
  for (const Stream& s : streams) on_victim += s.first_token && s.decode_worker == victim && !s.done;
  ASSERT_GE(on_victim, 1) << "no stream is running on " << victim;

  // Short requests keep arriving from two clients all through the drain.
  std::atomic<bool> stop_load{false};
  std::mutex load_mu;
  std::vector<std::unique_ptr<Stream>> load;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int n = 0; !stop_load; ++n) {
        auto s = std::make_unique<Stream>();
        RunStream(*inference, Request(absl::StrCat("Lily had a ball ", t, " ", n), 24), s.get());
        std::lock_guard<std::mutex> l(load_mu);
        load.push_back(std::move(s));
      }
    });
  }

  const pid_t pid = std::stoi(Slurp(dir_ / (victim + ".pid")));
  ASSERT_TRUE(ProcessRunning(pid));
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  ASSERT_TRUE(WaitFor(absl::Seconds(5), [&] { return !registered(victim); }))
      << victim << " is still registered 5 s after SIGTERM";
  const absl::Time dropped = absl::Now();
  int still_running = 0;
  for (const Stream& s : streams) still_running += s.first_token && s.decode_worker == victim && !s.done;

  const bool exited =
      WaitFor(absl::Milliseconds(kGraceMs), [&] { return !ProcessRunning(pid); });
  const absl::Duration exit_after = absl::Now() - signalled;
  // Let the load run a little past the exit, on the survivor alone.
  absl::SleepFor(absl::Milliseconds(300));
  stop_load = true;
  for (std::thread& t : threads) t.join();

  EXPECT_TRUE(exited) << victim << " still runs " << kGraceMs << " ms after SIGTERM";
  EXPECT_GE(still_running, 1) << "the streams ended before the router dropped " << victim
                              << ": make them longer";
  for (int i = 0; i < kStreams; ++i) {
    SCOPED_TRACE(absl::StrCat("stream ", i, " on ", streams[i].decode_worker));
    EXPECT_TRUE(streams[i].status.ok()) << streams[i].status.error_message();
    EXPECT_TRUE(streams[i].finished);
    EXPECT_EQ(streams[i].reason, v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(streams[i].tokens, kLongTokens);
  }
  int after_drop = 0;
  for (const auto& s : load) {
    SCOPED_TRACE(absl::StrCat("short request on ", s->decode_worker));
    EXPECT_TRUE(s->status.ok()) << s->status.error_message();
    EXPECT_EQ(s->tokens, 24);
    if (s->started > dropped) {
      ++after_drop;
      EXPECT_EQ(s->decode_worker, "decode-1") << "a request sent after the drop went to " << victim;
    }
  }
  EXPECT_GE(after_drop, 3) << "too few requests arrived during the drain to tell";

  // The worker's own account: it drained, within its grace.
  const std::string log = Slurp(dir_ / (victim + ".log"));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex("drained in ([0-9]+) ms"))) << log;
  EXPECT_LT(std::stoi(m[1]), kGraceMs);
  std::fprintf(stderr, "%s: %d streams finished during its drain; exited %.0f ms after SIGTERM; "
               "%zu short requests, %d after the drop\n",
               victim.c_str(), still_running, absl::ToDoubleMilliseconds(exit_after), load.size(),
               after_drop);
}

}  // namespace
