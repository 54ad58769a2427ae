// Workers SIGKILLed under load, on a cluster of real processes (fault_cluster.h: tandem-router,
// tandem-prefill and tandem-decode on loopback, KV over UCX shared memory, the real stories260K
// model):
// - a decode worker dies while several greedy streams run on it: the router migrates each one
//   (re-prefills prompt + tokens sent on a healthy pair and continues the stream), and every
//   request completes with exactly the tokens and text of a one-process greedy run
//   (`tandem generate`), each migration counted in the router's tandem_migrations_total;
// - the stream's decode worker dies while the only other one is dropped (stopped): the moving
//   stream waits for it to register again and completes identically;
// - a prefill worker dies while prefills run on it: the router releases their decode
//   reservations and retries on the other prefill worker; every request completes identically.
// - an expert rank of a decode group (--ep-size 2) dies mid-stream: its leader fails the steps
//   at once, deregisters, and the router migrates the streams; every request completes
//   identically, and the group serves again once the rank is back.
// After each, the surviving workers return to their idle baseline (nothing running or reserved,
// every KV block free, nothing in flight at the router). Prints the recovery time.
// The expert-parallel cases run a tiny random MoE model written here; the others skip without
// ../shared/models.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/fakes/sanitizer.h"
#include "tests/fakes/shell_util.h"
#include "tests/fakes/tiny_model.h"
#include "tests/fault/fault_cluster.h"
#include "tools/tandem/cluster.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
namespace v1 = tandem::v1;

constexpr int kCtx = 2048;

struct Reference {
  bool ok = false;
  std::string error;
  std::vector<int32_t> tokens;
  std::string text;
};

// `tandem generate --json` for a greedy request, in a process of its own.
Reference CliReference(const std::string& prompt, int max_tokens,
                       const std::string& model = FaultModelPath().string()) {
  Reference r;
  const fs::path out = fs::temp_directory_path() / absl::StrCat("tandem-kill-ref-", getpid(), "-",
                                                                std::hash<std::string>{}(prompt));
  std::string quoted = "'";
  for (char c : prompt) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  quoted += "'";
  const std::string cmd =
      absl::StrCat("timeout -k 5 60 ", TANDEM_BIN_DIR, "/tandem generate --model '",
                   model, "' --prompt ", quoted, " --max-tokens ", max_tokens,
                   " --temperature 0 --ignore-eos --threads 1 --ctx-size ", kCtx, " --json >",
                   out.string(), " 2>&1");
  const int st = std::system(cmd.c_str());
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  fs::remove(out);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    r.error = ss.str();
    return r;
  }
  try {
    const nlohmann::json j = nlohmann::json::parse(ss.str());
    r.tokens = j["tokens"].get<std::vector<int32_t>>();
    r.text = j["text"].get<std::string>();
    r.ok = true;
  } catch (const nlohmann::json::exception& e) {
    r.error = absl::StrCat(e.what(), ": ", ss.str());
  }
  return r;
}

// One streamed request, message by message (which worker sent it, and when).
struct Stream {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  bool finished = false;
  v1::FinishReason reason = v1::FINISH_REASON_UNSPECIFIED;
  v1::Usage usage;
  std::string prefill_worker;
  std::vector<std::string> decode_workers;  // of each message
  std::vector<absl::Time> arrivals;         // of each message
  std::atomic<int> seen{0};                 // tokens so far, for the test's main thread
  std::atomic<bool> done{false};
  std::mutex mu;  // guards decode_workers / arrivals while running
};

void RunStream(FaultCluster& cluster, const v1::GenerateRequest& req, Stream* s) {
  grpc::ClientContext cc;
  cc.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(60))));
  auto reader = cluster.inference().Generate(&cc, req);
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
    s->tokens.insert(s->tokens.end(), m.token_ids().begin(), m.token_ids().end());
    s->text += m.text();
    {
      std::lock_guard<std::mutex> l(s->mu);
      s->decode_workers.push_back(m.decode_worker());
      s->arrivals.push_back(absl::Now());
    }
    s->prefill_worker = m.prefill_worker();
    s->seen = static_cast<int>(s->tokens.size());
    if (m.finished()) {
      s->finished = true;
      s->reason = m.finish_reason();
      s->usage = m.usage();
    }
  }
  s->status = reader->Finish();
  s->done = true;
}

