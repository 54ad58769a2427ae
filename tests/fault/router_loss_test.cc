// Several routers at once, on a cluster of real processes (fault_cluster.h; the real stories260K
// model, KV over UCX shared memory). Every worker registers with every router (--router A,B).
// - A router started without --model learns the model from the first worker's model card:
//   before any worker registers it answers UNAVAILABLE and its health says NOT_SERVING; after,
//   it serves greedy text identical to a router started with the model, and to `tandem
//   generate`.
// - A router SIGKILLed while a stream runs through it: the client sees UNAVAILABLE promptly
//   (no hang), the decode and prefill workers free the request's KV (back to their idle
//   baseline), and the retry through the other router succeeds with the reference text.
// - A router stopped (SIGSTOP) for longer than a worker lease while a stream runs through it:
//   when it runs again it keeps both workers (it logs its own stall instead of dropping them),
//   the stream ends with the reference tokens, and new requests are served at once.
// Skips without ../shared/models.
#include <signal.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/fakes/shell_util.h"
#include "tests/fault/fault_cluster.h"
#include "tools/tandem/cluster.h"

namespace tandem::testing {
namespace {

namespace v1 = tandem::v1;

bool HaveModel() { return std::filesystem::exists(FaultModelPath()); }

std::vector<std::string> WorkerIds(FaultCluster& c) {
  std::vector<std::string> ids;
  auto workers = c.Workers();
  if (workers.ok()) {
    for (const v1::WorkerInfo& w : *workers) ids.push_back(w.worker_id());
  }
  return ids;
}

TEST(RouterLossTest, ARouterWithoutTheModelLearnsItFromTheWorkers) {
  if (!HaveModel()) GTEST_SKIP() << "no " << FaultModelPath();
  FaultClusterOptions o;
  o.name = "nomodel";
  o.routers = 2;
  o.routers_without_model = {1};
  bool checked_before = false;
  o.before_workers = [&](FaultCluster& c) {
    // No worker yet: the model-less router refuses requests and says NOT_SERVING.
    c.UseRouter(1);
    const Completion early = c.Generate(GreedyRequest("Once upon a time", 8), absl::Seconds(10));
    EXPECT_EQ(early.status.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_NE(early.status.error_message().find("no worker has registered yet"),
              std::string::npos)
        << early.status.error_message();
    EXPECT_LT(early.elapsed, absl::Seconds(2));
    absl::StatusOr<bool> healthy = tools::CheckHealth(c.router_address(1), absl::Seconds(2));
    ASSERT_TRUE(healthy.ok()) << healthy.status();
    EXPECT_FALSE(*healthy);
    healthy = tools::CheckHealth(c.router_address(0), absl::Seconds(2));
    ASSERT_TRUE(healthy.ok()) << healthy.status();
    EXPECT_TRUE(*healthy);  // the router with --model serves from the start
    c.UseRouter(0);
    checked_before = true;
  };
  FaultCluster cluster(o);
  ASSERT_TRUE(cluster.Start().ok());
  ASSERT_TRUE(checked_before);

  absl::StatusOr<bool> healthy = tools::CheckHealth(cluster.router_address(1), absl::Seconds(2));
  ASSERT_TRUE(healthy.ok()) << healthy.status();
  EXPECT_TRUE(*healthy);
  const std::vector<std::string> want = {"decode-0", "prefill-0"};
  for (int r = 0; r < 2; ++r) {
    cluster.UseRouter(r);
    EXPECT_EQ(WorkerIds(cluster), want) << "router " << r;
  }
  for (const std::string prompt : {"Once upon a time", "The little dog"}) {
    const Completion ref = GreedyReference(prompt, 24);
    ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();
    cluster.UseRouter(0);
    const Completion with = cluster.Generate(GreedyRequest(prompt, 24));
    cluster.UseRouter(1);
    const Completion without = cluster.Generate(GreedyRequest(prompt, 24));
    ASSERT_TRUE(with.status.ok()) << with.status.error_message();
    ASSERT_TRUE(without.status.ok()) << without.status.error_message();
    EXPECT_EQ(without.tokens, with.tokens) << prompt;
    EXPECT_EQ(without.text, with.text) << prompt;
    EXPECT_EQ(without.tokens, ref.tokens) << prompt;
    EXPECT_EQ(without.usage.prompt_tokens(), with.usage.prompt_tokens());
  }
  // ListModels answers with the learned model's facts.
  grpc::ClientContext cc;
  cc.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::ListModelsResponse models;
  ASSERT_TRUE(cluster.inference().ListModels(&cc, v1::ListModelsRequest(), &models).ok());
  ASSERT_EQ(models.models_size(), 1);
  EXPECT_EQ(models.models(0).id(), "stories260K");
  EXPECT_EQ(models.models(0).context_length(), 2048);
}

TEST(RouterLossTest, LosingARouterLosesOnlyItsOwnStreams) {
  if (!HaveModel()) GTEST_SKIP() << "no " << FaultModelPath();
  FaultClusterOptions o;
  o.name = "routerloss";
  o.routers = 2;
  o.decode_args = {"--quarantine-ms", "500"};  // blocks of a cancelled stream come back soon
  FaultCluster cluster(o);
  ASSERT_TRUE(cluster.Start().ok());
  std::string why;
  ASSERT_TRUE(cluster.WaitIdle(absl::Seconds(10), &why)) << why;
  const v1::WorkerStats decode_idle = *cluster.Stats("decode-0");

  // A long stream through router 0; once tokens flow, SIGKILL router 0.
  const v1::GenerateRequest req = GreedyRequest("Once upon a time", 1800, /*ignore_eos=*/true);
  grpc::ClientContext cc;
  cc.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  auto reader = cluster.inference().Generate(&cc, req);
  v1::GenerateResponse m;
  int tokens = 0;
  while (tokens < 16 && reader->Read(&m)) tokens += m.token_ids_size();
  ASSERT_GE(tokens, 16);
  ASSERT_FALSE(m.finished());
  // The stream holds KV on the decode worker now.
  const absl::StatusOr<v1::WorkerStats> busy = cluster.Stats("decode-0");
  ASSERT_TRUE(busy.ok());
  EXPECT_EQ(busy->running(), 1);
  EXPECT_LT(busy->kv_blocks_free(), decode_idle.kv_blocks_free());

  cluster.process("router")->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  bool finished = false;
  while (reader->Read(&m)) finished = finished || m.finished();
  const grpc::Status st = reader->Finish();
  const absl::Duration ended = absl::Now() - killed;
  EXPECT_FALSE(finished);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_LT(ended, absl::Seconds(3)) << "the client's stream should end promptly";
  std::printf("router_loss: client saw %s after %.0f ms\n", st.error_message().c_str(),
              absl::ToDoubleMilliseconds(ended));

  // The workers free the dead router's request: back to the idle baseline, as router 1 sees.
  cluster.UseRouter(1);
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(cluster.WaitIdle(absl::Seconds(10), &why)) << why;
  std::printf("router_loss: recovery_ms %.0f\n", absl::ToDoubleMilliseconds(absl::Now() - t0));
  const v1::WorkerStats after = *cluster.Stats("decode-0");
  EXPECT_EQ(after.running(), 0);
  EXPECT_EQ(after.reservations(), 0);
  EXPECT_EQ(after.kv_blocks_free(), decode_idle.kv_blocks_free());
  EXPECT_EQ(cluster.Stats("prefill-0")->running(), 0);

  // The client's retry through the surviving router succeeds, with the reference text.
  const Completion ref = GreedyReference("Once upon a time", 32);
  ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();
  const Completion retry = cluster.Generate(GreedyRequest("Once upon a time", 32));
  ASSERT_TRUE(retry.status.ok()) << retry.status.error_message();
  EXPECT_EQ(retry.tokens, ref.tokens);
  EXPECT_EQ(WorkerIds(cluster), (std::vector<std::string>{"decode-0", "prefill-0"}));
}

TEST(RouterLossTest, ARouterThatWasStoppedKeepsItsWorkersAndItsStream) {
  if (!HaveModel()) GTEST_SKIP() << "no " << FaultModelPath();
  FaultClusterOptions o;
  o.name = "routerstall";
  o.lease_ms = 2000;
  FaultCluster cluster(o);
  ASSERT_TRUE(cluster.Start().ok());
  const Completion ref = GreedyReference("Once upon a time", 96);
  ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();

  grpc::ClientContext cc;
  cc.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  auto reader = cluster.inference().Generate(&cc, GreedyRequest("Once upon a time", 96));
  v1::GenerateResponse m;
  std::vector<int32_t> tokens;
  while (tokens.size() < 8 && reader->Read(&m)) {
    tokens.insert(tokens.end(), m.token_ids().begin(), m.token_ids().end());
  }
  ASSERT_GE(tokens.size(), 8u);
  // Stopped for 1.75 leases: every lease would have run out by the time it runs again, and
  // the workers' heartbeats of that time failed on their deadline.
  const pid_t router = cluster.pid("router");
  ASSERT_EQ(kill(router, SIGSTOP), 0);
  absl::SleepFor(absl::Milliseconds(3500));
  ASSERT_EQ(kill(router, SIGCONT), 0);
  const absl::Time resumed = absl::Now();
  while (reader->Read(&m)) tokens.insert(tokens.end(), m.token_ids().begin(), m.token_ids().end());
  const grpc::Status st = reader->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(tokens, ref.tokens);

  // A request right after is served (no gap while workers register again) ...
  const Completion next = cluster.Generate(GreedyRequest("Once upon a time", 16));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  std::printf("router_stall: next request %.0f ms after the router ran again\n",
              absl::ToDoubleMilliseconds(absl::Now() - resumed));
  // ... and a sweep later, the router has logged its stall and dropped nobody.
  absl::SleepFor(absl::Seconds(1));
  EXPECT_EQ(WorkerIds(cluster), (std::vector<std::string>{"decode-0", "prefill-0"}));
  const std::string log = Slurp(cluster.dir() / "router.log");
  EXPECT_NE(log.find("the router itself was stalled for"), std::string::npos) << log;
  EXPECT_EQ(log.find("lease expired without a heartbeat"), std::string::npos) << log;
}

}  // namespace
}  // namespace tandem::testing
