// Request migration through the real router and real workers in one process: a RouterServer in
// front of TestClusters (cluster_fixture.h: real gRPC servers on loopback, KV over the
// in-process transport, the real stories260K model). The decode worker serving a request is
// stopped mid-stream at an exact token (its engine loop is held at a gate while its server
// shuts down); the router must move the request to another worker and the client must get
// exactly the tokens and text one unbroken engine::Scheduler run gives, with one migration
// counted. Skips without ../shared/models.
#include <algorithm>
#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "services/common/grpc_status.h"
#include "services/router/router_server.h"
#include "tests/component/services/cluster_fixture.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;

const fs::path kModelPath = fs::path(TANDEM_SHARED_MODELS_DIR) / "stories260K" / "stories260K.gguf";
constexpr int kPromptTokens = 20;
constexpr int kMaxTokens = 120;
// Tokens the first decode worker produces before it is stopped: the first (sampled by prefill)
// plus this many steps.
constexpr int kStepsBeforeKill = 15;
constexpr char kRequestId[] = "migrating";

// One engine::Scheduler run, with the text each token completed (for choosing a stop string
// that straddles the break).
struct Reference {
  std::vector<int32_t> tokens;
  std::vector<std::string> pieces;
  std::string text;
  engine::FinishReason reason = engine::FinishReason::kNone;
};
Reference RunReference(std::shared_ptr<const engine::Model> model,
                       const std::vector<int32_t>& prompt, const engine::SamplingParams& sp) {
  Reference r;
  auto e = engine::Engine::Create(std::move(model), TestEngineOptions(64, kernels::DType::kF32));
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return r;
  engine::Scheduler s(e->get());
  engine::GenerationRequest g;
  g.id = "reference";
  g.prompt = prompt;
  g.sampling = sp;
  g.on_event = [&](const engine::TokenEvent& ev) {
    if (ev.token >= 0) r.tokens.push_back(ev.token);
    r.pieces.push_back(ev.text);
    r.text += ev.text;
    if (ev.finished) r.reason = ev.reason;
  };
  EXPECT_TRUE(s.Submit(std::move(g)).ok());
  EXPECT_TRUE(s.RunUntilIdle().ok());
  return r;
}

// Holds a decode worker's engine loop before step n+1 until released, so the worker has
// produced exactly n tokens (n + 1 with the prefill's first) when the test stops it.
struct Gate {
  std::atomic<int> steps{0};
  int limit = 1 << 30;
  absl::Notification reached, release;
  void BeforeStep() {
    if (++steps > limit) {
      if (!reached.HasBeenNotified()) reached.Notify();
      release.WaitForNotification();
    }
  }
};

struct Outcome {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  v1::FinishReason reason = v1::FINISH_REASON_UNSPECIFIED;
  v1::Usage usage;
  int finished_messages = 0;
  int prompt_echoes = 0;  // messages carrying prompt_token_ids (must be exactly the first)
};

class MigrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = LoadTestModel("stories260K");
    if (model_ == nullptr || !fs::exists(kModelPath)) {
      GTEST_SKIP() << "stories260K is not available here (../shared/models is absent)";
    }
    StartRouter(router::RouterOptions().max_migrations);
  }
  void StartRouter(int max_migrations) {
    if (router_ != nullptr) router_->Shutdown(absl::ZeroDuration());
    router::RouterOptions o;
    o.max_migrations = max_migrations;
    o.model_path = kModelPath.string();
    o.host = "127.0.0.1";
    o.port = 0;
    o.ctx_size = 256;                    // as TestEngineOptions
    o.worker_lease = absl::Seconds(60);  // no heartbeats here: registrations must outlive the test
    o.default_timeout = absl::Seconds(60);
    o.retry_budget = absl::Seconds(2);
    auto r = router::RouterServer::Create(o);
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = std::move(*r);
    inference_ = v1::Inference::NewStub(
        grpc::CreateChannel(router_->address(), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (router_ != nullptr) router_->Shutdown(absl::ZeroDuration());
  }

  void Register(const std::string& id, v1::WorkerRole role, const std::string& address,
                int kv_blocks) {
    v1::RegisterRequest rq;
    rq.set_worker_id(id);
    rq.set_role(role);
    rq.set_address(address);
    rq.set_model(kModelPath.string());
    rq.set_kv_blocks_total(kv_blocks);
    ASSERT_TRUE(router_->registry().Register(rq).ok());
  }

  // Streams one greedy request; once `kill_after` tokens have arrived, calls on_kill (once).
  Outcome Run(const std::vector<int32_t>& prompt, const engine::SamplingParams& sp, int kill_after,
              const std::function<void()>& on_kill) {
    v1::GenerateRequest req;
    req.set_request_id(kRequestId);
    req.mutable_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
    v1::SamplingParams* s = req.mutable_sampling();
    s->set_temperature(0);
    s->set_max_tokens(sp.max_tokens);
    s->set_ignore_eos(sp.ignore_eos);
    for (const std::string& stop : sp.stop_strings) s->add_stop(stop);
    grpc::ClientContext cc;
    cc.set_deadline(services::ToChronoDeadline(absl::Now() + absl::Seconds(20)));
    auto reader = inference_->Generate(&cc, req);
    Outcome out;
    bool killed = false;
    v1::GenerateResponse m;
    while (reader->Read(&m)) {
      out.tokens.insert(out.tokens.end(), m.token_ids().begin(), m.token_ids().end());
      out.text += m.text();
      if (m.prompt_token_ids_size() > 0) ++out.prompt_echoes;
      if (m.finished()) {
        ++out.finished_messages;
        out.reason = m.finish_reason();
        out.usage = m.usage();
      }
      if (!killed && static_cast<int>(out.tokens.size()) >= kill_after) {
        killed = true;
        on_kill();
      }
    }
    out.status = reader->Finish();
    EXPECT_TRUE(killed) << "the stream ended before the kill point";
    return out;
  }

  double MigrationsMetric() {
    const std::string text = router_->metrics().Render();
    const std::string key = "tandem_migrations_total{";
    for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + 1)) {
      const size_t eol = text.find('\n', at);
      const std::string line = text.substr(at, eol - at);
      if (line.find("role=\"router\"") == std::string::npos) continue;
      return std::stod(line.substr(line.rfind(' ') + 1));
    }
    return -1;
  }

  // A scenario: worker A (gated) serves the request until it has sent 1 + kStepsBeforeKill
  // tokens; then B registers, A's server stops, and the request must finish on B.
  // colocated: both decode workers register as BOTH and prefill locally.
  // How A stops: its server goes (the stream is cut: UNAVAILABLE), or A cancels the request
  // itself (a final CANCELLED message the client never asked for, as on a worker's shutdown).
  enum class Stop { kServer, kWorkerCancel };
  Outcome KillMidStream(bool colocated, const engine::SamplingParams& sp,
                        Stop how = Stop::kServer) {
    auto gate = std::make_shared<Gate>();
    gate->limit = kStepsBeforeKill;
    ClusterOptions ao;
    ao.before_step = [gate] { gate->BeforeStep(); };
    a_ = std::make_unique<TestCluster>(model_, ao);
    b_ = std::make_unique<TestCluster>(model_);
    const v1::WorkerRole decode_role = colocated ? v1::WORKER_ROLE_BOTH : v1::WORKER_ROLE_DECODE;
    if (!colocated) {
      Register("prefill-a", v1::WORKER_ROLE_PREFILL, a_->prefill_server->address(),
               a_->prefill->kv_blocks_total());
    }
    Register("decode-a", decode_role, a_->decode_server->address(), a_->decode->kv_blocks_total());
    std::thread stopper;
    // Disaggregated, the first token comes from prefill; colocated, from A's first step.
    const int kill_after = colocated ? kStepsBeforeKill : 1 + kStepsBeforeKill;
    Outcome out = Run(TestPrompt(kPromptTokens, 7), sp, kill_after, [&] {
      Register("decode-b", decode_role, b_->decode_server->address(),
               b_->decode->kv_blocks_total());
      // Shutdown waits for A's Decode handler, which waits for A's engine thread (held at
      // the gate): release the gate once the server has cut the stream.
      stopper = std::thread([this, how] {
        if (how == Stop::kServer) {
          a_->decode_server->Shutdown(absl::ZeroDuration());
        } else {
          EXPECT_TRUE(a_->decode->Cancel(kRequestId));
        }
      });
      absl::SleepFor(absl::Milliseconds(100));
      gate->release.Notify();
    });
    if (!gate->release.HasBeenNotified()) gate->release.Notify();  // the kill never came
    if (stopper.joinable()) stopper.join();
    EXPECT_TRUE(gate->reached.HasBeenNotified());
    return out;
  }

  // Both decode pools (A's worker is still alive, only its server stopped) at rest.
  void ExpectPoolsAtRest() {
    for (TestCluster* c : {a_.get(), b_.get()}) {
      const absl::Time end = absl::Now() + absl::Seconds(10);
      v1::WorkerStats s;
      for (;;) {
        s = c->decode->Stats();
        if (s.running() == 0 && s.reservations() == 0 &&
            s.kv_blocks_free() == s.kv_blocks_total()) {
          break;
        }
        if (absl::Now() > end) break;
        absl::SleepFor(absl::Milliseconds(10));
      }
      EXPECT_EQ(s.running(), 0) << s.ShortDebugString();
      EXPECT_EQ(s.reservations(), 0) << s.ShortDebugString();
      EXPECT_EQ(s.kv_blocks_free(), s.kv_blocks_total()) << s.ShortDebugString();
    }
  }

  std::shared_ptr<const engine::Model> model_;
  std::unique_ptr<router::RouterServer> router_;
  std::unique_ptr<v1::Inference::Stub> inference_;
  std::unique_ptr<TestCluster> a_, b_;
};

