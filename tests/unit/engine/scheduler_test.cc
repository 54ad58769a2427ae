// The continuous-batching loop: many requests at once produce what each produces alone, and
// every way out (finish, cancel, rejection) leaves the KV pool as it found it.
#include "engine/runtime/scheduler.h"

#include <unistd.h>

#include <filesystem>
#include <map>

#include "gtest/gtest.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::engine {
namespace {

std::shared_ptr<const Model> TinyModel() {
  static std::shared_ptr<const Model> model = [] {
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("tandem-sched-" + std::to_string(getpid()) + ".gguf"))
                                 .string();
    testing::TinyModelOptions o;
    EXPECT_TRUE(testing::WriteTinyModel(o, path).ok());
    auto m = Model::Load(path);
    EXPECT_TRUE(m.ok()) << m.status();
    std::filesystem::remove(path);
    return std::shared_ptr<const Model>(std::move(*m));
  }();
  return model;
}

std::unique_ptr<Engine> MakeEngine(int max_batch_tokens = 64) {
  EngineOptions o;
  o.threads = 2;
  o.ctx_size = 128;
  o.max_seqs = 4;
  o.max_batch_tokens = max_batch_tokens;
  return std::move(*Engine::Create(TinyModel(), o));
}

// <s> and then n - 1 ids in [3, 253).
std::vector<int32_t> Prompt(int n, uint32_t seed) {
  std::vector<int32_t> t = {1};
  const std::vector<int32_t> rest = testing::RandomTokens(n - 1, 253, seed);
  t.insert(t.end(), rest.begin(), rest.end());
  return t;
}

struct Collected {
  std::vector<int32_t> tokens;
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  absl::Status status;
};

GenerationRequest Req(const std::string& id, std::vector<int32_t> prompt, SamplingParams sp,
                      std::map<std::string, Collected>* out) {
  GenerationRequest r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.sampling = sp;
  r.on_event = [out, id](const TokenEvent& ev) {
    Collected& c = (*out)[id];
    if (ev.token >= 0) c.tokens.push_back(ev.token);
    if (ev.finished) {
      c.finished = true;
      c.reason = ev.reason;
      c.status = ev.status;
    }
  };
  return r;
}

TEST(SchedulerTest, ConcurrentRequestsMatchSoloRuns) {
  SamplingParams greedy;
  greedy.temperature = 0;
  greedy.max_tokens = 12;
  greedy.ignore_eos = true;
  SamplingParams seeded = greedy;
  seeded.temperature = 0.8f;
  seeded.seed = 1234;
  const std::vector<std::pair<std::vector<int32_t>, SamplingParams>> reqs = {
      {Prompt(5, 1), greedy}, {Prompt(70, 2), greedy}, {Prompt(33, 3), seeded},
      {Prompt(9, 4), seeded}, {Prompt(100, 5), greedy}};

  std::map<std::string, Collected> solo, together;
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto e = MakeEngine();
    Scheduler s(e.get());
    ASSERT_TRUE(s.Submit(Req(std::to_string(i), reqs[i].first, reqs[i].second, &solo)).ok());
    ASSERT_TRUE(s.RunUntilIdle().ok());
  }
  auto e = MakeEngine(/*max_batch_tokens=*/24);  // forces chunked prefill beside decodes
  Scheduler s(e.get());
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(s.Submit(Req(std::to_string(i), reqs[i].first, reqs[i].second, &together)).ok());
  }
  ASSERT_TRUE(s.RunUntilIdle().ok());
  for (size_t i = 0; i < reqs.size(); ++i) {
    const std::string id = std::to_string(i);
    EXPECT_TRUE(together[id].finished);
    EXPECT_EQ(together[id].reason, FinishReason::kLength);
    EXPECT_EQ(together[id].tokens.size(), 12u);
    EXPECT_EQ(together[id].tokens, solo[id].tokens) << "request " << i;
  }
  EXPECT_EQ(e->kv().pool().num_free(), e->kv().pool().num_blocks());
  EXPECT_GT(s.stats().steps, 12);
}