std::string CurrentDecodeWorker(Stream& s) {
  std::lock_guard<std::mutex> l(s.mu);
  return s.decode_workers.empty() ? std::string() : s.decode_workers.back();
}

// One greedy stream (ignore_eos) per prompt, each on a thread of its own.
class Streams {
 public:
  Streams(FaultCluster& cluster, const std::vector<std::string>& prompts, int tokens) {
    for (size_t i = 0; i < prompts.size(); ++i) all_.push_back(std::make_unique<Stream>());
    for (size_t i = 0; i < prompts.size(); ++i) {
      threads_.emplace_back([&cluster, req = GreedyRequest(prompts[i], tokens, true),
                             s = all_[i].get()] { RunStream(cluster, req, s); });
    }
  }
  ~Streams() { Join(); }
  void Join() {
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  // Every stream has `n` tokens or has ended, within `timeout`.
  bool WaitPast(int n, absl::Duration timeout, absl::Duration every = absl::Milliseconds(20)) {
    return WaitFor(timeout, [&] {
      return std::all_of(all_.begin(), all_.end(),
                         [n](const auto& s) { return s->seen >= n || s->done; });
    }, every);
  }
  Stream& operator[](size_t i) { return *all_[i]; }
  size_t size() const { return all_.size(); }

 private:
  std::vector<std::unique_ptr<Stream>> all_;
  std::vector<std::thread> threads_;
};

double RouterMetric(int metrics_port, const std::string& name) {
  const HttpResponse r = HttpCall(metrics_port, "GET", "/metrics");
  return r.status == 200 ? MetricValue(r.body, name) : -1;
}

class WorkerKillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(FaultModelPath())) {
      GTEST_SKIP() << "no real model at " << FaultModelPath() << " (../shared/models is absent)";
    }
  }
};