TEST_F(MigrationTest, DisaggregatedStreamMovesToAnotherDecodeWorkerWithIdenticalTokens) {
  const engine::SamplingParams sp = Greedy(kMaxTokens);
  const Reference ref = RunReference(model_, TestPrompt(kPromptTokens, 7), sp);
  ASSERT_EQ(ref.tokens.size(), static_cast<size_t>(kMaxTokens));
  const Outcome out = KillMidStream(/*colocated=*/false, sp);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.tokens, ref.tokens);  // no gap, no duplicate
  EXPECT_EQ(out.text, ref.text);
  EXPECT_EQ(out.reason, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(out.finished_messages, 1);
  EXPECT_EQ(out.prompt_echoes, 1);
  EXPECT_EQ(out.usage.prompt_tokens(), kPromptTokens);
  EXPECT_EQ(out.usage.completion_tokens(), kMaxTokens);
  EXPECT_EQ(router_->inference().migrations(), 1u);
  EXPECT_EQ(MigrationsMetric(), 1);
  // B decoded the rest: its prompt was the original plus the tokens already sent.
  ExpectPoolsAtRest();
}

TEST_F(MigrationTest, ColocatedStreamMovesToAnotherWorkerWithIdenticalTokens) {
  const engine::SamplingParams sp = Greedy(kMaxTokens);
  const Reference ref = RunReference(model_, TestPrompt(kPromptTokens, 7), sp);
  const Outcome out = KillMidStream(/*colocated=*/true, sp);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.tokens, ref.tokens);
  EXPECT_EQ(out.text, ref.text);
  EXPECT_EQ(out.reason, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(out.usage.completion_tokens(), kMaxTokens);
  EXPECT_EQ(router_->inference().migrations(), 1u);
  EXPECT_EQ(MigrationsMetric(), 1);
  ExpectPoolsAtRest();
}

