// Speculative decoding inside the continuous-batching loop: k+1 logit rows per verify chunk
// equal step-by-step decoding, greedy and seeded output equal non-speculative output on the real
// stories260K model and on synthetic models, the K/V cache after rejections equals a plain run's,
// and a chi-square test cannot tell speculative sampling from plain sampling.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>

#include "engine/kv/block_pool.h"
#include "engine/runtime/draft_proposer.h"
#include "engine/runtime/scheduler.h"
#include "gtest/gtest.h"
#include "tests/fakes/sanitizer.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::engine {
namespace {

namespace fs = std::filesystem;

const fs::path kStories = fs::path(TANDEM_SHARED_MODELS_DIR) / "stories260K" / "stories260K.gguf";

std::shared_ptr<const Model> LoadTiny(const testing::TinyModelOptions& o, const std::string& tag) {
  const std::string path =
      (fs::temp_directory_path() / ("tandem-spec-" + tag + "-" + std::to_string(getpid()) + ".gguf"))
          .string();
  EXPECT_TRUE(testing::WriteTinyModel(o, path).ok());
  auto m = Model::Load(path);
  EXPECT_TRUE(m.ok()) << m.status();
  fs::remove(path);  // the mapping stays valid
  return std::shared_ptr<const Model>(std::move(*m));
}

std::shared_ptr<const Model> Stories() {
  static std::shared_ptr<const Model> model = []() -> std::shared_ptr<const Model> {
    if (!fs::exists(kStories)) return nullptr;
    auto m = Model::Load(kStories.string());
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::shared_ptr<const Model>(std::move(*m)) : nullptr;
  }();
  return model;
}

#define REQUIRE_STORIES()                                                            \
  if (Stories() == nullptr) GTEST_SKIP() << "no real model at " << kStories          \
                                         << " (../shared/models is absent)"

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<const Model> m, int32_t max_seqs = 16,
                                   int32_t max_batch_tokens = 256) {
  EngineOptions o;
  o.threads = 2;
  o.ctx_size = 256;
  o.max_seqs = max_seqs;
  o.block_size = 16;
  o.max_batch_tokens = max_batch_tokens;
  auto e = Engine::Create(std::move(m), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

SpeculativeOptions Ngram(int32_t k, int32_t max_batch = 8, bool adaptive = true) {
  SpeculativeOptions o;
  o.method = SpecMethod::kNgram;
  o.max_draft = k;
  o.max_batch = max_batch;
  o.adaptive = adaptive;
  return o;
}

struct Job {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
};

struct Outcome {
  std::vector<std::vector<int32_t>> tokens;  // per job
  SchedulerStats stats;
};

// Runs every job through one scheduler, all submitted at once. A model proposer (self, draft)
// is made for the engine unless `so` brings one.
Outcome RunJobs(Engine& e, const std::vector<Job>& jobs, SchedulerOptions so) {
  Outcome out;
  out.tokens.resize(jobs.size());
  if (so.proposer == nullptr) {
    auto p = MakeSpecProposer(so.speculative, e);
    EXPECT_TRUE(p.ok()) << p.status();
    if (p.ok()) so.proposer = *p;
  }
  {
  Scheduler s(&e, so);
  for (size_t i = 0; i < jobs.size(); ++i) {
    GenerationRequest r;
    r.id = std::to_string(i);
    r.prompt = jobs[i].prompt;
    r.sampling = jobs[i].sampling;
    r.on_event = [&out, i](const TokenEvent& ev) {
      EXPECT_TRUE(ev.status.ok()) << ev.status;
      if (ev.token >= 0) out.tokens[i].push_back(ev.token);
    };
    EXPECT_TRUE(s.Submit(std::move(r)).ok());
  }
  EXPECT_TRUE(s.RunUntilIdle().ok());
  out.stats = s.stats();
  }
  // Every block is back (cached ones go with the scheduler's prefix cache), the draft
  // model's too.
  EXPECT_EQ(e.kv().pool().num_free(), e.kv().pool().num_blocks());
  if (auto* d = dynamic_cast<DraftModelProposer*>(so.proposer.get())) {
    EXPECT_EQ(d->num_sequences(), 0u);
    const BlockPool& dp = d->engine().kv().pool();
    EXPECT_EQ(dp.num_free(), dp.num_blocks());
  }
  return out;
}

Outcome RunJobs(std::shared_ptr<const Model> m, const std::vector<Job>& jobs, SchedulerOptions so) {
  auto e = MakeEngine(std::move(m));
  return RunJobs(*e, jobs, so);
}

// self:TYPE or draft:PATH with k draft tokens.
SpeculativeOptions ModelDraft(const std::string& spec, int32_t k, bool adaptive = true) {
  auto o = ParseSpeculative(spec, k);
  EXPECT_TRUE(o.ok()) << o.status();
  o->max_batch = 16;
  o->adaptive = adaptive;
  return *o;
}

SchedulerOptions With(SpeculativeOptions spec) {
  SchedulerOptions so;
  so.speculative = spec;
  return so;
}

SamplingParams Greedy(int32_t max_tokens) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

// Children's-story prompts; several repeat names and phrases, as edits and summaries do.
const char* const kPrompts[] = {
    "Once upon a time, there was a little girl named Lily. Lily",
    "One day, a boy named Tom went to the park. Tom saw a big dog. Tom",
    "The cat sat on the mat. The cat was happy. The dog sat on the mat. The",
    "Sue had a red ball. Sue liked to play with the red ball. One day",
    "Once upon a time",
    "Tim and Sam were friends. Tim and Sam liked to play. Tim and",
    "There was a big tree in the garden. The bird lived in the big tree.",
    "Mom said, \"Lily, it is time for bed.\" Lily said, \"Mom,",
    "The sun was hot. Ben wanted to swim. Ben went to the lake and",
    "Anna saw a little bunny. The little bunny was sad. Anna",
    "Max had a toy car. He loved his toy car. One day his toy car",
    "Once upon a time, in a small house, there lived a kind old man. The kind old man",
};

std::vector<Job> StoryJobs(const Model& m, SamplingParams sp) {
  std::vector<Job> jobs;
  for (const char* p : kPrompts) {
    jobs.push_back({m.tokenizer().Encode(p, /*add_special=*/true, /*parse_special=*/false), sp});
  }
  return jobs;
}

void ExpectSameTokens(const Outcome& plain, const Outcome& spec) {
  ASSERT_EQ(plain.tokens.size(), spec.tokens.size());
  for (size_t i = 0; i < plain.tokens.size(); ++i) {
    EXPECT_EQ(spec.tokens[i], plain.tokens[i]) << "request " << i;
  }
}

// One step with n_logits = k+1 gives the logits of each of those positions, as feeding them one
// at a time does; bad n_logits are refused.
TEST(SpeculativeEngineTest, VerifyRowsMatchStepByStepDecoding) {
  auto model = LoadTiny({}, "rows");
  auto e = MakeEngine(model);
  const int vocab = model->config().n_vocab;
  const auto tokens = testing::RandomTokens(26, vocab, 5);
  const auto prefix = std::span<const int32_t>(tokens).first(20);
  const auto tail = std::span<const int32_t>(tokens).subspan(20);
  auto one = *e->kv().pool().AllocateN(2), all = *e->kv().pool().AllocateN(2);
  std::vector<float> logits, step_rows;
  for (auto* blocks : {&one, &all}) {
    SeqChunk pre{prefix, 0, *blocks, false};
    ASSERT_TRUE(e->Step({&pre, 1}, &logits).ok());
    EXPECT_TRUE(logits.empty());
  }
  for (size_t j = 0; j < tail.size(); ++j) {
    SeqChunk ch{tail.subspan(j, 1), static_cast<int32_t>(20 + j), one, true};
    ASSERT_TRUE(e->Step({&ch, 1}, &logits).ok());
    step_rows.insert(step_rows.end(), logits.begin(), logits.end());
  }
  SeqChunk ver{tail, 20, all, true};
  ver.n_logits = static_cast<int32_t>(tail.size());
  ASSERT_TRUE(e->Step({&ver, 1}, &logits).ok());
  ASSERT_EQ(logits.size(), step_rows.size());
  double max_diff = 0, spread = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(double(logits[i]) - step_rows[i]));
    spread = std::max(spread, std::fabs(double(step_rows[i])));
  }
  EXPECT_GT(spread, 0.1);
  EXPECT_LT(max_diff, 1e-4);

  // The last 3 rows only, beside a plain decode row of another sequence.
  ver.n_logits = 3;
  SeqChunk both[2] = {{tail.subspan(0, 1), 20, one, true}, ver};
  ASSERT_TRUE(e->Step(both, &logits).ok());
  ASSERT_EQ(logits.size(), size_t(4 * vocab));
  for (size_t i = 0; i < size_t(3 * vocab); ++i) {
    ASSERT_NEAR(logits[vocab + i], step_rows[3 * vocab + i], 1e-4) << i;
  }

  for (int32_t bad : {0, -1, 7}) {
    ver.n_logits = bad;
    EXPECT_EQ(e->Step({&ver, 1}, &logits).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(SpeculativeSchedulerTest, GreedyOutputEqualsPlainOnStories) {
  REQUIRE_STORIES();
  const std::vector<Job> jobs = StoryJobs(*Stories(), Greedy(96));
  const Outcome plain = RunJobs(Stories(), jobs, {});
  EXPECT_EQ(plain.stats.spec_steps, 0);
  // Adaptive, fixed short drafts and fixed long drafts; the batch gate is above the 12 requests.
  for (const SpeculativeOptions& spec :
       {Ngram(4, 16), Ngram(2, 16, /*adaptive=*/false), Ngram(8, 16, /*adaptive=*/false)}) {
    const Outcome got = RunJobs(Stories(), jobs, With(spec));
    ExpectSameTokens(plain, got);
    EXPECT_GT(got.stats.spec_accepted_tokens, 0);
    EXPECT_GT(got.stats.spec_draft_tokens, got.stats.spec_accepted_tokens) << "no rejection";
    // Fixed drafts must save steps. The adaptive rule prices drafts from measured step times,
    // so on a loaded machine it may rightly draft too little to save one (never more steps).
    if (spec.adaptive) {
      EXPECT_LE(got.stats.steps, plain.stats.steps);
    } else {
      EXPECT_LT(got.stats.steps, plain.stats.steps) << "speculation saved no step";
    }
    EXPECT_EQ(got.stats.generated_tokens, plain.stats.generated_tokens);
    int64_t hist = 0, kept = 0;
    for (size_t n = 0; n < got.stats.accepted_hist.size(); ++n) {
      hist += got.stats.accepted_hist[n];
      kept += int64_t(n) * got.stats.accepted_hist[n];
    }
    EXPECT_EQ(hist, got.stats.spec_steps);
    EXPECT_EQ(kept, got.stats.spec_accepted_tokens);
  }
}

TEST(SpeculativeSchedulerTest, BatchGateAndOptOutTurnItOff) {
  REQUIRE_STORIES();
  std::vector<Job> jobs = StoryJobs(*Stories(), Greedy(48));
  const Outcome plain = RunJobs(Stories(), jobs, {});
  // 12 sequences decode together, above a gate of 4: none speculates until only 4 are left,
  // which never happens (without speculation they all end at the same step).
  const Outcome gated = RunJobs(Stories(), jobs, With(Ngram(4, 4)));
  ExpectSameTokens(plain, gated);
  EXPECT_EQ(gated.stats.spec_steps, 0);
  for (Job& j : jobs) j.sampling.speculative = false;
  const Outcome opted_out = RunJobs(Stories(), jobs, With(Ngram(4, 16)));
  ExpectSameTokens(plain, opted_out);
  EXPECT_EQ(opted_out.stats.spec_steps, 0);
  // One request alone speculates under the same gate.
  const Outcome alone = RunJobs(Stories(), {StoryJobs(*Stories(), Greedy(48))[2]}, With(Ngram(4, 4)));
  EXPECT_GT(alone.stats.spec_steps, 0);
  EXPECT_EQ(alone.tokens[0], plain.tokens[2]);
}

TEST(SpeculativeSchedulerTest, SeededSamplingEqualsPlain) {
  REQUIRE_STORIES();
  SamplingParams sp = Greedy(80);
  sp.temperature = 0.8f;
  sp.top_p = 0.95f;
  sp.repetition_penalty = 1.05f;
  std::vector<Job> jobs = StoryJobs(*Stories(), sp);
  for (size_t i = 0; i < jobs.size(); ++i) jobs[i].sampling.seed = 1000 + i;
  const Outcome plain = RunJobs(Stories(), jobs, {});
  const Outcome spec = RunJobs(Stories(), jobs, With(Ngram(4, 16)));
  ExpectSameTokens(plain, spec);
  EXPECT_GT(spec.stats.spec_accepted_tokens, 0);
  EXPECT_GT(spec.stats.spec_draft_tokens, spec.stats.spec_accepted_tokens);
}

// Synthetic models (both architectures, quantised weights): prompts that repeat a random
// phrase, so the proposer drafts; random weights reject most drafts.
TEST(SpeculativeSchedulerTest, GreedyOutputEqualsPlainOnSyntheticModels) {
  std::vector<testing::TinyModelOptions> models(3);
  models[1].arch = "qwen2";
  models[2].type = kernels::DType::kQ8_0;
  models[2].n_embd = 128;
  for (size_t mi = 0; mi < models.size(); ++mi) {
    auto model = LoadTiny(models[mi], "syn" + std::to_string(mi));
    std::vector<Job> jobs;
    for (uint32_t i = 0; i < 10; ++i) {
      std::vector<int32_t> p = {1};
      const auto phrase = testing::RandomTokens(3 + i % 5, model->config().n_vocab, 40 + i);
      for (int r = 0; r < 4; ++r) p.insert(p.end(), phrase.begin(), phrase.end());
      jobs.push_back({p, Greedy(40)});
    }
    const Outcome plain = RunJobs(model, jobs, {});
    const Outcome spec = RunJobs(model, jobs, With(Ngram(4, 16)));
    ExpectSameTokens(plain, spec);
    EXPECT_GT(spec.stats.spec_draft_tokens, 0) << "model " << mi;
  }
}

// The target as its own draft, unconverted (self:f32 of an f32 model), proposes exactly the
// target's greedy tokens: every draft is kept. Any slip in the draft's K/V bookkeeping (catching
// up, rolling back after a rejection) would show up as a rejection here.
TEST(DraftModelTest, AnIdenticalDraftIsAlwaysRight) {
  REQUIRE_STORIES();
  const std::vector<Job> jobs = StoryJobs(*Stories(), Greedy(64));
  const Outcome plain = RunJobs(Stories(), jobs, {});
  const Outcome same = RunJobs(Stories(), jobs, With(ModelDraft("self:f32", 5, false)));
  ExpectSameTokens(plain, same);
  EXPECT_GT(same.stats.spec_steps, 0);
  EXPECT_EQ(same.stats.spec_accepted_tokens, same.stats.spec_draft_tokens);
  // 64 tokens: the first from prefill, then 6 per verify step until max_tokens bounds it.
  EXPECT_LE(same.stats.steps, plain.stats.steps / 4);
}

// A sequence prefilled elsewhere (a prefill worker) can bring its draft's prompt K/V along:
// the scheduler hands them to the proposer, which then only feeds the draft what follows the
// prompt. With the right K/V an identical draft keeps every draft; with damaged K/V the draft
// proposes worse, which shows the adopted blocks are what it reads, yet the output stays the
// target's. Both pools end empty either way.
TEST(DraftModelTest, AdoptedDraftKvIsWhatTheDraftReads) {
  REQUIRE_STORIES();
  for (bool damaged : {false, true}) {
    SCOPED_TRACE(damaged ? "damaged draft K/V" : "draft K/V as computed");
    auto e = MakeEngine(Stories());
    auto p = MakeSpecProposer(ModelDraft("self:f32", 5, false), *e);
    ASSERT_TRUE(p.ok()) << p.status();
    auto* d = dynamic_cast<DraftModelProposer*>(p->get());
    ASSERT_NE(d, nullptr);
    SchedulerOptions so = With(ModelDraft("self:f32", 5, false));
    so.proposer = *p;
    const std::vector<Job> jobs = StoryJobs(*Stories(), Greedy(48));
    const Outcome plain = RunJobs(Stories(), jobs, {});
    Outcome got;
    got.tokens.resize(jobs.size());
    {
      Scheduler s(e.get(), so);
      std::vector<float> logits;
      for (size_t i = 0; i < jobs.size(); ++i) {
        const std::vector<int32_t>& prompt = jobs[i].prompt;
        const int32_t n = static_cast<int32_t>(prompt.size());
        // The "prefill worker": the target's prompt K/V and first token, then the draft's K/V.
        auto blocks = e->kv().pool().AllocateN((n + 48 + 15) / 16);
        ASSERT_TRUE(blocks.ok());
        SeqChunk ch{prompt, 0, *blocks, true};
        ASSERT_TRUE(e->Step(std::span<const SeqChunk>(&ch, 1), &logits).ok());
        const int32_t first = static_cast<int32_t>(
            std::max_element(logits.begin(), logits.end()) - logits.begin());
        auto draft_blocks = d->engine().kv().pool().AllocateN((n + 15) / 16);
        ASSERT_TRUE(draft_blocks.ok());
        SeqChunk dch{prompt, 0, *draft_blocks, false};
        ASSERT_TRUE(d->engine().Step(std::span<const SeqChunk>(&dch, 1), &logits).ok());
        if (damaged) {
          // Random K/V over every layer of the draft's blocks.
          std::mt19937 rng(static_cast<uint32_t>(i));
          std::normal_distribution<float> g(0.0f, 2.0f);
          KvCache& kv = d->engine().kv();
          for (int32_t l = 0; l < kv.options().num_layers; ++l) {
            for (int32_t b : *draft_blocks) {
              for (uint8_t* base : {kv.k_layer(l), kv.v_layer(l)}) {
                auto* f = reinterpret_cast<float*>(base + uint64_t(b) * kv.block_bytes());
                for (uint64_t x = 0; x < kv.block_bytes() / 4; ++x) f[x] = g(rng);
              }
            }
          }
        }
        GenerationRequest r;
        r.id = std::to_string(i);
        r.prompt = prompt;
        r.sampling = jobs[i].sampling;
        r.on_event = [&got, i](const TokenEvent& ev) {
          EXPECT_TRUE(ev.status.ok()) << ev.status;
          if (ev.token >= 0) got.tokens[i].push_back(ev.token);
        };
        ASSERT_TRUE(s.SubmitPrefilled(std::move(r), std::move(*blocks), first,
                                      std::move(*draft_blocks))
                        .ok());
      }
      ASSERT_TRUE(s.RunUntilIdle().ok());
      got.stats = s.stats();
    }
    ExpectSameTokens(plain, got);
    ASSERT_GT(got.stats.spec_draft_tokens, 0);
    if (damaged) {
      EXPECT_LT(got.stats.spec_accepted_tokens, got.stats.spec_draft_tokens);
    } else {
      EXPECT_EQ(got.stats.spec_accepted_tokens, got.stats.spec_draft_tokens);
    }
    EXPECT_EQ(e->kv().pool().num_free(), e->kv().pool().num_blocks());
    EXPECT_EQ(d->num_sequences(), 0u);
    EXPECT_EQ(d->engine().kv().pool().num_free(), d->engine().kv().pool().num_blocks());
  }
}

// One-off proposals (no kept state) equal the draft model's own greedy continuation.
TEST(DraftModelTest, OneOffProposalIsTheDraftsGreedyContinuation) {
  REQUIRE_STORIES();
  auto e = MakeEngine(Stories());
  auto p = MakeSpecProposer(ModelDraft("self:q8_0", 6), *e);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->name(), "self");
  EXPECT_GT((*p)->draft_cost(), 0.2);
  EXPECT_LT((*p)->draft_cost(), 0.6) << "q8_0 matrices of an f32 model";
  auto* d = dynamic_cast<DraftModelProposer*>(p->get());
  ASSERT_NE(d, nullptr);
  const std::vector<int32_t> prompt = Stories()->tokenizer().Encode(kPrompts[0], true, false);
  std::vector<int32_t> draft;
  (*p)->Propose(prompt, 6, &draft);
  ASSERT_EQ(draft.size(), 6u);
  EXPECT_EQ(d->num_sequences(), 0u);
  EXPECT_EQ(d->engine().kv().pool().num_free(), d->engine().kv().pool().num_blocks());
  // The draft's model, decoded greedily on its own.
  Job job{prompt, Greedy(6)};
  const Outcome own = RunJobs(std::shared_ptr<const Model>(&d->engine().model(), [](const Model*) {}),
                              {job}, {});
  EXPECT_EQ(draft, own.tokens[0]);
}

TEST(DraftModelTest, GreedyOutputEqualsPlainOnStories) {
  REQUIRE_STORIES();
  const std::vector<Job> jobs = StoryJobs(*Stories(), Greedy(96));
  const Outcome plain = RunJobs(Stories(), jobs, {});
  for (const SpeculativeOptions& spec :
       {ModelDraft("self:q8_0", 4, false), ModelDraft("self:q4_0", 4, false),
        ModelDraft("self:q8_0", 4), ModelDraft("self:q4_0", 8)}) {
    const Outcome got = RunJobs(Stories(), jobs, With(spec));
    ExpectSameTokens(plain, got);
    EXPECT_EQ(got.stats.generated_tokens, plain.stats.generated_tokens);
    EXPECT_EQ(got.stats.spec_proposer_failures, 0);
    // Adaptive, 12 sequences of a model this small are priced out of drafting (a draft token
    // for each costs more than a step saves); drafting every step must save steps.
    if (spec.adaptive) continue;
    EXPECT_GT(got.stats.spec_accepted_tokens, 0);
    EXPECT_LT(got.stats.steps, plain.stats.steps) << "speculation saved no step";
  }
  // One sequence alone: the adaptive draft length drafts, and saves steps.
  const std::vector<Job> one(jobs.begin(), jobs.begin() + 1);
  const Outcome plain_one = RunJobs(Stories(), one, {});
  const Outcome adaptive_one = RunJobs(Stories(), one, With(ModelDraft("self:q8_0", 4)));
  ExpectSameTokens(plain_one, adaptive_one);
  EXPECT_GT(adaptive_one.stats.spec_accepted_tokens, 0);
  EXPECT_LT(adaptive_one.stats.steps, plain_one.stats.steps);
  // Q4_0 drafts of a 260K-parameter model are often wrong: rejections happen, and are rolled
  // back in both caches.
  const Outcome q4 = RunJobs(Stories(), jobs, With(ModelDraft("self:q4_0", 4, false)));
  EXPECT_GT(q4.stats.spec_draft_tokens, q4.stats.spec_accepted_tokens) << "no rejection";
}

TEST(DraftModelTest, SeededSamplingEqualsPlain) {
  REQUIRE_STORIES();
  SamplingParams sp = Greedy(80);
  sp.temperature = 0.8f;
  sp.top_p = 0.95f;
  std::vector<Job> jobs = StoryJobs(*Stories(), sp);
  for (size_t i = 0; i < jobs.size(); ++i) jobs[i].sampling.seed = 2000 + i;
  const Outcome plain = RunJobs(Stories(), jobs, {});
  const Outcome spec = RunJobs(Stories(), jobs, With(ModelDraft("self:q8_0", 4, false)));
  ExpectSameTokens(plain, spec);
  EXPECT_GT(spec.stats.spec_accepted_tokens, 0);
  EXPECT_GT(spec.stats.spec_draft_tokens, spec.stats.spec_accepted_tokens);
}

// draft:PATH on synthetic models: the draft is another file, the same random weights stored in
// a coarser type, so it agrees with the target often but not always.
TEST(DraftModelTest, GreedyOutputEqualsPlainOnSyntheticModels) {
  std::vector<testing::TinyModelOptions> models(3);
  models[1].arch = "qwen2";
  models[2].type = kernels::DType::kQ8_0;
  models[2].n_embd = 128;
  for (size_t mi = 0; mi < models.size(); ++mi) {
    auto model = LoadTiny(models[mi], "dsyn" + std::to_string(mi));
    testing::TinyModelOptions d = models[mi];
    d.type = mi == 2 ? kernels::DType::kQ4_0 : kernels::DType::kQ8_0;
    const std::string draft_path =
        (fs::temp_directory_path() / ("tandem-spec-draft" + std::to_string(mi) + "-" +
                                      std::to_string(getpid()) + ".gguf"))
            .string();
    ASSERT_TRUE(testing::WriteTinyModel(d, draft_path).ok());
    std::vector<Job> jobs;
    for (uint32_t i = 0; i < 10; ++i) {
      std::vector<int32_t> p = {1};
      const auto rest = testing::RandomTokens(4 + i % 7, model->config().n_vocab, 70 + i);
      p.insert(p.end(), rest.begin(), rest.end());
      jobs.push_back({p, Greedy(40)});
    }
    const Outcome plain = RunJobs(model, jobs, {});
    const Outcome spec = RunJobs(model, jobs, With(ModelDraft("draft:" + draft_path, 4, false)));
    fs::remove(draft_path);
    ExpectSameTokens(plain, spec);
    EXPECT_GT(spec.stats.spec_accepted_tokens, 0) << "model " << mi;
    EXPECT_GT(spec.stats.spec_draft_tokens, spec.stats.spec_accepted_tokens) << "model " << mi;
  }
}

// A draft must share the target's vocabulary token for token; a missing file is NOT_FOUND.
TEST(DraftModelTest, RefusesAnotherVocabularyAndMissingFiles) {
  REQUIRE_STORIES();
  auto e = MakeEngine(Stories());
  const std::string tiny = (fs::temp_directory_path() /
                            ("tandem-spec-vocab-" + std::to_string(getpid()) + ".gguf"))
                               .string();
  ASSERT_TRUE(testing::WriteTinyModel({}, tiny).ok());
  auto other = MakeSpecProposer(ModelDraft("draft:" + tiny, 4), *e);
  fs::remove(tiny);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(other.status().message().find("tokens; the target has 512"), std::string::npos)
      << other.status();
  auto missing = MakeSpecProposer(ModelDraft("draft:/nowhere/none.gguf", 4), *e);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
}

// With the prefix cache on, a finished sequence's full blocks stay in the cache under their
// hashes, which finds them again: the K/V bytes of every fed position compare exactly.
TEST(SpeculativeSchedulerTest, KvAfterRejectionsEqualsPlainRun) {
  REQUIRE_STORIES();
  const Model& m = *Stories();
  std::vector<int32_t> prompt = m.tokenizer().Encode(kPrompts[2], true, false);
  // Fed positions (prompt + max_tokens - 1) fill whole blocks.
  const int32_t bs = 16;
  const int32_t max_tokens = 6 * bs + 1 - static_cast<int32_t>(prompt.size());
  ASSERT_GT(max_tokens, 32);
  const std::vector<Job> jobs = {{prompt, Greedy(max_tokens)}};
  // Runs: plain, n-gram drafts, Q4_0 self-drafts (whose own K/V are rolled back too).
  constexpr int kRuns = 3;
  std::vector<std::vector<uint8_t>> kv[kRuns];
  SchedulerStats stats[kRuns];
  std::vector<int32_t> out[kRuns];
  for (int run = 0; run < kRuns; ++run) {
    auto e = MakeEngine(Stories());
    SchedulerOptions so = run == 0   ? SchedulerOptions{}
                          : run == 1 ? With(Ngram(4, 8, false))
                                     : With(ModelDraft("self:q4_0", 4, false));
    so.prefix_cache = true;
    auto proposer = MakeSpecProposer(so.speculative, *e);
    ASSERT_TRUE(proposer.ok()) << proposer.status();
    so.proposer = *proposer;
    Scheduler s(e.get(), so);
    GenerationRequest r;
    r.prompt = prompt;
    r.sampling = jobs[0].sampling;
    r.on_event = [&, run](const TokenEvent& ev) {
      if (ev.token >= 0) out[run].push_back(ev.token);
    };
    ASSERT_TRUE(s.Submit(std::move(r)).ok());
    ASSERT_TRUE(s.RunUntilIdle().ok());
    stats[run] = s.stats();
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), out[run].begin(), out[run].end());
    const auto hashes =
        ComputeBlockHashes(std::span<const int32_t>(all).first(6 * bs), bs, /*salt=*/0);
    const std::vector<int32_t> blocks = s.prefix_cache()->Acquire(hashes);
    ASSERT_EQ(blocks.size(), 6u) << "run " << run;
    const KvCache& kvc = e->kv();
    for (int32_t l = 0; l < m.config().n_layer; ++l) {
      for (const uint8_t* layer : {kvc.k_layer(l), kvc.v_layer(l)}) {
        for (int32_t b : blocks) {
          const uint8_t* p = layer + size_t(b) * kvc.block_bytes();
          kv[run].emplace_back(p, p + kvc.block_bytes());
        }
      }
    }
    for (int32_t b : blocks) s.prefix_cache()->Release(b);
  }
  for (int run = 1; run < kRuns; ++run) {
    SCOPED_TRACE(run == 1 ? "ngram" : "self:q4_0");
    EXPECT_EQ(out[run], out[0]);
    EXPECT_GT(stats[run].spec_draft_tokens, stats[run].spec_accepted_tokens) << "no rejection";
    EXPECT_GT(stats[run].spec_accepted_tokens, 0);
    ASSERT_EQ(kv[0].size(), kv[run].size());
    // Layer 0's K/V depend on each position's own token only (embedding, norm, one matmul row):
    // byte for byte equal. Later layers go through attention, whose kernel for a chunk of k + 1
    // rows sums in another order than the one-row decode kernel: equal to float rounding.
    double max_rel = 0;
    for (size_t i = 0; i < kv[0].size(); ++i) {
      const size_t layer = i / 12;
      if (layer == 0) {
        EXPECT_EQ(std::memcmp(kv[0][i].data(), kv[run][i].data(), kv[0][i].size()), 0)
            << "layer 0 K/V block " << i % 6 << (i / 6 % 2 ? " (V)" : " (K)");
      }
      const auto* a = reinterpret_cast<const float*>(kv[0][i].data());
      const auto* b = reinterpret_cast<const float*>(kv[run][i].data());
      double diff = 0, spread = 0;
      for (size_t j = 0; j < kv[0][i].size() / sizeof(float); ++j) {
        diff = std::max(diff, std::fabs(double(a[j]) - b[j]));
        spread = std::max(spread, std::fabs(double(a[j])));
      }
      ASSERT_GT(spread, 0.0) << "block " << i << " was never written";
      max_rel = std::max(max_rel, diff / spread);
    }
    EXPECT_LT(max_rel, 1e-5);
    RecordProperty(run == 1 ? "kv_max_relative_diff_ngram" : "kv_max_relative_diff_self",
                   std::to_string(max_rel));
    std::fprintf(stderr, "K/V after rejections (%s): max |diff| / max |value| = %.3g\n",
                 run == 1 ? "ngram" : "self:q4_0", max_rel);
  }
}

