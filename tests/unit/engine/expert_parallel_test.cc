// Expert parallelism on the engine's side: placements (contiguous, from JSON, refused), and an
// engine whose experts are split between ranks against one holding them all. The ranks here
// are in-process stand-ins for the remote ranks (each its own Model loaded with only its
// experts, run by the same ExpertRunner the expert ranks run); the transport between
// processes is tested in tests/component/services/expert_group_test.cc.
#include "engine/runtime/expert_parallel.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>

#include "engine/runtime/engine.h"
#include "gtest/gtest.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::engine {
namespace {

using testing::RandomTokens;
using testing::TinyModelOptions;

TEST(ExpertPlacementTest, ContiguousSplitsEvenlyAndRefusesARemainder) {
  auto p = ExpertPlacement::Contiguous(3, 8, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->layers.size(), 3u);
  EXPECT_EQ(p->layers[2][1], (std::vector<int32_t>{2, 3}));
  EXPECT_TRUE(p->Holds(3, 0, 7));
  EXPECT_FALSE(p->Holds(0, 0, 7));
  EXPECT_EQ(ExpertPlacement::Contiguous(3, 8, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ExpertPlacementTest, JsonRoundTripsAndHoldersListEveryReplica) {
  const nlohmann::json j = {{"ranks", 2},
                            {"n_expert", 4},
                            {"layers", {{{3, 0, 1}, {2, 0}}, {{0, 1}, {2, 3}}}},
                            {"imbalance", nlohmann::json::array()}};
  auto p = ExpertPlacement::FromJson(j, 2, 4, 2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->layers[0][0], (std::vector<int32_t>{0, 1, 3}));  // sorted
  auto again = ExpertPlacement::FromJson(p->ToJson(), 2, 4, 2);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->layers, p->layers);
  ExpertHolders h(*p);
  EXPECT_EQ(std::vector<int32_t>(h.of(0, 0).begin(), h.of(0, 0).end()),
            (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(std::vector<int32_t>(h.of(0, 2).begin(), h.of(0, 2).end()),
            (std::vector<int32_t>{1}));
  EXPECT_EQ(std::vector<int32_t>(h.of(1, 3).begin(), h.of(1, 3).end()),
            (std::vector<int32_t>{1}));
}

TEST(ExpertPlacementTest, RefusesPlacementsThatDoNotFitTheModelOrGroup) {
  auto refused = [](const nlohmann::json& j, const std::string& says) {
    absl::StatusOr<ExpertPlacement> p = ExpertPlacement::FromJson(j, 2, 4, 2);
    ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << j.dump();
    EXPECT_NE(p.status().message().find(says), std::string::npos) << p.status();
  };
  const nlohmann::json good_layer = {{0, 1}, {2, 3}};
  refused({{"layers", {good_layer}}}, "1 layers, the model has 2");
  refused({{"ranks", 4}, {"layers", {good_layer, good_layer}}}, "written for 4 ranks");
  refused({{"n_expert", 8}, {"layers", {good_layer, good_layer}}}, "written for 8 experts");
  refused({{"layers", {good_layer, {{0, 1}}}}}, "layer 1 does not list 2 ranks");
  refused({{"layers", {good_layer, {{0, 1}, {2, 4}}}}}, "4 is not an expert id below 4");
  refused({{"layers", {good_layer, {{0, 1, 1}, {2, 3}}}}}, "holds expert 1 twice");
  refused({{"layers", {good_layer, {{0, 1}, {2}}}}}, "no rank holds expert 3");
  refused(nlohmann::json::array(), "\"layers\" array");
  EXPECT_EQ(ExpertPlacement::ReadFile("/nonexistent/p.json", 2, 4, 2).status().code(),
            absl::StatusCode::kNotFound);
}

// The remote ranks of a group, in this process: rank r's own Model holds only its experts
// (experts_only, as an expert rank loads it), and Send runs them at once.
class InProcessPeers : public ExpertPeers {
 public:
  InProcessPeers(const std::string& path, const ExpertPlacement& p) : placement_(p), holders_(p) {
    for (int32_t r = 1; r < p.ranks; ++r) {
      ModelLoadOptions lo;
      lo.experts_only = true;
      lo.holds_expert = [this, r](int32_t l, int32_t e) { return placement_.Holds(r, l, e); };
      auto m = Model::Load(path, lo);
      EXPECT_TRUE(m.ok()) << m.status();
      ranks_[r].model = std::move(*m);
    }
  }
  int32_t ranks() const override { return placement_.ranks; }
  const ExpertHolders& holders() const override { return holders_; }
  absl::Status Send(int32_t rank, const ExpertWork& work, const float* in) override {
    if (rank == fail_rank_) return absl::UnavailableError("expert rank left the group");
    Rank& r = ranks_.at(rank);
    const ModelConfig& c = r.model->config();
    for (int32_t e : work.expert) {
      EXPECT_TRUE(placement_.Holds(rank, work.layer, e))
          << "rank " << rank << " sent expert " << e << " of layer " << work.layer;
    }
    r.out.assign(work.total_rows() * c.n_embd, 0.0f);
    r.runner.Run(c, r.model->layer(work.layer), work, in, r.out.data(), &pool_);
    rows_sent_[rank] += work.total_rows();
    return absl::OkStatus();
  }
  absl::StatusOr<const float*> Receive(int32_t rank, int64_t rows) override {
    Rank& r = ranks_.at(rank);
    EXPECT_EQ(static_cast<int64_t>(r.out.size()), rows * r.model->config().n_embd);
    return r.out.data();
  }
  void FailRank(int32_t r) { fail_rank_ = r; }
  int64_t rows_sent(int32_t rank) { return rows_sent_[rank]; }

 private:
  struct Rank {
    std::unique_ptr<Model> model;
    ExpertRunner runner;
    std::vector<float> out;
  };
  ExpertPlacement placement_;
  ExpertHolders holders_;
  std::map<int32_t, Rank> ranks_;
  std::map<int32_t, int64_t> rows_sent_;
  util::ThreadPool pool_{1};
  int32_t fail_rank_ = -1;
};

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<const Model> m, ExpertPeers* peers) {
  EngineOptions o;
  o.threads = 2;
  o.ctx_size = 64;
  o.max_seqs = 2;
  o.block_size = 16;
  o.expert_peers = peers;
  auto e = Engine::Create(std::move(m), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

struct Generated {
  std::vector<std::vector<float>> logits;  // per step
  std::vector<int32_t> tokens;             // argmax of each step
};

// A prompt of 11 tokens, then `steps` greedy one-token steps.
Generated Generate(Engine& e, int steps) {
  Generated run;
  const auto prompt = RandomTokens(11, e.model().config().n_vocab, 5);
  auto blocks = *e.kv().pool().AllocateN(1);
  std::vector<float> logits;
  SeqChunk ch{prompt, 0, blocks, true};
  int32_t pos = 11, next = 0;
  for (int i = 0; i <= steps; ++i) {
    absl::Status st = e.Step({&ch, 1}, &logits);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) break;
    next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    run.logits.push_back(logits);
    run.tokens.push_back(next);
    ch = SeqChunk{{&next, 1}, pos++, blocks, true};
  }
  EXPECT_TRUE(e.kv().pool().UnrefAll(blocks).ok());
  return run;
}

struct EpCase {
  std::string arch;
  kernels::DType type;
};

class EngineEpTest : public ::testing::TestWithParam<EpCase> {
 protected:
  void SetUp() override {
    TinyModelOptions o;
    o.arch = GetParam().arch;
    o.type = GetParam().type;
    o.n_expert = 8;
    o.n_expert_used = 3;
    path_ = (std::filesystem::temp_directory_path() /
             ("tandem-ep-" + o.arch + "-" + std::to_string(getpid()) + ".gguf"))
                .string();
    ASSERT_TRUE(testing::WriteTinyModel(o, path_).ok());
    auto whole = Model::Load(path_);
    ASSERT_TRUE(whole.ok()) << whole.status();
    whole_ = std::move(*whole);
  }
  void TearDown() override { std::filesystem::remove(path_); }

  // The model as rank 0 of `p` loads it: only its own experts packed.
  std::shared_ptr<const Model> LeaderModel(const ExpertPlacement& p) {
    ModelLoadOptions lo;
    lo.holds_expert = [p](int32_t l, int32_t e) { return p.Holds(0, l, e); };
    auto m = Model::Load(path_, lo);
    EXPECT_TRUE(m.ok()) << m.status();
    return std::move(*m);
  }

  std::string path_;
  std::shared_ptr<const Model> whole_;
};

// Each expert on one rank: every group's rows are computed by the same code as on one rank,
// so the logits are the same bits, for prompt and one-token steps.
TEST_P(EngineEpTest, TwoRanksGiveTheBitsOfOne) {
  const ModelConfig& c = whole_->config();
  auto one = MakeEngine(whole_, nullptr);
  ASSERT_NE(one, nullptr);
  const Generated want = Generate(*one, 4);

  auto placement = ExpertPlacement::Contiguous(c.n_layer, c.n_expert, 2);
  ASSERT_TRUE(placement.ok());
  InProcessPeers peers(path_, *placement);
  auto two = MakeEngine(LeaderModel(*placement), &peers);
  ASSERT_NE(two, nullptr);
  const Generated got = Generate(*two, 4);
  EXPECT_GT(peers.rows_sent(1), 0);
  ASSERT_EQ(got.tokens, want.tokens);
  for (size_t i = 0; i < want.logits.size(); ++i) {
    ASSERT_EQ(got.logits[i].size(), want.logits[i].size());
    EXPECT_EQ(std::memcmp(got.logits[i].data(), want.logits[i].data(),
                          want.logits[i].size() * sizeof(float)),
              0)
        << "step " << i << " differs";
  }
  // The load metric counts the whole group's routing, on rank 0.
  EXPECT_EQ(two->expert_tokens(), one->expert_tokens());
}

// Three ranks, the experts interleaved and two of them on every rank (EPLB's redundant
// replicas): a replicated expert's rows are split across ranks, so the tokens agree and the
// logits within float rounding.
TEST_P(EngineEpTest, ReplicatedExpertsSplitTheirRowsAndKeepTheTokens) {
  const ModelConfig& c = whole_->config();
  auto one = MakeEngine(whole_, nullptr);
  ASSERT_NE(one, nullptr);
  const Generated want = Generate(*one, 4);

  nlohmann::json layer = {{0, 3, 6, 1, 2}, {1, 4, 7, 2}, {2, 5, 1}};
  nlohmann::json j = {{"layers", nlohmann::json::array()}};
  for (int32_t l = 0; l < c.n_layer; ++l) j["layers"].push_back(layer);
  auto placement = ExpertPlacement::FromJson(j, c.n_layer, c.n_expert, 3);
  ASSERT_TRUE(placement.ok()) << placement.status();
  InProcessPeers peers(path_, *placement);
  auto three = MakeEngine(LeaderModel(*placement), &peers);
  ASSERT_NE(three, nullptr);
  const Generated got = Generate(*three, 4);
  EXPECT_GT(peers.rows_sent(1), 0);
  EXPECT_GT(peers.rows_sent(2), 0);
  EXPECT_EQ(got.tokens, want.tokens);
  for (size_t i = 0; i < want.logits.size() && i < got.logits.size(); ++i) {
    float most = 0;
    for (float v : want.logits[i]) most = std::max(most, std::abs(v));
    for (size_t v = 0; v < want.logits[i].size(); ++v) {
      ASSERT_NEAR(got.logits[i][v], want.logits[i][v], 1e-4f * most) << "step " << i;
    }
  }
}

TEST_P(EngineEpTest, ARankThatLeftFailsTheStepWithItsStatus) {
  const ModelConfig& c = whole_->config();
  auto placement = ExpertPlacement::Contiguous(c.n_layer, c.n_expert, 2);
  ASSERT_TRUE(placement.ok());
  InProcessPeers peers(path_, *placement);
  auto two = MakeEngine(LeaderModel(*placement), &peers);
  ASSERT_NE(two, nullptr);
  peers.FailRank(1);
  const auto prompt = RandomTokens(5, c.n_vocab, 9);
  auto blocks = *two->kv().pool().AllocateN(1);
  std::vector<float> logits;
  SeqChunk ch{prompt, 0, blocks, true};
  absl::Status st = two->Step({&ch, 1}, &logits);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_TRUE(two->kv().pool().UnrefAll(blocks).ok());
}

INSTANTIATE_TEST_SUITE_P(Archs, EngineEpTest,
                         ::testing::Values(EpCase{"qwen3moe", kernels::DType::kF32},
                                           EpCase{"qwen2moe", kernels::DType::kF32},
                                           EpCase{"mixtral", kernels::DType::kQ8_0},
                                           EpCase{"gpt-oss", kernels::DType::kF16}),
                         [](const ::testing::TestParamInfo<EpCase>& i) {
                           std::string n = i.param.arch;
                           std::erase(n, '-');
                           return n;
                         });

TEST(EngineEpOptionsTest, ADenseModelRefusesPeers) {
  TinyModelOptions o;
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("tandem-ep-dense-" + std::to_string(getpid()) + ".gguf"))
                               .string();
  ASSERT_TRUE(testing::WriteTinyModel(o, path).ok());
  auto m = Model::Load(path);
  std::filesystem::remove(path);
  ASSERT_TRUE(m.ok());
  auto placement = ExpertPlacement::Contiguous(2, 8, 2);
  ASSERT_TRUE(placement.ok());
  class NoPeers : public ExpertPeers {
   public:
    explicit NoPeers(const ExpertPlacement& p) : h_(p) {}
    int32_t ranks() const override { return 2; }
    const ExpertHolders& holders() const override { return h_; }
    absl::Status Send(int32_t, const ExpertWork&, const float*) override {
      return absl::OkStatus();
    }
    absl::StatusOr<const float*> Receive(int32_t, int64_t) override { return nullptr; }
    ExpertHolders h_;
  } peers(*placement);
  EngineOptions eo;
  eo.expert_peers = &peers;
  auto e = Engine::Create(std::shared_ptr<const Model>(std::move(*m)), eo);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::engine