// With `speculative`, every worker runs --speculative ngram: migrated streams resume on the
// survivor, which speculates on their tokens so far, and still equal non-speculative generate.
void DecodeKillCase(bool speculative) {
  constexpr int kStreams = 6;
  constexpr int kTokens = 500;
  std::vector<std::string> prompts;
  std::vector<Reference> refs;
  for (int i = 0; i < kStreams; ++i) {
    prompts.push_back(
        absl::StrCat("Once upon a time, there was a little ",
                     std::vector<std::string>{"girl", "dog", "cat", "boy", "bird", "fish"}[i]));
    refs.push_back(CliReference(prompts.back(), kTokens));
    ASSERT_TRUE(refs.back().ok) << refs.back().error;
    ASSERT_EQ(refs.back().tokens.size(), static_cast<size_t>(kTokens));
  }
  const int metrics_port = FreePort();
  FaultClusterOptions o;
  o.name = speculative ? "decode-kill-spec" : "decode-kill";
  o.prefill = 1;
  o.decode = 2;
  o.ctx_size = kCtx;
  o.router_args = {"--metrics-port", std::to_string(metrics_port), "--max-migrations", "3"};
  o.decode_args = {"--quarantine-ms", "500"};
  if (speculative) {
    for (auto* args : {&o.prefill_args, &o.decode_args}) {
      args->insert(args->end(), {"--speculative", "ngram", "--spec-tokens", "4"});
    }
  }
  FaultCluster cluster(o);
  ASSERT_TRUE(cluster.Start().ok());
  ASSERT_EQ(RouterMetric(metrics_port, "tandem_migrations_total"), 0);

  Streams streams(cluster, prompts, kTokens);
  // Every stream decoding; then the victim dies with its streams mid-way.
  const bool all_started = streams.WaitPast(20, absl::Seconds(30));
  const std::string victim = "decode-0";
  std::vector<bool> on_victim(kStreams, false);
  for (int i = 0; i < kStreams; ++i) {
    on_victim[i] = !streams[i].done && CurrentDecodeWorker(streams[i]) == victim;
  }
  ChildProcess* proc = cluster.process(victim);
  ASSERT_NE(proc, nullptr);
  proc->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  EXPECT_GE(proc->Wait(Scaled(absl::Seconds(5))), 0);
  streams.Join();
  ASSERT_TRUE(all_started) << "the streams did not start in time";

  int expected_migrations = 0;
  std::vector<double> recovery_ms;
  for (int i = 0; i < kStreams; ++i) {
    Stream& s = streams[i];
    SCOPED_TRACE(absl::StrCat("stream ", i, " ('", prompts[i], "')"));
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_TRUE(s.finished);
    EXPECT_EQ(s.reason, v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(s.tokens, refs[i].tokens);  // no gap, no duplicate, same greedy choice
    EXPECT_EQ(s.text, refs[i].text);
    EXPECT_EQ(s.usage.completion_tokens(), kTokens);
    if (!on_victim[i]) {
      for (const std::string& w : s.decode_workers) EXPECT_EQ(w, "decode-1");
      continue;
    }
    ++expected_migrations;
    // The first message after the kill came from the survivor: the recovery time.
    bool recovered = false;
    for (size_t m = 0; m < s.arrivals.size(); ++m) {
      if (s.arrivals[m] > killed && s.decode_workers[m] == "decode-1") {
        recovery_ms.push_back(absl::ToDoubleMilliseconds(s.arrivals[m] - killed));
        recovered = true;
        break;
      }
    }
    EXPECT_TRUE(recovered) << "no message from decode-1 after the kill";
    EXPECT_EQ(s.decode_workers.back(), "decode-1");
  }
  ASSERT_GE(expected_migrations, 1) << "no stream was running on " << victim << " when it died";
  EXPECT_EQ(RouterMetric(metrics_port, "tandem_migrations_total"), expected_migrations);

  std::string why;
  EXPECT_TRUE(cluster.WaitIdle(absl::Seconds(20), &why, {"prefill-0", "decode-1"})) << why;
  double worst = 0, sum = 0;
  for (double ms : recovery_ms) {
    worst = std::max(worst, ms);
    sum += ms;
  }
  std::fprintf(stderr,
               "decode-0 SIGKILLed with %d of %d streams on it%s: all migrated to decode-1; "
               "recovery (kill -> next token) mean %.0f ms, recovery_ms=%.0f (worst)\n",
               expected_migrations, kStreams, speculative ? " (speculative ngram)" : "",
               recovery_ms.empty() ? 0 : sum / recovery_ms.size(), worst);
}

TEST_F(WorkerKillTest, SigkilledDecodeWorkerMidStreamEveryRequestCompletesIdentically) {
  DecodeKillCase(/*speculative=*/false);
}

TEST_F(WorkerKillTest, SigkilledSpeculativeDecodeWorkerMidStreamCompletesIdentically) {
  DecodeKillCase(/*speculative=*/true);
}

// The decode pool's only other worker was dropped by the router (it stopped answering) when the
// stream's worker dies: the moving stream waits for it to register again instead of failing.
TEST_F(WorkerKillTest, AMovingStreamWaitsForADroppedWorkerToRegisterAgain) {
  constexpr int kTokens = 400;
  const std::string prompt = "Once upon a time, there was a little girl";
  const Reference ref = CliReference(prompt, kTokens);
  ASSERT_TRUE(ref.ok) << ref.error;
  FaultClusterOptions o;
  o.name = "decode-regroup";
  o.prefill = 1;
  o.decode = 2;
  o.ctx_size = kCtx;
  o.lease_ms = 2000;
  o.decode_args = {"--quarantine-ms", "500"};
  FaultCluster cluster(o);
  ASSERT_TRUE(cluster.Start().ok());
  const auto registered = [&](const std::string& id) {
    auto workers = cluster.Workers();
    if (!workers.ok()) return false;
    for (const v1::WorkerInfo& w : *workers) {
      if (w.worker_id() == id) return true;
    }
    return false;
  };
  // decode-1 stops (SIGSTOP) until the router drops it; the stream then runs on decode-0.
  ChildProcess* standby = cluster.process("decode-1");
  ASSERT_NE(standby, nullptr);
  standby->Signal(SIGSTOP);
  ASSERT_TRUE(WaitFor(absl::Seconds(10), [&] { return !registered("decode-1"); }));
  Streams streams(cluster, {prompt}, kTokens);
  ASSERT_TRUE(streams.WaitPast(20, absl::Seconds(30)));
  ASSERT_FALSE(streams[0].done);
  ASSERT_EQ(CurrentDecodeWorker(streams[0]), "decode-0");
  // decode-0 dies: no decode worker is left to move the stream to. 600 ms later decode-1 runs
  // again, finds it is unknown at its next heartbeat and registers again.
  cluster.process("decode-0")->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  absl::SleepFor(absl::Milliseconds(600));
  standby->Signal(SIGCONT);
  streams.Join();
  Stream& s = streams[0];
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_TRUE(s.finished);
  EXPECT_EQ(s.tokens, ref.tokens);  // no gap, no duplicate
  EXPECT_EQ(s.text, ref.text);
  EXPECT_EQ(s.decode_workers.back(), "decode-1");
  for (size_t m = 0; m < s.arrivals.size(); ++m) {
    if (s.arrivals[m] > killed && s.decode_workers[m] == "decode-1") {
      std::fprintf(stderr, "decode-0 SIGKILLed, decode-1 back after 600 ms: recovery_ms=%.0f\n",
                   absl::ToDoubleMilliseconds(s.arrivals[m] - killed));
      break;
    }
  }
  std::string why;
  EXPECT_TRUE(cluster.WaitIdle(absl::Seconds(20), &why, {"prefill-0", "decode-1"})) << why;
}

TEST_F(WorkerKillTest, SigkilledPrefillWorkerMidPrefillRetriesOnAnotherAndLeaksNothing) {
  constexpr int kRequests = 4;
  constexpr int kTokens = 40;
  std::vector<std::string> prompts;
  std::vector<Reference> refs;
  for (int i = 0; i < kRequests; ++i) {
    std::string p = absl::StrCat("Story ", i, ":");
    for (int k = 0; k < 12; ++k) p += " Tom and Lily went to the park to play with a big red ball.";
    prompts.push_back(p);
    refs.push_back(CliReference(p, kTokens));
    ASSERT_TRUE(refs.back().ok) << refs.back().error;
  }
  FaultClusterOptions o;
  o.name = "prefill-kill";
  o.prefill = 2;
  o.decode = 1;
  o.ctx_size = kCtx;
  // Slow, chunked prefills: each prompt takes many delayed steps, so the kill lands while
  // prefills (and their layer-by-layer KV writes into decode's blocks) are under way.
  o.prefill_args = {"--test-step-delay-ms", "40", "--max-batch-tokens", "32"};
  o.decode_args = {"--quarantine-ms", "500"};
  FaultCluster cluster(o);
  ASSERT_TRUE(cluster.Start().ok());

  Streams streams(cluster, prompts, kTokens);
  const std::string victim = "prefill-0";
  // Kill once the router has prefills in flight on the victim.
  int inflight = 0;
  const bool busy = WaitFor(
      absl::Seconds(20),
      [&] {
        absl::StatusOr<std::vector<v1::WorkerInfo>> ws = cluster.Workers();
        if (!ws.ok()) return false;
        for (const v1::WorkerInfo& w : *ws) {
          if (w.worker_id() == victim) inflight = w.router_inflight();
        }
        return inflight > 0;
      },
      absl::Milliseconds(5));
  absl::SleepFor(absl::Milliseconds(60));  // into the prefill, past its first chunks
  ChildProcess* proc = cluster.process(victim);
  ASSERT_NE(proc, nullptr);
  proc->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  EXPECT_GE(proc->Wait(Scaled(absl::Seconds(5))), 0);
  streams.Join();
  ASSERT_TRUE(busy) << "no prefill ever ran on " << victim;

  absl::Time last_done = killed;
  for (int i = 0; i < kRequests; ++i) {
    Stream& s = streams[i];
    SCOPED_TRACE(absl::StrCat("request ", i));
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_TRUE(s.finished);
    EXPECT_EQ(s.tokens, refs[i].tokens);
    EXPECT_EQ(s.text, refs[i].text);
    EXPECT_EQ(s.usage.completion_tokens(), kTokens);
    if (!s.arrivals.empty()) last_done = std::max(last_done, s.arrivals.back());
  }
  // decode-0's reservations written by the dead worker were released (quarantined, then
  // freed); nothing leaks on either survivor.
  std::string why;
  EXPECT_TRUE(cluster.WaitIdle(absl::Seconds(20), &why, {"prefill-1", "decode-0"})) << why;
  std::fprintf(stderr,
               "prefill-0 SIGKILLed with %d prefills in flight: every request completed on "
               "prefill-1; recovery_ms=%.0f (kill -> the last request done)\n",
               inflight, absl::ToDoubleMilliseconds(last_done - killed));
}

// A decode worker whose engine wedges mid-stream (its test twin blocks the engine thread for
// good after 40 steps): within --stall-ms its watchdog reports NOT_SERVING on "" and on the
// "liveness" health service the chart's liveness probe asks, and it deregisters. The kubelet
// would then restart the pod; here the test kills it as that restart does, and its streams
// migrate and complete with the one-process tokens.
TEST_F(WorkerKillTest, WedgedDecodeEngineGoesNotServingAndItsStreamsMigrateOnRestart) {
  constexpr int kStreams = 2;
  constexpr int kTokens = 300;
  std::vector<std::string> prompts;
  std::vector<Reference> refs;
  for (int i = 0; i < kStreams; ++i) {
    prompts.push_back(absl::StrCat("Once upon a time, a ", i == 0 ? "fox" : "bear"));
    refs.push_back(CliReference(prompts.back(), kTokens));
    ASSERT_TRUE(refs.back().ok) << refs.back().error;
  }
  FaultClusterOptions o;
  o.name = "wedge";
  o.prefill = 1;
  o.decode = 2;
  o.ctx_size = kCtx;
  o.router_args = {"--max-migrations", "3"};
  o.decode_args = {"--stall-ms", "1000"};
  o.worker_args["decode-0"] = {"--test-wedge-after-steps", "40"};
  FaultCluster cluster(o);
  absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  const std::string victim = "decode-0";
  const std::string address = absl::StrCat("127.0.0.1:", cluster.port(victim));
  auto health = [&](const std::string& service) {
    absl::StatusOr<bool> h = tools::CheckHealth(address, absl::Seconds(1), service);
    return h.ok() && *h;
  };
  ASSERT_TRUE(health("") && health("liveness"));

  Streams streams(cluster, prompts, kTokens);
  // The victim's engine wedges after its 40th step; its streams stop.
  const absl::Time t0 = absl::Now();
  const bool not_serving =
      WaitFor(absl::Seconds(30), [&] { return !health("liveness"); }, absl::Milliseconds(50));
  const absl::Time detected = absl::Now();
  ASSERT_TRUE(not_serving) << victim << "'s liveness never went NOT_SERVING";
  EXPECT_FALSE(health(""));
  EXPECT_TRUE(WaitFor(absl::Seconds(3), [&] { return !cluster.Registered(victim); }))
      << victim << " still registered while wedged";
  int on_victim = 0;
  for (size_t i = 0; i < streams.size(); ++i) {
    on_victim += !streams[i].done && CurrentDecodeWorker(streams[i]) == victim ? 1 : 0;
  }
  // What the kubelet does once the liveness probe fails: restart the pod.
  ChildProcess* proc = cluster.process(victim);
  ASSERT_NE(proc, nullptr);
  proc->Signal(SIGKILL);
  EXPECT_GE(proc->Wait(Scaled(absl::Seconds(5))), 0);
  streams.Join();
  for (int i = 0; i < kStreams; ++i) {
    Stream& s = streams[i];
    SCOPED_TRACE(absl::StrCat("stream ", i));
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_EQ(s.tokens, refs[i].tokens);
    EXPECT_EQ(s.text, refs[i].text);
  }
  EXPECT_GE(on_victim, 1) << "no stream was on " << victim << " when it wedged";
  std::string why;
  EXPECT_TRUE(cluster.WaitIdle(absl::Seconds(20), &why, {"prefill-0", "decode-1"})) << why;
  std::fprintf(stderr,
               "%s wedged with %d of %d streams on it: NOT_SERVING (liveness) %.0f ms after the "
               "streams started (--stall-ms 1000); all migrated after its restart\n",
               victim.c_str(), on_victim, kStreams, absl::ToDoubleMilliseconds(detected - t0));
}

// Expert parallelism: a tiny random qwen3moe model (4 layers, 8 experts, top 2), each worker a
// group of two processes, rank 1 holding experts 4-7.
class ExpertGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TinyModelOptions o;
    o.arch = "qwen3moe";
    o.n_layer = 4;
    o.n_embd = 128;
    o.n_ff = 128;
    o.n_expert = 8;
    o.n_expert_used = 2;
    o.n_ctx = kCtx;
    model_ = (fs::temp_directory_path() / absl::StrCat("tandem-ep-", getpid(), ".gguf")).string();
    ASSERT_TRUE(WriteTinyModel(o, model_).ok());
  }
  void TearDown() override { fs::remove(model_); }

  FaultClusterOptions Options(const std::string& name) const {
    FaultClusterOptions o;
    o.name = name;
    o.model = model_;
    o.ctx_size = kCtx;
    return o;
  }

  std::string model_;
};