TEST(SchedulerTest, CancelFreesBlocks) {
  auto e = MakeEngine();
  Scheduler s(e.get());
  std::map<std::string, Collected> out;
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 50;
  sp.ignore_eos = true;
  ASSERT_TRUE(s.Submit(Req("a", Prompt(20, 1), sp, &out)).ok());
  ASSERT_TRUE(s.Submit(Req("b", Prompt(20, 2), sp, &out)).ok());
  ASSERT_TRUE(s.Iterate().ok());
  ASSERT_TRUE(s.Iterate().ok());
  EXPECT_LT(e->kv().pool().num_free(), e->kv().pool().num_blocks());
  s.Cancel("a");
  EXPECT_TRUE(out["a"].finished);
  EXPECT_EQ(out["a"].status.code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(s.RunUntilIdle().ok());
  EXPECT_EQ(out["b"].tokens.size(), 50u);
  EXPECT_EQ(e->kv().pool().num_free(), e->kv().pool().num_blocks());
}

TEST(SchedulerTest, RejectsWhatCannotRun) {
  auto e = MakeEngine();
  Scheduler s(e.get());
  std::map<std::string, Collected> out;
  SamplingParams sp;
  sp.max_tokens = 10;
  EXPECT_EQ(s.Submit(Req("empty", {}, sp, &out)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Submit(Req("oov", {1, 100000}, sp, &out)).code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status too_long = s.Submit(Req("long", Prompt(200, 1), sp, &out));
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.message().find("context"), std::string::npos) << too_long;
  sp.max_tokens = 100;
  EXPECT_EQ(s.Submit(Req("sum", Prompt(60, 1), sp, &out)).code(),
            absl::StatusCode::kInvalidArgument);
  sp.max_tokens = 10;
  sp.temperature = -1;
  EXPECT_EQ(s.Submit(Req("temp", Prompt(6, 1), sp, &out)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.num_waiting(), 0);
}

TEST(SchedulerTest, StopTokenEndsGeneration) {
  // Find the greedy continuation, then ask to stop at its third token.
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 8;
  sp.ignore_eos = true;
  std::map<std::string, Collected> out;
  {
    auto e = MakeEngine();
    Scheduler s(e.get());
    ASSERT_TRUE(s.Submit(Req("x", Prompt(10, 9), sp, &out)).ok());
    ASSERT_TRUE(s.RunUntilIdle().ok());
  }
  const std::vector<int32_t> full = out["x"].tokens;
  ASSERT_EQ(full.size(), 8u);
  sp.stop_token_ids = {full[2]};
  auto e = MakeEngine();
  Scheduler s(e.get());
  ASSERT_TRUE(s.Submit(Req("y", Prompt(10, 9), sp, &out)).ok());
  ASSERT_TRUE(s.RunUntilIdle().ok());
  EXPECT_EQ(out["y"].reason, FinishReason::kStop);
  const auto first = std::find(full.begin(), full.end(), full[2]) - full.begin();
  EXPECT_EQ(out["y"].tokens.size(), size_t(first + 1));
}

TEST(SchedulerTest, PrefilledSequenceContinuesExactlyAsALocalOne) {
  // What a decode worker does with KV written by a prefill worker: the prompt's K/V are in the
  // blocks, the first token was sampled elsewhere with the same seed.
  SamplingParams sp;
  sp.temperature = 0.9f;
  sp.seed = 77;
  sp.max_tokens = 10;
  sp.ignore_eos = true;
  const auto prompt = Prompt(40, 6);
  std::map<std::string, Collected> out;
  {
    auto e = MakeEngine();
    Scheduler s(e.get());
    ASSERT_TRUE(s.Submit(Req("local", prompt, sp, &out)).ok());
    ASSERT_TRUE(s.RunUntilIdle().ok());
  }
  auto e = MakeEngine();
  auto blocks = *e->kv().pool().AllocateN(4);  // 50 positions
  std::vector<float> logits;
  SeqChunk ch{prompt, 0, blocks, true};
  ASSERT_TRUE(e->Step({&ch, 1}, &logits).ok());
  Sampler prefill_sampler(sp);
  const int32_t first = prefill_sampler.Sample(logits, prompt);
  Scheduler s(e.get());
  ASSERT_TRUE(s.SubmitPrefilled(Req("remote", prompt, sp, &out), blocks, first).ok());
  EXPECT_EQ(out["remote"].tokens.size(), 1u);  // the first token is reported at once
  ASSERT_TRUE(s.RunUntilIdle().ok());
  EXPECT_EQ(out["remote"].tokens, out["local"].tokens);
  EXPECT_EQ(e->kv().pool().num_free(), e->kv().pool().num_blocks());
}

}  // namespace
}  // namespace tandem::engine