// Regularised upper incomplete gamma Q(a, x), for the chi-square p-value.
double GammaQ(double a, double x) {
  if (x <= 0) return 1.0;
  const double lg = std::lgamma(a);
  if (x < a + 1) {  // series for P
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 1000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (term < sum * 1e-15) break;
    }
    return 1.0 - sum * std::exp(-x + a * std::log(x) - lg);
  }
  // Continued fraction for Q (modified Lentz).
  double b = x + 1 - a, c = 1e300, d = 1 / b, h = d;
  for (int i = 1; i < 1000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::fabs(d) < 1e-300) d = 1e-300;
    c = b + an / c;
    if (std::fabs(c) < 1e-300) c = 1e-300;
    d = 1 / d;
    const double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1) < 1e-15) break;
  }
  return std::exp(-x + a * std::log(x) - lg) * h;
}

TEST(SpeculativeSchedulerTest, ChiSquareCannotTellSpeculativeSamplingFromPlain) {
  if (tandem::testing::kUnderTsan) {
    GTEST_SKIP() << "tens of thousands of sampled steps: over 15 min under TSan; the "
                    "scheduler's threading is covered by the other speculative tests";
  }
  EXPECT_NEAR(GammaQ(1.0, 2.0), std::exp(-2.0), 1e-12);  // df 2, chi2 4
  EXPECT_NEAR(GammaQ(5.0, 5.0), 0.4404932851, 1e-9);     // df 10, chi2 10
  REQUIRE_STORIES();
  const Model& m = *Stories();
  // A prompt whose continuation repeats it, so drafts are often right at temperature 1.
  std::vector<int32_t> prompt = m.tokenizer().Encode(
      "Lily saw a cat. Lily saw a dog. Lily saw a cat. Lily saw a dog. Lily saw a", true, false);
  // 16m + 1 tokens: the prefix cache holds all but the last, so each request computes one.
  ASSERT_GT(prompt.size(), 17u);
  prompt.resize((prompt.size() - 1) / 16 * 16 + 1);
  constexpr int kSamples = 20000, kTokens = 4;
  auto e = MakeEngine(Stories(), /*max_seqs=*/64, /*max_batch_tokens=*/512);
  // Runs: plain, n-gram drafts, and a Q8_0 self-draft (the draft model's greedy token is its
  // point-mass proposal).
  constexpr int kRuns = 3;
  std::map<std::vector<int32_t>, int64_t> counts[kRuns];
  SchedulerStats spec_stats[kRuns];
  for (int run = 0; run < kRuns; ++run) {
    // Drafting every step (not adaptive): at 64 sequences the measured cost of a draft token
    // would otherwise stop the n-gram drafts, and the test needs them judged.
    SchedulerOptions so = run == 0   ? SchedulerOptions{}
                          : run == 1 ? With(Ngram(3, 64, /*adaptive=*/false))
                                     : With(ModelDraft("self:q8_0", 3, /*adaptive=*/false));
    so.speculative.max_batch = 64;
    so.prefix_cache = true;  // the shared prompt is computed once
    std::vector<Job> jobs;
    for (int i = 0; i < kSamples; ++i) {
      SamplingParams sp = Greedy(kTokens);
      sp.temperature = 1.0f;
      sp.seed = uint64_t(run) * kSamples + i + 1;  // disjoint seeds: independent samples
      jobs.push_back({prompt, sp});
    }
    Outcome o = RunJobs(*e, jobs, so);
    for (const auto& t : o.tokens) {
      ASSERT_EQ(t.size(), size_t(kTokens));
      ++counts[run][t];
    }
    spec_stats[run] = o.stats;
  }
  for (int run = 1; run < kRuns; ++run) {
    const char* name = run == 1 ? "ngram" : "self";
    SCOPED_TRACE(name);
    EXPECT_GT(spec_stats[run].spec_accepted_tokens, kSamples / 2) << "speculation barely ran";
    EXPECT_GT(spec_stats[run].spec_draft_tokens,
              spec_stats[run].spec_accepted_tokens + kSamples / 10);
    // Two-sample chi-square over the joint outcome of the 4 tokens; outcomes seen fewer than 20
    // times in both runs together are pooled into one cell.
    std::map<std::vector<int32_t>, std::pair<int64_t, int64_t>> cells;
    for (int r : {0, run}) {
      for (const auto& [k, n] : counts[r]) (r == 0 ? cells[k].first : cells[k].second) += n;
    }
    std::vector<std::pair<double, double>> table;
    std::pair<double, double> rare{0, 0};
    for (const auto& [k, ab] : cells) {
      if (ab.first + ab.second < 20) {
        rare.first += ab.first;
        rare.second += ab.second;
      } else {
        table.emplace_back(ab.first, ab.second);
      }
    }
    if (rare.first + rare.second > 0) table.push_back(rare);
    ASSERT_GE(table.size(), 10u) << "too few outcomes for the test to mean anything";
    double chi2 = 0;
    for (const auto& [a, b] : table) {
      const double ea = (a + b) / 2, eb = (a + b) / 2;  // equal sample sizes
      chi2 += (a - ea) * (a - ea) / ea + (b - eb) * (b - eb) / eb;
    }
    const double df = double(table.size()) - 1;
    const double p = GammaQ(df / 2, chi2 / 2);
    EXPECT_GE(p, 0.01) << "chi2 " << chi2 << " on " << df << " degrees of freedom";
    RecordProperty(std::string("chi2_") + name, std::to_string(chi2));
    RecordProperty(std::string("cells_") + name, std::to_string(table.size()));
    RecordProperty(std::string("p_") + name, std::to_string(p));
    std::fprintf(stderr, "%s: chi2 %.1f on %.0f degrees of freedom, p = %.3f\n", name, chi2, df, p);
  }
}

}  // namespace
}  // namespace tandem::engine