// EP=2 gives the tokens of one process (`tandem generate`), through the cluster (prefill and
// decode each a group of two) and on a colocated worker (one group prefills and decodes), with
// contiguous experts and with an interleaved --expert-placement file.
TEST_F(ExpertGroupTest, TwoRankGroupsGiveTheTokensOfOneProcess) {
  const std::vector<std::string> prompts = {"Once upon a time", "The knight said"};
  std::vector<Reference> refs;
  for (const std::string& p : prompts) {
    refs.push_back(CliReference(p, 40, model_));
    ASSERT_TRUE(refs.back().ok) << refs.back().error;
  }
  // A placement file (`tandem place-experts`' format): even experts on rank 0, odd on rank 1.
  nlohmann::json layers = nlohmann::json::array();
  for (int l = 0; l < 4; ++l) layers.push_back({{0, 2, 4, 6}, {1, 3, 5, 7}});
  const std::string placement = model_ + ".placement.json";
  std::ofstream(placement) << nlohmann::json{{"ranks", 2}, {"n_expert", 8}, {"layers", layers}};
  for (const std::string shape : {"disaggregated", "colocated", "placed"}) {
    SCOPED_TRACE(shape);
    FaultClusterOptions o = Options("ep-" + shape);
    if (shape == "disaggregated") {
      o.prefill_ep = 2;
    } else {
      o.prefill = 0;
      o.decode_role = "both";
    }
    if (shape == "placed") o.decode_args = {"--expert-placement", placement};
    o.decode_ep = 2;
    FaultCluster cluster(o);
    absl::Status st = cluster.Start();
    ASSERT_TRUE(st.ok()) << st;
    for (size_t i = 0; i < prompts.size(); ++i) {
      Stream s;
      RunStream(cluster, GreedyRequest(prompts[i], 40, /*ignore_eos=*/true), &s);
      ASSERT_TRUE(s.status.ok()) << s.status.error_message();
      EXPECT_EQ(s.tokens, refs[i].tokens) << prompts[i];
      EXPECT_EQ(s.text, refs[i].text);
      for (const std::string& w : s.decode_workers) EXPECT_EQ(w, "decode-0");
    }
    // The rank holds what the placement gives it.
    const std::string rank_log = Slurp(cluster.dir() / "decode-0-ep1.log");
    EXPECT_NE(rank_log.find(shape == "placed" ? "experts 1,3,5,7 of layer 0"
                                              : "experts 4,5,6,7 of layer 0"),
              std::string::npos)
        << rank_log;
  }
  fs::remove(placement);
}

