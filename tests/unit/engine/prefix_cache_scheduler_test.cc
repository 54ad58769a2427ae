// The scheduler with the prefix cache on: requests that reuse cached blocks produce exactly the
// tokens of a cold run, the counters say how much was reused, salts keep tenants apart, and a
// pool too small for everything evicts without changing any output.
#include <unistd.h>

#include <filesystem>
#include <map>

#include "engine/runtime/scheduler.h"
#include "gtest/gtest.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::engine {
namespace {

std::shared_ptr<const Model> TinyModel() {
  static std::shared_ptr<const Model> model = [] {
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("tandem-prefix-" + std::to_string(getpid()) + ".gguf"))
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

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<const Model> model, int32_t kv_blocks = 0,
                                   int32_t max_batch_tokens = 64) {
  EngineOptions o;
  o.threads = 2;
  o.ctx_size = 128;
  o.max_seqs = 4;
  o.kv_blocks = kv_blocks;
  o.max_batch_tokens = max_batch_tokens;
  auto e = Engine::Create(std::move(model), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}


struct Collected {
  std::vector<int32_t> tokens;
  bool finished = false;
  absl::Status status;
};

GenerationRequest Req(const std::string& id, std::vector<int32_t> prompt, SamplingParams sp,
                      std::map<std::string, Collected>* out, uint64_t salt = 0) {
  GenerationRequest r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.sampling = sp;
  r.salt = salt;
  r.on_event = [out, id](const TokenEvent& ev) {
    Collected& c = (*out)[id];
    if (ev.token >= 0) c.tokens.push_back(ev.token);
    if (ev.finished) {
      c.finished = true;
      c.status = ev.status;
    }
  };
  return r;
}

SamplingParams Greedy(int max_tokens) {
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = max_tokens;
  sp.ignore_eos = true;
  return sp;
}

SamplingParams Seeded(int max_tokens, uint64_t seed) {
  SamplingParams sp = Greedy(max_tokens);
  sp.temperature = 0.9f;
  sp.seed = seed;
  return sp;
}

using Work = std::vector<std::pair<std::vector<int32_t>, SamplingParams>>;

// Every request alone on a fresh engine without the cache: the reference.
std::vector<std::vector<int32_t>> ColdRuns(std::shared_ptr<const Model> model, const Work& w) {
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < w.size(); ++i) {
    auto e = MakeEngine(model);
    Scheduler s(e.get());
    std::map<std::string, Collected> got;
    EXPECT_TRUE(s.Submit(Req("r", w[i].first, w[i].second, &got)).ok());
    EXPECT_TRUE(s.RunUntilIdle().ok());
    out.push_back(got["r"].tokens);
  }
  return out;
}

// A long shared prefix (3 full blocks and a bit) with distinct tails.
Work SharedPrefixWork(int32_t vocab) {
  std::vector<int32_t> prefix = {1};
  for (int32_t t : testing::RandomTokens(52, vocab, 42)) prefix.push_back(t);  // 53 tokens
  Work w;
  for (int i = 0; i < 5; ++i) {
    std::vector<int32_t> p = prefix;
    for (int32_t t : testing::RandomTokens(3 + 4 * i, vocab, 100 + i)) p.push_back(t);
    w.push_back({p, i % 2 == 0 ? Greedy(10) : Seeded(10, 7 + i)});
  }
  return w;
}

TEST(PrefixCacheSchedulerTest, HitsAreTokenIdenticalToColdRuns) {
  auto model = TinyModel();
  const Work w = SharedPrefixWork(model->config().n_vocab);
  const auto cold = ColdRuns(model, w);

  auto e = MakeEngine(model, 0, /*max_batch_tokens=*/24);
  Scheduler s(e.get(), SchedulerOptions{.prefix_cache = true});
  std::map<std::string, Collected> got;
  // The first request fills the cache; the others then run together on its blocks.
  ASSERT_TRUE(s.Submit(Req("0", w[0].first, w[0].second, &got)).ok());
  ASSERT_TRUE(s.RunUntilIdle().ok());
  EXPECT_EQ(s.prefix_cache()->stats().hits, 0);
  const int64_t computed_first = s.stats().prompt_tokens;
  EXPECT_EQ(computed_first, static_cast<int64_t>(w[0].first.size()));
  for (size_t i = 1; i < w.size(); ++i) {
    ASSERT_TRUE(s.Submit(Req(std::to_string(i), w[i].first, w[i].second, &got)).ok());
  }
  ASSERT_TRUE(s.RunUntilIdle().ok());
  for (size_t i = 0; i < w.size(); ++i) {
    EXPECT_TRUE(got[std::to_string(i)].finished);
    EXPECT_EQ(got[std::to_string(i)].tokens, cold[i]) << "request " << i;
  }
  // Prompts of 56..72 tokens share 53: three full blocks of 16 each are reused by four requests.
  const PrefixCacheStats st = s.prefix_cache()->stats();
  EXPECT_EQ(st.hits, 4 * 3);
  int64_t queries = 0;
  for (const auto& [p, sp] : w) queries += (static_cast<int64_t>(p.size()) - 1) / 16;
  EXPECT_EQ(st.queries, queries);
  EXPECT_EQ(s.stats().cached_prompt_tokens, 4 * 48);
  int64_t prompt_total = 0;
  for (const auto& [p, sp] : w) prompt_total += static_cast<int64_t>(p.size());
  EXPECT_EQ(s.stats().prompt_tokens, prompt_total - 4 * 48);
  // Everything left in the pool is cached and unused, so it can all be reclaimed.
  EXPECT_EQ(e->kv().pool().num_used(), st.cached_blocks);
  EXPECT_EQ(st.reclaimable_blocks, st.cached_blocks);
  s.prefix_cache()->Clear();
  EXPECT_EQ(e->kv().pool().num_free(), e->kv().pool().num_blocks());
}

TEST(PrefixCacheSchedulerTest, WholePromptCachedStillComputesTheLastToken) {
  auto model = TinyModel();
  std::vector<int32_t> prompt = {1};
  for (int32_t t : testing::RandomTokens(47, model->config().n_vocab, 5)) prompt.push_back(t);  // 48 = 3 blocks
  const Work w = {{prompt, Greedy(6)}, {prompt, Seeded(6, 3)}};
  const auto cold = ColdRuns(model, w);
  auto e = MakeEngine(model);
  Scheduler s(e.get(), SchedulerOptions{.prefix_cache = true});
  std::map<std::string, Collected> got;
  for (int round = 0; round < 2; ++round) {
    for (size_t i = 0; i < w.size(); ++i) {
      const std::string id = std::to_string(round) + "/" + std::to_string(i);
      ASSERT_TRUE(s.Submit(Req(id, w[i].first, w[i].second, &got)).ok());
      ASSERT_TRUE(s.RunUntilIdle().ok());
      EXPECT_EQ(got[id].tokens, cold[i]) << id;
    }
  }
  // Every run after the first reuses two blocks (never the third: it holds the last token).
  EXPECT_EQ(s.prefix_cache()->stats().hits, 3 * 2);
  EXPECT_EQ(s.prefix_cache()->stats().queries, 4 * 2);
}

TEST(PrefixCacheSchedulerTest, SaltsNeverShareBlocksTheSameSaltDoes) {
  auto model = TinyModel();
  std::vector<int32_t> prompt = {1};
  for (int32_t t : testing::RandomTokens(40, model->config().n_vocab, 9)) prompt.push_back(t);  // 41 tokens
  auto e = MakeEngine(model);
  Scheduler s(e.get(), SchedulerOptions{.prefix_cache = true});
  std::map<std::string, Collected> got;
  ASSERT_TRUE(s.Submit(Req("a1", prompt, Greedy(8), &got, /*salt=*/1)).ok());
  ASSERT_TRUE(s.RunUntilIdle().ok());
  const int32_t one_tenant = s.prefix_cache()->stats().cached_blocks;
  EXPECT_EQ(one_tenant, (41 + 8 - 1) / 16);  // prompt + 7 fed-back tokens = 48 positions
  // Another tenant with the same prompt: no hit, and its own copies of every block.
  ASSERT_TRUE(s.Submit(Req("b1", prompt, Greedy(8), &got, /*salt=*/2)).ok());
  ASSERT_TRUE(s.RunUntilIdle().ok());
  EXPECT_EQ(s.prefix_cache()->stats().hits, 0);
  EXPECT_EQ(s.prefix_cache()->stats().cached_blocks, 2 * one_tenant);
  // The first tenant again: both of its prompt blocks are reused, nothing new is cached.
  ASSERT_TRUE(s.Submit(Req("a2", prompt, Greedy(8), &got, /*salt=*/1)).ok());
  ASSERT_TRUE(s.RunUntilIdle().ok());
  EXPECT_EQ(s.prefix_cache()->stats().hits, 2);
  EXPECT_EQ(s.prefix_cache()->stats().cached_blocks, 2 * one_tenant);
  EXPECT_EQ(got["a1"].tokens, got["b1"].tokens);
  EXPECT_EQ(got["a1"].tokens, got["a2"].tokens);

  // While two tenants run at once, no block is held by both.
  std::map<std::string, Collected> live;
  ASSERT_TRUE(s.Submit(Req("a3", prompt, Greedy(30), &live, 1)).ok());
  ASSERT_TRUE(s.Submit(Req("b3", prompt, Greedy(30), &live, 2)).ok());
  ASSERT_TRUE(s.Iterate().ok());
  EXPECT_EQ(s.prefix_cache()->stats().hits, 2 + 2 + 2);
  const BlockPool& pool = e->kv().pool();
  for (int32_t b = 0; b < pool.num_blocks(); ++b) {
    EXPECT_LE(pool.refcount(b), 2) << "block " << b << " is shared by both tenants";
  }
  ASSERT_TRUE(s.RunUntilIdle().ok());
}

TEST(PrefixCacheSchedulerTest, EvictionUnderPressureKeepsOutputsExact) {
  auto model = TinyModel();
  const int32_t vocab = model->config().n_vocab;
  // Three families of prompts sharing prefixes, more than the pool can keep cached.
  Work w;
  for (int fam = 0; fam < 3; ++fam) {
    std::vector<int32_t> prefix = {1};
    for (int32_t t : testing::RandomTokens(36, vocab, 1000 + fam)) prefix.push_back(t);
    for (int k = 0; k < 3; ++k) {
      std::vector<int32_t> p = prefix;
      for (int32_t t : testing::RandomTokens(5 + k, vocab, 2000 + 10 * fam + k)) p.push_back(t);
      w.push_back({p, k == 1 ? Seeded(12, 50 + k) : Greedy(12)});
    }
  }
  const auto cold = ColdRuns(model, w);
  // 14 blocks: two requests of 4 blocks each run at once and the rest must come from evictions.
  auto e = MakeEngine(model, /*kv_blocks=*/14, /*max_batch_tokens=*/32);
  Scheduler s(e.get(), SchedulerOptions{.prefix_cache = true});
  std::map<std::string, Collected> got;
  for (int round = 0; round < 2; ++round) {
    // Interleave families so the LRU churns; submit in pairs so requests also overlap.
    for (size_t j = 0; j < w.size(); j += 2) {
      for (size_t i = j; i < std::min(w.size(), j + 2); ++i) {
        const size_t idx = (i * 4) % w.size();
        const std::string id = std::to_string(round) + "/" + std::to_string(idx);
        ASSERT_TRUE(s.Submit(Req(id, w[idx].first, w[idx].second, &got)).ok());
      }
      ASSERT_TRUE(s.RunUntilIdle().ok());
    }
  }
  for (int round = 0; round < 2; ++round) {
    for (size_t i = 0; i < w.size(); ++i) {
      const std::string id = std::to_string(round) + "/" + std::to_string(i);
      EXPECT_TRUE(got[id].finished) << id;
      EXPECT_EQ(got[id].tokens, cold[i]) << id;
    }
  }
  const PrefixCacheStats st = s.prefix_cache()->stats();
  EXPECT_GT(st.evictions, 0);
  EXPECT_GT(st.hits, 0);
  EXPECT_LT(st.hits, st.queries);
  EXPECT_LE(st.cached_blocks, 14);
}

TEST(PrefixCacheSchedulerTest, CancelledSequenceLeavesItsComputedBlocksCached) {
  auto model = TinyModel();
  const int32_t vocab = model->config().n_vocab;
  // Two full blocks in common, then the prompts differ, so nothing past the shared blocks
  // (such as a freed block still holding the first prompt's K/V) can stand in for real work.
  std::vector<int32_t> common = {1};
  for (int32_t t : testing::RandomTokens(31, vocab, 77)) common.push_back(t);
  std::vector<int32_t> first = common, second = common;
  for (int32_t t : testing::RandomTokens(9, vocab, 78)) first.push_back(t);
  for (int32_t t : testing::RandomTokens(9, vocab, 79)) second.push_back(t);
  const Work w = {{second, Greedy(10)}};
  const auto cold = ColdRuns(model, w);
  auto e = MakeEngine(model);
  Scheduler s(e.get(), SchedulerOptions{.prefix_cache = true});
  std::map<std::string, Collected> got;
  ASSERT_TRUE(s.Submit(Req("x", first, Greedy(50), &got)).ok());
  ASSERT_TRUE(s.Iterate().ok());  // the 41-token prompt in one step
  s.Cancel("x");
  EXPECT_EQ(got["x"].status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(s.prefix_cache()->stats().cached_blocks, 2);
  ASSERT_TRUE(s.Submit(Req("y", second, Greedy(10), &got)).ok());
  ASSERT_TRUE(s.RunUntilIdle().ok());
  EXPECT_EQ(s.prefix_cache()->stats().hits, 2);
  EXPECT_EQ(got["y"].tokens, cold[0]);
}

TEST(PrefixCacheSchedulerTest, RealModelHitsMatchColdRuns) {
  const std::string path = std::string(TANDEM_SHARED_MODELS_DIR) + "/stories260K/stories260K.gguf";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no real model at " << path;
  auto loaded = Model::Load(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  std::shared_ptr<const Model> model(std::move(*loaded));
  const Tokenizer& tok = model->tokenizer();
  const std::string story =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "park with her friends. One day, she saw a big red ball under a tree.";
  const std::vector<std::string> tails = {" She", " Her mom said", " The ball was", " Lily ran to"};
  Work w;
  for (size_t i = 0; i < tails.size(); ++i) {
    w.push_back({tok.Encode(story + tails[i], /*add_special=*/true, /*parse_special=*/false),
                 i % 2 == 0 ? Greedy(24) : Seeded(24, 11 + i)});
  }
  ASSERT_GT(w[0].first.size(), 33u);
  const auto cold = ColdRuns(model, w);
  auto e = MakeEngine(model, 0, /*max_batch_tokens=*/20);
  Scheduler s(e.get(), SchedulerOptions{.prefix_cache = true});
  std::map<std::string, Collected> got;
  ASSERT_TRUE(s.Submit(Req("0", w[0].first, w[0].second, &got)).ok());
  ASSERT_TRUE(s.RunUntilIdle().ok());
  for (size_t i = 1; i < w.size(); ++i) {
    ASSERT_TRUE(s.Submit(Req(std::to_string(i), w[i].first, w[i].second, &got)).ok());
  }
  ASSERT_TRUE(s.RunUntilIdle().ok());
  for (size_t i = 0; i < w.size(); ++i) {
    EXPECT_EQ(got[std::to_string(i)].tokens, cold[i]) << "request " << i;
  }
  EXPECT_GE(s.prefix_cache()->stats().hits, 3 * 2);
}

}  // namespace
}  // namespace tandem::engine