// A stop string that begins in text A had held back (it might be the stop string) and ends in
// text B produces: the router must neither lose the held text nor miss the stop.
TEST_F(MigrationTest, StopStringAcrossTheBreakEndsTheRequestWhereOneRunWould) {
  const std::vector<int32_t> prompt = TestPrompt(kPromptTokens, 7);
  const Reference plain = RunReference(model_, prompt, Greedy(kMaxTokens));
  // The text A has produced when it stops, then a stop string from 3 bytes before that point,
  // whose first occurrence is there.
  size_t boundary = 0;
  for (int i = 0; i <= kStepsBeforeKill; ++i) boundary += plain.pieces[i].size();
  ASSERT_GT(boundary, 3u);
  std::string stop;
  for (size_t len = 6; len < 16 && boundary - 3 + len <= plain.text.size(); ++len) {
    const std::string s = plain.text.substr(boundary - 3, len);
    if (plain.text.find(s) == boundary - 3) {
      stop = s;
      break;
    }
  }
  ASSERT_FALSE(stop.empty()) << "no unique stop string around byte " << boundary;
  engine::SamplingParams sp = Greedy(kMaxTokens);
  sp.stop_strings = {stop};
  const Reference ref = RunReference(model_, prompt, sp);
  ASSERT_EQ(ref.reason, engine::FinishReason::kStop);
  ASSERT_GT(ref.tokens.size(), static_cast<size_t>(1 + kStepsBeforeKill));

  const Outcome out = KillMidStream(/*colocated=*/false, sp);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.tokens, ref.tokens) << "stop string '" << stop << "'";
  EXPECT_EQ(out.text, ref.text);
  EXPECT_EQ(out.text, plain.text.substr(0, boundary - 3));
  EXPECT_EQ(out.reason, v1::FINISH_REASON_STOP);
  EXPECT_EQ(out.finished_messages, 1);
  EXPECT_EQ(out.usage.completion_tokens(), static_cast<int>(ref.tokens.size()));
  EXPECT_EQ(router_->inference().migrations(), 1u);
  ExpectPoolsAtRest();
}

// The decode worker ends the stream itself with FINISH_REASON_CANCELLED (it was not the
// client's doing): with a migration left, the router moves the request instead of relaying it.
TEST_F(MigrationTest, StreamTheWorkerCancelsItselfIsMigrated) {
  const engine::SamplingParams sp = Greedy(kMaxTokens);
  const Reference ref = RunReference(model_, TestPrompt(kPromptTokens, 7), sp);
  const Outcome out = KillMidStream(/*colocated=*/false, sp, Stop::kWorkerCancel);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.tokens, ref.tokens);
  EXPECT_EQ(out.text, ref.text);
  EXPECT_EQ(out.reason, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(out.finished_messages, 1);
  EXPECT_EQ(router_->inference().migrations(), 1u);
  ExpectPoolsAtRest();
}

// --max-migrations 0: the broken stream ends with its error after the tokens already sent, and
// nothing is counted.
TEST_F(MigrationTest, DisabledMigrationFailsTheBrokenStream) {
  StartRouter(/*max_migrations=*/0);
  const engine::SamplingParams sp = Greedy(kMaxTokens);
  const Reference ref = RunReference(model_, TestPrompt(kPromptTokens, 7), sp);
  const Outcome out = KillMidStream(/*colocated=*/false, sp);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::UNAVAILABLE) << out.status.error_message();
  ASSERT_EQ(out.tokens.size(), static_cast<size_t>(1 + kStepsBeforeKill));
  EXPECT_TRUE(std::equal(out.tokens.begin(), out.tokens.end(), ref.tokens.begin()));
  EXPECT_EQ(out.finished_messages, 0);
  EXPECT_EQ(router_->inference().migrations(), 0u);
  EXPECT_EQ(MigrationsMetric(), 0);
  ExpectPoolsAtRest();
}

}  // namespace
}  // namespace tandem::testing