// SIGKILL the expert rank of the decode group the streams run on: its leader fails them at
// the next step (UNAVAILABLE, no wait for a deadline), the router migrates each to the other
// group, and every request completes with the one-process tokens. The leader stays up,
// deregisters while its group is incomplete, leaks no KV block, and registers again once the
// rank is restarted.
TEST_F(ExpertGroupTest, SigkilledExpertRankMidStreamRequestsMigrateAndTheGroupRecovers) {
  constexpr int kStreams = 4;
  constexpr int kTokens = 600;
  std::vector<std::string> prompts;
  std::vector<Reference> refs;
  for (int i = 0; i < kStreams; ++i) {
    prompts.push_back(absl::StrCat("Stream ", i, ": once upon a time"));
    refs.push_back(CliReference(prompts.back(), kTokens, model_));
    ASSERT_TRUE(refs.back().ok) << refs.back().error;
  }
  const int metrics_port = FreePort();
  FaultClusterOptions o = Options("ep-kill");
  o.decode = 2;
  o.decode_ep = 2;
  o.router_args = {"--metrics-port", std::to_string(metrics_port), "--max-migrations", "3"};
  o.decode_args = {"--quarantine-ms", "500", "--ep-timeout-ms", "5000"};
  FaultCluster cluster(o);
  absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;

  Streams streams(cluster, prompts, kTokens);
  const bool all_started = streams.WaitPast(20, absl::Seconds(30), absl::Milliseconds(2));
  const std::string leader = "decode-0", victim = "decode-0-ep1";
  std::vector<bool> on_victim(kStreams, false);
  for (int i = 0; i < kStreams; ++i) {
    on_victim[i] = !streams[i].done && CurrentDecodeWorker(streams[i]) == leader;
  }
  ChildProcess* proc = cluster.process(victim);
  ASSERT_NE(proc, nullptr);
  proc->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  EXPECT_GE(proc->Wait(Scaled(absl::Seconds(5))), 0);
  // The leader deregisters promptly (it saw the rank's Join stream close).
  EXPECT_TRUE(WaitFor(absl::Seconds(3), [&] { return !cluster.Registered(leader); }))
      << leader << " still registered after its expert rank died";
  streams.Join();
  ASSERT_TRUE(all_started) << "the streams did not start in time";

  int expected = 0;
  double worst_ms = 0;
  for (int i = 0; i < kStreams; ++i) {
    Stream& s = streams[i];
    SCOPED_TRACE(absl::StrCat("stream ", i));
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_TRUE(s.finished);
    EXPECT_EQ(s.tokens, refs[i].tokens);  // no gap, no duplicate, same greedy choice
    EXPECT_EQ(s.text, refs[i].text);
    EXPECT_EQ(s.usage.completion_tokens(), kTokens);
    if (!on_victim[i]) continue;
    ++expected;
    EXPECT_EQ(s.decode_workers.back(), "decode-1");
    for (size_t m = 0; m < s.arrivals.size(); ++m) {
      if (s.arrivals[m] > killed && s.decode_workers[m] == "decode-1") {
        worst_ms = std::max(worst_ms, absl::ToDoubleMilliseconds(s.arrivals[m] - killed));
        break;
      }
    }
  }
  ASSERT_GE(expected, 1) << "no stream was running on " << leader << " when its rank died";
  EXPECT_GE(RouterMetric(metrics_port, "tandem_migrations_total"), expected);
  EXPECT_TRUE(ProcessRunning(cluster.pid(leader))) << "the leader exited with its rank";

  // Nothing leaks on the leader: its failed sequences freed their blocks.
  std::string why;
  EXPECT_TRUE(cluster.WaitIdle(absl::Seconds(20), &why, {"prefill-0", "decode-0", "decode-1"}))
      << why;
  // The rank comes back: the group is whole and serves again.
  absl::Status again = cluster.RestartExpertRank(victim);
  ASSERT_TRUE(again.ok()) << again;
  EXPECT_TRUE(WaitFor(absl::Seconds(20), [&] { return cluster.Registered(leader); }))
      << leader << " did not register again once its rank was back";
  std::fprintf(stderr,
               "%s SIGKILLed with %d of %d streams on its group: all migrated to decode-1; "
               "recovery_ms=%.0f (kill -> first token from decode-1, worst)\n",
               victim.c_str(), expected, kStreams, worst_ms);
}

}  // namespace
}  // namespace tandem::testing
