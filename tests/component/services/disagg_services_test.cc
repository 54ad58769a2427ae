// Prefill -> decode handoff through the real services: gRPC on loopback, KV over the in-process
// transport. The tokens must equal what engine::Scheduler produces in one process, every way
// a request can end must return the decode pool to its starting state, and a damaged block
// must be caught before it is decoded from.
#include <algorithm>
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/transfer/inproc/inproc_transport.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "services/common/kv_layout.h"
#include "services/common/sampling_convert.h"
#include "tests/component/services/cluster_fixture.h"

namespace tandem::testing {
namespace {

engine::SamplingParams Seeded(int max_tokens, uint64_t seed) {
  engine::SamplingParams sp;
  sp.temperature = 0.8f;
  sp.top_k = 40;
  sp.top_p = 0.95f;
  sp.seed = seed;
  sp.max_tokens = max_tokens;
  sp.ignore_eos = true;
  return sp;
}

void ExpectPoolsAtRest(TestCluster& c) {
  ASSERT_TRUE(c.WaitForDecode([](const v1::WorkerStats& s) {
    return s.running() == 0 && s.reservations() == 0 && s.kv_blocks_free() == s.kv_blocks_total();
  })) << c.DecodeStats().DebugString();
  const v1::WorkerStats p = c.PrefillStats();
  EXPECT_EQ(p.kv_blocks_free(), p.kv_blocks_total());
  EXPECT_EQ(p.running(), 0);
}

struct HandoffParam {
  std::string model;
  kernels::DType kv_type;
};
void PrintTo(const HandoffParam& p, std::ostream* os) {
  *os << p.model << (p.kv_type == kernels::DType::kF16 ? "/f16" : "/f32");
}

class HandoffTest : public ::testing::TestWithParam<HandoffParam> {
 protected:
  void SetUp() override {
    model_ = LoadTestModel(GetParam().model);
    if (model_ == nullptr) GTEST_SKIP() << GetParam().model << " is not available here";
  }
  std::shared_ptr<const engine::Model> model_;
};

TEST_P(HandoffTest, MatchesOneProcessScheduler) {
  ClusterOptions co;
  co.kv_type = GetParam().kv_type;
  TestCluster c(model_, co);
  const engine::ModelConfig& cfg = model_->config();
  const uint64_t elem = GetParam().kv_type == kernels::DType::kF16 ? 2 : 4;
  const uint64_t bytes_per_pos = 2ull * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * elem;
  int n = 0;
  // One block partly filled, exactly one block, one past it, and prompts spanning many blocks
  // (prefilled in 24-token chunks that cut blocks in the middle).
  for (int len : {1, 5, 16, 17, 47, 100, 161}) {
    for (bool seeded : {false, true}) {
      const auto prompt = TestPrompt(len, 100 + len);
      const engine::SamplingParams sp = seeded ? Seeded(20, 7 + len) : Greedy(20);
      const Generated ref = ReferenceRun(model_, GetParam().kv_type, prompt, sp);
      const Generated got = c.Generate("req-" + std::to_string(n++), prompt, sp);
      ASSERT_TRUE(got.status.ok()) << got.status.error_message();
      SCOPED_TRACE(::testing::Message() << "prompt " << len << (seeded ? " seeded" : " greedy"));
      EXPECT_EQ(got.tokens, ref.tokens);
      EXPECT_EQ(got.text, ref.text);
      EXPECT_EQ(got.reason, ref.reason);
      ASSERT_FALSE(got.tokens.empty());
      EXPECT_EQ(got.first_message_token, got.prefill.first_token_id());
      EXPECT_EQ(got.usage.prompt_tokens(), len);
      EXPECT_EQ(got.usage.completion_tokens(), static_cast<int>(got.tokens.size()));
      // The second run of a prompt finds the first's full blocks in decode's prefix cache
      // (all but the last prompt token's); those are neither sent nor checksummed again.
      EXPECT_EQ(got.held_blocks, seeded ? (len - 1) / 16 : 0);
      EXPECT_EQ(got.prefill.block_checksums_size(),
                services::BlocksFor(len, 16) - got.held_blocks);
      // Exactly the other prompt positions' K and V of every layer travelled, nothing more.
      EXPECT_EQ(got.prefill.bytes_transferred(),
                bytes_per_pos * static_cast<uint64_t>(len - 16 * got.held_blocks));
      EXPECT_EQ(got.prefill.transport().rfind("inproc", 0), 0u) << got.prefill.transport();
    }
  }
  ExpectPoolsAtRest(c);
  const v1::WorkerStats d = c.DecodeStats();
  EXPECT_EQ(d.kv_integrity_failures(), 0u);
  EXPECT_GT(d.transport_bytes_received(), 0u);
  EXPECT_EQ(c.PrefillStats().transport_bytes_written(), d.transport_bytes_received());
}

// Log-probabilities across the handoff: the first token's come from the prefill worker's
// sampler, the rest from the decode worker's, and all match one process's.
TEST_P(HandoffTest, LogprobsMatchOneProcessScheduler) {
  ClusterOptions co;
  co.kv_type = GetParam().kv_type;
  TestCluster c(model_, co);
  int n = 0;
  for (int top : {0, 5}) {
    for (bool seeded : {false, true}) {
      engine::SamplingParams sp = seeded ? Seeded(12, 40 + top) : Greedy(12);
      sp.logprobs = top;
      const auto prompt = TestPrompt(37, 5 + top);
      const Generated ref = ReferenceRun(model_, GetParam().kv_type, prompt, sp);
      const Generated got = c.Generate(absl::StrCat("lp-", n++), prompt, sp);
      ASSERT_TRUE(got.status.ok()) << got.status.error_message();
      SCOPED_TRACE(::testing::Message() << "top " << top << (seeded ? " seeded" : " greedy"));
      ASSERT_EQ(got.tokens, ref.tokens);
      ASSERT_EQ(got.logprobs.size(), got.tokens.size());
      ASSERT_EQ(ref.logprobs.size(), ref.tokens.size());
      // An F16 cache rounds K and V: the two sides' logits agree to ~1e-4 relative there.
      const double tol = GetParam().kv_type == kernels::DType::kF16 ? 2e-3 : 1e-4;
      for (size_t i = 0; i < got.tokens.size(); ++i) {
        const engine::TokenLogprobs& g = got.logprobs[i];
        const engine::TokenLogprobs& r = ref.logprobs[i];
        EXPECT_LT(g.logprob, 0.0f) << i;
        EXPECT_NEAR(g.logprob, r.logprob, tol) << i;
        ASSERT_EQ(g.top.size(), static_cast<size_t>(top)) << i;
        for (int k = 0; k < top; ++k) {
          EXPECT_EQ(g.top[k].id, r.top[k].id) << i << "/" << k;
          EXPECT_NEAR(g.top[k].logprob, r.top[k].logprob, tol) << i << "/" << k;
          if (k > 0) EXPECT_LE(g.top[k].logprob, g.top[k - 1].logprob);
        }
        // Greedy takes the most likely token.
        if (!seeded && top > 0) {
          EXPECT_EQ(g.top[0].id, got.tokens[i]);
          EXPECT_EQ(g.top[0].logprob, g.logprob);
        }
      }
    }
  }
  ExpectPoolsAtRest(c);
}

TEST_P(HandoffTest, ConcurrentRequestsMatchOneProcessScheduler) {
  ClusterOptions co;
  co.kv_type = GetParam().kv_type;
  TestCluster c(model_, co);
  const std::vector<int> lens = {70, 33, 9, 120};
  std::vector<Generated> got(lens.size()), ref(lens.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < lens.size(); ++i) {
    const engine::SamplingParams sp = i % 2 ? Seeded(16, i) : Greedy(16);
    ref[i] = ReferenceRun(model_, GetParam().kv_type, TestPrompt(lens[i], i), sp);
    threads.emplace_back(
        [&, i, sp] { got[i] = c.Generate(absl::StrCat("c", i), TestPrompt(lens[i], i), sp); });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < lens.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << i << ": " << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, ref[i].tokens) << "request " << i;
  }
  ExpectPoolsAtRest(c);
}

// Speculation on both sides of the handoff: the decode worker verifies drafts of prefilled
// sequences (n-gram, and where the model has a file, the model as its own Q8_0 draft, whose K/V
// decode computes from the prefilled tokens), and every output equals the one-process,
// non-speculative reference.
TEST_P(HandoffTest, SpeculativeDecodeMatchesOneProcessScheduler) {
  std::vector<std::string> methods = {"ngram"};
  if (std::filesystem::exists(model_->file().path())) methods.push_back("self:q8_0");
  for (const std::string& method : methods) {
    SCOPED_TRACE(method);
    ClusterOptions co;
    co.kv_type = GetParam().kv_type;
    absl::StatusOr<engine::SpeculativeOptions> spec = engine::ParseSpeculative(method, 4);
    ASSERT_TRUE(spec.ok()) << spec.status();
    co.decode_speculative = *spec;
    co.decode_speculative.max_batch = 16;
    co.decode_speculative.adaptive = false;  // draft every step, rejections included
    co.prefill_speculative = co.decode_speculative;
    TestCluster c(model_, co);
    int n = 0;
    for (int len : {5, 17, 47, 100}) {
      for (bool seeded : {false, true}) {
        // A phrase said three times: the n-gram proposer has something to draft from.
        std::vector<int32_t> prompt = {1};
        const auto phrase = TestPrompt(len / 3 + 2, 300 + len);
        for (int r = 0; r < 3; ++r) prompt.insert(prompt.end(), phrase.begin() + 1, phrase.end());
        const engine::SamplingParams sp = seeded ? Seeded(24, 9 + len) : Greedy(24);
        const Generated ref = ReferenceRun(model_, GetParam().kv_type, prompt, sp);
        const Generated got = c.Generate("spec-" + std::to_string(n++), prompt, sp);
        ASSERT_TRUE(got.status.ok()) << got.status.error_message();
        EXPECT_EQ(got.tokens, ref.tokens)
            << "prompt " << prompt.size() << (seeded ? " seeded" : "");
      }
    }
    ExpectPoolsAtRest(c);
  }
}

// A draft model's prompt K/V: computed by prefill beside the target's and written in the same
// transfer (the default), or computed by decode (--draft-kv decode on both), or asked for by
// decode from a prefill that has no draft (it then sends none and decode computes them). Every
// way gives the reference's tokens, the draft's blocks travel exactly when they should, and
// both draft pools end empty.
TEST_P(HandoffTest, DraftKvIsSentWithTheTargetsOrComputedOnDecode) {
  if (!std::filesystem::exists(model_->file().path())) GTEST_SKIP() << "no model file";
  struct Mode {
    const char* name;
    bool decode_asks;
    bool prefill_has_draft;
  };
  const engine::ModelConfig& cfg = model_->config();
  const uint64_t elem = GetParam().kv_type == kernels::DType::kF16 ? 2 : 4;
  // self:q8_0 has the target's shape, so its K/V are as many bytes again.
  const uint64_t bytes_per_pos = 2ull * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * elem;
  for (const Mode& mode : {Mode{"prefill", true, true}, Mode{"decode", false, false},
                           Mode{"no draft on prefill", true, false}}) {
    SCOPED_TRACE(mode.name);
    ClusterOptions co;
    co.kv_type = GetParam().kv_type;
    co.decode_speculative = *engine::ParseSpeculative("self:q8_0", 4);
    co.decode_speculative.adaptive = false;  // draft every step
    co.prefill_speculative = co.decode_speculative;
    co.decode_draft_kv = mode.decode_asks;
    co.prefill_draft_kv = mode.prefill_has_draft;
    TestCluster c(model_, co);
    int n = 0;
    for (int len : {3, 16, 40, 97}) {
      std::vector<int32_t> prompt = {1};
      const auto phrase = TestPrompt(len / 2 + 1, 500 + len);
      for (int r = 0; r < 2; ++r) prompt.insert(prompt.end(), phrase.begin() + 1, phrase.end());
      const engine::SamplingParams sp = Greedy(20);
      const Generated ref = ReferenceRun(model_, GetParam().kv_type, prompt, sp);
      const Generated got = c.Generate(absl::StrCat("draft-kv-", n++), prompt, sp);
      ASSERT_TRUE(got.status.ok()) << got.status.error_message();
      const int64_t blocks = services::BlocksFor(static_cast<int64_t>(prompt.size()), 16);
      EXPECT_EQ(got.tokens, ref.tokens) << "prompt " << prompt.size();
      EXPECT_GT(got.usage.spec_verify_steps(), 0);
      EXPECT_GE(got.usage.spec_draft_tokens(), got.usage.spec_accepted_tokens());
      if (mode.decode_asks && mode.prefill_has_draft) {
        EXPECT_EQ(got.prefill.draft_block_checksums_size(), blocks);
        EXPECT_GT(got.prefill.draft_compute_seconds(), 0);
        EXPECT_EQ(got.prefill.bytes_transferred(), 2 * bytes_per_pos * prompt.size());
      } else {
        EXPECT_EQ(got.prefill.draft_block_checksums_size(), 0);
        EXPECT_EQ(got.prefill.bytes_transferred(), bytes_per_pos * prompt.size());
      }
    }
    ExpectPoolsAtRest(c);
    EXPECT_EQ(c.DecodeStats().kv_integrity_failures(), 0u);
    // Draft blocks of claimed reservations go to their sequences (or, unsent, to a short
    // quarantine): all back once it has passed.
    absl::SleepFor(co.decode_quarantine + absl::Milliseconds(200));
    absl::StatusOr<int32_t> in_use = c.decode->DraftBlocksInUse();
    ASSERT_TRUE(in_use.ok()) << in_use.status();
    EXPECT_EQ(*in_use, 0);
    EXPECT_EQ(c.prefill->draft_blocks_in_use(), 0);
  }
}

// A draft block that arrives damaged is never proposed from: decode counts the integrity
// failure, computes the draft's K/V itself, and the output is still the reference's.
TEST_P(HandoffTest, DamagedDraftKvIsRecomputedNotUsed) {
  if (!std::filesystem::exists(model_->file().path())) GTEST_SKIP() << "no model file";
  ClusterOptions co;
  co.kv_type = GetParam().kv_type;
  co.decode_speculative = *engine::ParseSpeculative("self:q8_0", 4);
  co.decode_speculative.adaptive = false;
  co.prefill_speculative = co.decode_speculative;
  TestCluster c(model_, co);
  const std::vector<int32_t> prompt = TestPrompt(40, 77);
  const engine::SamplingParams sp = Greedy(16);
  const Generated ref = ReferenceRun(model_, GetParam().kv_type, prompt, sp);
  absl::StatusOr<v1::ReserveResponse> r = c.Reserve("bad-draft", prompt.size(), sp.max_tokens);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->destination().has_draft());
  v1::PrefillRequest preq;
  preq.set_request_id("bad-draft");
  preq.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
  *preq.mutable_sampling() = services::SamplingToProto(sp);
  *preq.mutable_destination() = r->destination();
  v1::PrefillResponse presp;
  ASSERT_TRUE(c.Prefill(preq, &presp).ok());
  ASSERT_EQ(presp.draft_block_checksums_size(), 3);
  v1::DecodeRequest dr;
  dr.set_request_id("bad-draft");
  dr.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
  *dr.mutable_sampling() = services::SamplingToProto(sp);
  dr.set_first_token_id(presp.first_token_id());
  *dr.mutable_block_checksums() = presp.block_checksums();
  *dr.mutable_draft_block_checksums() = presp.draft_block_checksums();
  dr.set_draft_block_checksums(1, presp.draft_block_checksums(1) ^ 1);
  const Generated got = c.Decode(dr);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, ref.tokens);
  EXPECT_GT(got.usage.spec_verify_steps(), 0);
  EXPECT_EQ(c.DecodeStats().kv_integrity_failures(), 1u);
  ExpectPoolsAtRest(c);
  absl::SleepFor(co.decode_quarantine + absl::Milliseconds(200));
  absl::StatusOr<int32_t> in_use = c.decode->DraftBlocksInUse();
  ASSERT_TRUE(in_use.ok()) << in_use.status();
  EXPECT_EQ(*in_use, 0);
}

INSTANTIATE_TEST_SUITE_P(Models, HandoffTest,
                         ::testing::Values(HandoffParam{"tiny", kernels::DType::kF32},
                                           HandoffParam{"tiny", kernels::DType::kF16},
                                           HandoffParam{"stories260K", kernels::DType::kF32},
                                           // MoE: experts, and gpt-oss's window and sinks.
                                           HandoffParam{"tiny-qwen3moe", kernels::DType::kF32},
                                           HandoffParam{"tiny-gpt-oss", kernels::DType::kF16}),
                         [](const auto& info) {
                           std::string name = info.param.model;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name +
                                  (info.param.kv_type == kernels::DType::kF16 ? "_f16" : "_f32");
                         });

class ServicesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = LoadTestModel("tiny");
    ASSERT_NE(model_, nullptr);
  }

  // Reserve and prefill, stopping before Decode.
  v1::DecodeRequest Prefilled(TestCluster& c, const std::string& id,
                              const std::vector<int32_t>& prompt, const engine::SamplingParams& sp,
                              v1::ReserveResponse* reservation = nullptr) {
    absl::StatusOr<v1::ReserveResponse> r =
        c.Reserve(id, static_cast<int>(prompt.size()), sp.max_tokens);
    EXPECT_TRUE(r.ok()) << r.status();
    if (reservation != nullptr) *reservation = *r;
    v1::PrefillRequest pr;
    pr.set_request_id(id);
    for (int32_t t : prompt) pr.add_prompt_token_ids(t);
    *pr.mutable_sampling() = services::SamplingToProto(sp);
    *pr.mutable_destination() = r->destination();
    v1::PrefillResponse presp;
    grpc::Status st = c.Prefill(pr, &presp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    v1::DecodeRequest dr;
    dr.set_request_id(id);
    *dr.mutable_prompt_token_ids() = pr.prompt_token_ids();
    *dr.mutable_sampling() = pr.sampling();
    dr.set_first_token_id(presp.first_token_id());
    *dr.mutable_block_checksums() = presp.block_checksums();
    return dr;
  }

  std::shared_ptr<const engine::Model> model_;
};

TEST_F(ServicesTest, CorruptedBlockIsDataLossAndQuarantinesTheBlocks) {
  TestCluster c(model_);
  const v1::WorkerStats at_rest = c.DecodeStats();
  const auto prompt = TestPrompt(40, 3);  // blocks 0, 1 full; block 2 holds 8 positions
  v1::ReserveResponse res;
  v1::DecodeRequest dr = Prefilled(c, "bad", prompt, Greedy(8), &res);
  EXPECT_EQ(c.DecodeStats().reservations(), 1);
  // One bit of one V value of the last layer, in the middle block, after the transfer.
  const int32_t victim = res.destination().block_ids(1);
  ASSERT_TRUE(c.decode
                  ->RunOnEngineThread([&](engine::Engine& e) {
                    engine::KvCache& kv = e.kv();
                    kv.v_layer(kv.options().num_layers - 1)[victim * kv.block_bytes() + 37] ^= 0x10;
                  })
                  .ok());
  const Generated g = c.Decode(dr);
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::DATA_LOSS) << g.status.error_message();
  EXPECT_NE(g.status.error_message().find("checksum"), std::string::npos);
  EXPECT_TRUE(g.tokens.empty());
  const v1::WorkerStats s = c.DecodeStats();
  EXPECT_EQ(s.kv_integrity_failures(), 1u);
  EXPECT_EQ(s.reservations(), 0);
  EXPECT_EQ(s.running(), 0);
  // The reservation is gone: a retry with the same id is NOT_FOUND, not a decode of bad KV.
  EXPECT_EQ(c.Decode(dr).status.error_code(), grpc::StatusCode::NOT_FOUND);
  // The blocks come back after the quarantine.
  ASSERT_TRUE(c.WaitForDecode([&](const v1::WorkerStats& s) {
    return s.kv_blocks_free() == at_rest.kv_blocks_free();
  })) << c.DecodeStats().DebugString();

  // Damage past the prompt's last position is not part of what prefill sent: still fine.
  v1::DecodeRequest ok = Prefilled(c, "fine", prompt, Greedy(8), &res);
  const int32_t last = res.destination().block_ids(2);
  ASSERT_TRUE(c.decode
                  ->RunOnEngineThread([&](engine::Engine& e) {
                    engine::KvCache& kv = e.kv();
                    const size_t slot_bytes = kv.slot_elems() * kv.elem_bytes();
                    kv.k_layer(0)[last * kv.block_bytes() + 8 * slot_bytes] ^= 0x10;
                  })
                  .ok());
  const Generated good = c.Decode(ok);
  EXPECT_TRUE(good.status.ok()) << good.status.error_message();
  EXPECT_EQ(good.tokens, ReferenceRun(model_, kernels::DType::kF32, prompt, Greedy(8)).tokens);
  EXPECT_EQ(c.DecodeStats().kv_integrity_failures(), 1u);
  ExpectPoolsAtRest(c);
}

TEST_F(ServicesTest, ExpiredReservationFreesItsBlocksAfterTheQuarantine) {
  TestCluster c(model_);
  const v1::WorkerStats at_rest = c.DecodeStats();
  const absl::Time t0 = absl::Now();
  absl::StatusOr<v1::ReserveResponse> r = c.Reserve("late", 50, 30, /*lease_ms=*/200);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->destination().block_ids_size(), 4);  // the prompt's blocks
  EXPECT_NEAR(static_cast<double>(r->lease_expires_unix_ms()),
              static_cast<double>(absl::ToUnixMillis(t0 + absl::Milliseconds(200))), 150.0);
  const v1::WorkerStats held = c.DecodeStats();
  EXPECT_EQ(held.reservations(), 1);
  EXPECT_EQ(held.kv_blocks_free(), at_rest.kv_blocks_free() - 5);  // 80 positions
  ASSERT_TRUE(c.WaitForDecode([&](const v1::WorkerStats& s) {
    return s.reservations() == 0 && s.kv_blocks_free() == at_rest.kv_blocks_free();
  }));
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(190 + 100));  // lease + quarantine
  v1::DecodeRequest dr;
  dr.set_request_id("late");
  for (int i = 0; i < 50; ++i) dr.add_prompt_token_ids(5);
  dr.add_block_checksums(1);
  EXPECT_EQ(c.Decode(dr).status.error_code(), grpc::StatusCode::NOT_FOUND);
}

v1::PrefillRequest PrefillFor(const std::string& id, const std::vector<int32_t>& prompt,
                              const engine::SamplingParams& sp, const v1::KvDestination& dst) {
  v1::PrefillRequest pr;
  pr.set_request_id(id);
  for (int32_t t : prompt) pr.add_prompt_token_ids(t);
  *pr.mutable_sampling() = services::SamplingToProto(sp);
  *pr.mutable_destination() = dst;
  return pr;
}

v1::DecodeRequest DecodeFor(const v1::PrefillRequest& pr, const v1::PrefillResponse& presp) {
  v1::DecodeRequest dr;
  dr.set_request_id(pr.request_id());
  *dr.mutable_prompt_token_ids() = pr.prompt_token_ids();
  *dr.mutable_sampling() = pr.sampling();
  dr.set_first_token_id(presp.first_token_id());
  *dr.mutable_block_checksums() = presp.block_checksums();
  return dr;
}

// A prefill still writing when its reservation's lease runs out must not write into another
// request's KV: the blocks stay out of the pool for the quarantine, the late completion is
// refused without looking at them, and afterwards they are handed out again.
TEST_F(ServicesTest, ExpiredReservationIsQuarantinedAgainstALatePrefill) {
  absl::Notification entered, release;
  std::atomic<bool> first{true};
  ClusterOptions co;
  co.decode_kv_blocks = 12;
  // Long enough that the steps below finish inside it even on a loaded machine.
  co.decode_quarantine = absl::Milliseconds(2500);
  co.prefill_before_step = [&] {
    if (first.exchange(false)) {
      entered.Notify();
      release.WaitForNotification();
    }
  };
  TestCluster c(model_, co);
  const v1::WorkerStats at_rest = c.DecodeStats();
  ASSERT_EQ(at_rest.kv_blocks_free(), 12);
  const engine::SamplingParams sp = Greedy(20);  // 60 + 20 positions: 5 blocks
  const std::vector<int32_t> slow_prompt = TestPrompt(60, 21), next_prompt = TestPrompt(60, 22);

  const absl::Time t0 = absl::Now();
  absl::StatusOr<v1::ReserveResponse> slow = c.Reserve("slow", 60, 20, /*lease_ms=*/150);
  ASSERT_TRUE(slow.ok()) << slow.status();
  // A prefill that does not know the lease (the field cleared), so it keeps writing after it:
  // the quarantine alone must protect the blocks. (PrefillStopsWritingWhenTheLeaseRunsOut
  // covers a prefill that knows it.)
  v1::KvDestination no_lease = slow->destination();
  no_lease.clear_lease_expires_unix_ms();
  const v1::PrefillRequest slow_pr = PrefillFor("slow", slow_prompt, sp, no_lease);
  grpc::Status slow_st;
  v1::PrefillResponse slow_resp;
  std::thread writer([&] { slow_st = c.Prefill(slow_pr, &slow_resp); });
  entered.WaitForNotification();  // the prefill holds its engine before its first write

  // The lease runs out: the reservation is gone but its blocks are not free.
  ASSERT_TRUE(c.WaitForDecode([](const v1::WorkerStats& s) { return s.reservations() == 0; }));
  EXPECT_EQ(c.DecodeStats().kv_blocks_free(), 12 - 5);
  // A new request is given other blocks, and what is left cannot hold a third.
  absl::StatusOr<v1::ReserveResponse> next = c.Reserve("next", 60, 20);
  ASSERT_TRUE(next.ok()) << next.status();
  for (int32_t b : next->destination().block_ids()) {
    for (int32_t q : slow->destination().block_ids()) EXPECT_NE(b, q);
  }
  EXPECT_EQ(c.Reserve("third", 60, 20).status().code(), absl::StatusCode::kResourceExhausted);

  // The slow prefill now writes its whole prompt into the quarantined blocks.
  release.Notify();
  writer.join();
  ASSERT_TRUE(slow_st.ok()) << slow_st.error_message();
  // Its completion is refused, naming why, without reading the blocks: a checksum pass over
  // them would have counted an integrity failure for these wrong checksums.
  v1::DecodeRequest late = DecodeFor(slow_pr, slow_resp);
  for (int i = 0; i < late.block_checksums_size(); ++i) late.set_block_checksums(i, 12345);
  const Generated refused = c.Decode(late);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(refused.status.error_message().find("expired"), std::string::npos)
      << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("quarantined"), std::string::npos);
  EXPECT_TRUE(refused.tokens.empty());
  EXPECT_EQ(c.DecodeStats().kv_integrity_failures(), 0u);
  EXPECT_EQ(c.DecodeStats().kv_blocks_free(), 12 - 5 - 5);  // still quarantined

  // The other request's KV was not touched by the late writes.
  const v1::PrefillRequest next_pr = PrefillFor("next", next_prompt, sp, next->destination());
  v1::PrefillResponse next_resp;
  ASSERT_TRUE(c.Prefill(next_pr, &next_resp).ok());
  const Generated g = c.Decode(DecodeFor(next_pr, next_resp));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.tokens, ReferenceRun(model_, kernels::DType::kF32, next_prompt, sp).tokens);

  // After the quarantine every block is free again, and the old ones are handed out.
  ASSERT_TRUE(c.WaitForDecode([](const v1::WorkerStats& s) {
    return s.running() == 0 && s.reservations() == 0 && s.kv_blocks_free() == 12;
  })) << c.DecodeStats().DebugString();
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(150 + 2500));
  absl::StatusOr<v1::ReserveResponse> all = c.Reserve("all", 100, 92);  // 12 blocks
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(c.DecodeStats().kv_blocks_free(), 0);
}

TEST_F(ServicesTest, PrefillStopsWritingWhenTheLeaseRunsOut) {
  absl::Notification entered, release;
  std::atomic<bool> first{true};
  ClusterOptions co;
  co.decode_kv_blocks = 12;
  co.prefill_before_step = [&] {
    if (first.exchange(false)) {
      entered.Notify();
      release.WaitForNotification();
    }
  };
  TestCluster c(model_, co);
  const engine::SamplingParams sp = Greedy(20);
  absl::StatusOr<v1::ReserveResponse> r = c.Reserve("slow", 60, 20, /*lease_ms=*/150);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->destination().lease_expires_unix_ms(), r->lease_expires_unix_ms());
  EXPECT_GT(r->destination().lease_expires_unix_ms(), 0u);
  const v1::PrefillRequest pr = PrefillFor("slow", TestPrompt(60, 23), sp, r->destination());
  grpc::Status st;
  v1::PrefillResponse resp;
  std::thread writer([&] { st = c.Prefill(pr, &resp); });
  entered.WaitForNotification();
  ASSERT_TRUE(c.WaitForDecode([](const v1::WorkerStats& s) { return s.reservations() == 0; }));
  release.Notify();
  writer.join();
  // Its first layer would be written after the lease: nothing is written, the request fails.
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_NE(st.error_message().find("lease"), std::string::npos) << st.error_message();

  // A prefill that arrives after the lease is refused before it computes anything.
  absl::StatusOr<v1::ReserveResponse> gone = c.Reserve("gone", 60, 20, /*lease_ms=*/50);
  ASSERT_TRUE(gone.ok()) << gone.status();
  absl::SleepFor(absl::Milliseconds(80));
  v1::PrefillResponse late_resp;
  const grpc::Status late =
      c.Prefill(PrefillFor("gone", TestPrompt(60, 24), sp, gone->destination()), &late_resp);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << late.error_message();
}

// Turn 2 of a conversation: decode holds turn 1's full blocks (its prompt and all but the last
// generated token, never fed back), prefill writes and checksums only the rest, and the tokens
// are a one-process run's of the whole conversation. Another salt (tenant) shares nothing. A
// third turn's reservation, cancelled, gives its held blocks back to the cache (they are held
// again by the next reservation) and quarantines only its own; the pool ends at rest with no
// invariant violated.
TEST_F(ServicesTest, ALaterTurnReusesTheBlocksDecodeHoldsAndACancelGivesThemBack) {
  TestCluster c(model_);
  const v1::WorkerStats at_rest = c.DecodeStats();
  engine::SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 20;
  sp.ignore_eos = true;
  auto more = [](std::vector<int32_t> conversation, const std::vector<int32_t>& reply,
                 uint32_t seed) {
    conversation.insert(conversation.end(), reply.begin(), reply.end());
    const std::vector<int32_t> user = TestPrompt(13, seed);  // BOS, then 12 tokens
    conversation.insert(conversation.end(), user.begin() + 1, user.end());
    return conversation;
  };
  const std::vector<int32_t> p1 = TestPrompt(40, 7);
  const Generated t1 = c.Generate("turn-1", p1, sp, /*salt=*/5);
  ASSERT_TRUE(t1.status.ok()) << t1.status.error_message();
  EXPECT_EQ(t1.held_blocks, 0);
  ASSERT_EQ(t1.tokens.size(), 20u);

  const std::vector<int32_t> p2 = more(p1, t1.tokens, 8);
  const Generated t2 = c.Generate("turn-2", p2, sp, /*salt=*/5);
  ASSERT_TRUE(t2.status.ok()) << t2.status.error_message();
  const int bs = 16;  // the engine's default block size (checked on turn 3's destination)
  EXPECT_EQ(t2.held_blocks, (40 + 20 - 1) / bs);
  EXPECT_EQ(t2.prefill.block_checksums_size(),
            static_cast<int>(p2.size() + bs - 1) / bs - t2.held_blocks);
  const Generated ref = ReferenceRun(model_, kernels::DType::kF32, p2, sp);
  ASSERT_TRUE(ref.status.ok());
  EXPECT_EQ(t2.tokens, ref.tokens);
  const Generated other = c.Generate("other-tenant", p2, sp, /*salt=*/6);
  ASSERT_TRUE(other.status.ok()) << other.status.error_message();
  EXPECT_EQ(other.held_blocks, 0);
  EXPECT_EQ(other.tokens, ref.tokens);

  const std::vector<int32_t> p3 = more(p2, t2.tokens, 9);
  const int n3 = static_cast<int>(p3.size());
  absl::StatusOr<v1::ReserveResponse> r3 = c.Reserve("turn-3", n3, 20, 10000, &p3, 5);
  ASSERT_TRUE(r3.ok()) << r3.status();
  ASSERT_EQ(r3->destination().block_size(), bs);
  const int32_t held3 = r3->destination().held_blocks();
  EXPECT_EQ(held3, (static_cast<int>(p2.size()) + 20 - 1) / bs);
  EXPECT_TRUE(c.CancelOnDecode("turn-3"));
  absl::StatusOr<v1::ReserveResponse> again = c.Reserve("turn-3-again", n3, 20, 10000, &p3, 5);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->destination().held_blocks(), held3);
  EXPECT_TRUE(c.CancelOnDecode("turn-3-again"));
  // Back at rest once the quarantine ends: cached blocks count as free.
  ASSERT_TRUE(c.WaitForDecode([&](const v1::WorkerStats& s) {
    return s.reservations() == 0 && s.kv_blocks_free() == at_rest.kv_blocks_free();
  }));
  uint64_t violations = 1;
  ASSERT_TRUE(c.decode
                  ->RunOnEngineThread([&](engine::Engine& e) {
                    violations = e.kv().pool().violations();
                  })
                  .ok());
  EXPECT_EQ(violations, 0u);
  EXPECT_GT(c.DecodeStats().prefix_cache_hit_blocks(), 0u);
}

TEST_F(ServicesTest, CancelledReservationIsQuarantinedThenFreed) {
  ClusterOptions co;
  co.decode_quarantine = absl::Milliseconds(400);
  TestCluster c(model_, co);
  const v1::WorkerStats at_rest = c.DecodeStats();
  ASSERT_TRUE(c.Reserve("gone", 40, 8).ok());  // 3 blocks
  const absl::Time cancelled = absl::Now();
  EXPECT_TRUE(c.CancelOnDecode("gone"));
  const v1::WorkerStats held = c.DecodeStats();
  EXPECT_EQ(held.reservations(), 0);
  if (absl::Now() - cancelled < absl::Milliseconds(300)) {  // a loaded machine may be slower
    EXPECT_EQ(held.kv_blocks_free(), at_rest.kv_blocks_free() - 3);
  }
  v1::DecodeRequest dr;
  dr.set_request_id("gone");
  for (int32_t t : TestPrompt(40, 1)) dr.add_prompt_token_ids(t);
  for (int i = 0; i < 3; ++i) dr.add_block_checksums(i);
  const Generated g = c.Decode(dr);
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(g.status.error_message().find("cancelled"), std::string::npos)
      << g.status.error_message();
  ASSERT_TRUE(c.WaitForDecode(
      [&](const v1::WorkerStats& s) { return s.kv_blocks_free() == at_rest.kv_blocks_free(); }));
  EXPECT_GE(absl::Now() - cancelled, absl::Milliseconds(400));
  EXPECT_EQ(c.DecodeStats().kv_integrity_failures(), 0u);
}

// Decode slowed to >= 5 ms per step, so a 200-token stream is still running when the client
// acts, and "finished on its own" cannot pass for "cancelled".
ClusterOptions SlowDecode(std::atomic<int>* steps) {
  ClusterOptions co;
  co.before_step = [steps] {
    steps->fetch_add(1);
    absl::SleepFor(absl::Milliseconds(5));
  };
  return co;
}

TEST_F(ServicesTest, ClientCancelMidStreamFreesTheBlocks) {
  std::atomic<int> steps{0};
  TestCluster c(model_, SlowDecode(&steps));
  const v1::WorkerStats at_rest = c.DecodeStats();
  v1::DecodeRequest dr = Prefilled(c, "bored", TestPrompt(30, 4), Greedy(200));
  grpc::ClientContext ctx;
  auto reader = c.decode_stub->Decode(&ctx, dr);
  v1::GenerateResponse msg;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&msg));
  EXPECT_FALSE(msg.finished());
  EXPECT_EQ(c.DecodeStats().running(), 1);
  ctx.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(c.WaitForDecode([&](const v1::WorkerStats& s) {
    return s.running() == 0 && s.kv_blocks_free() == at_rest.kv_blocks_free();
  }));
  EXPECT_LT(steps.load(), 150) << "the sequence ran on after the client left";
}

TEST_F(ServicesTest, DeadlineMidStreamFreesTheBlocks) {
  std::atomic<int> steps{0};
  TestCluster c(model_, SlowDecode(&steps));
  const v1::WorkerStats at_rest = c.DecodeStats();
  v1::DecodeRequest dr = Prefilled(c, "slow", TestPrompt(30, 5), Greedy(200));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(150));
  auto reader = c.decode_stub->Decode(&ctx, dr);
  v1::GenerateResponse msg;
  int n = 0;
  while (reader->Read(&msg)) ++n;
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LT(n, 200);
  ASSERT_TRUE(c.WaitForDecode([&](const v1::WorkerStats& s) {
    return s.running() == 0 && s.kv_blocks_free() == at_rest.kv_blocks_free();
  }));
}

TEST_F(ServicesTest, CancelRpcEndsTheStreamAsCancelled) {
  std::atomic<int> steps{0};
  TestCluster c(model_, SlowDecode(&steps));
  const v1::WorkerStats at_rest = c.DecodeStats();
  v1::DecodeRequest dr = Prefilled(c, "stopme", TestPrompt(30, 6), Greedy(200));
  grpc::ClientContext ctx;
  auto reader = c.decode_stub->Decode(&ctx, dr);
  v1::GenerateResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  EXPECT_TRUE(c.CancelOnDecode("stopme"));
  int n = 1;
  bool finished = false;
  while (reader->Read(&msg)) {
    ++n;
    if (msg.finished()) {
      finished = true;
      EXPECT_EQ(msg.finish_reason(), v1::FINISH_REASON_CANCELLED);
    }
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(finished);
  EXPECT_LT(n, 150);
  const v1::WorkerStats s = c.DecodeStats();
  EXPECT_EQ(s.running(), 0);
  EXPECT_EQ(s.kv_blocks_free(), at_rest.kv_blocks_free());
  // Cancelling a reservation frees it too; an unknown id is reported as such.
  ASSERT_TRUE(c.Reserve("unused", 10, 10).ok());
  EXPECT_TRUE(c.CancelOnDecode("unused"));
  EXPECT_EQ(c.DecodeStats().reservations(), 0);
  EXPECT_FALSE(c.CancelOnDecode("nobody"));
}

TEST_F(ServicesTest, ColocatedRequestMatchesOneProcessScheduler) {
  TestCluster c(model_);
  for (int len : {3, 40, 130}) {
    const auto prompt = TestPrompt(len, 9);
    const engine::SamplingParams sp = Seeded(12, len);
    v1::DecodeRequest dr;
    dr.set_request_id("local-" + std::to_string(len));
    for (int32_t t : prompt) dr.add_prompt_token_ids(t);
    *dr.mutable_sampling() = services::SamplingToProto(sp);
    dr.set_prefill_locally(true);
    const Generated g = c.Decode(dr);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    const Generated ref = ReferenceRun(model_, kernels::DType::kF32, prompt, sp);
    EXPECT_EQ(g.tokens, ref.tokens);
    EXPECT_EQ(g.text, ref.text);
    EXPECT_EQ(g.reason, v1::FINISH_REASON_LENGTH);
  }
  ExpectPoolsAtRest(c);
}

// Decode admission by time per output token, in the real worker: once its step-cost fit has
// seen enough steps, a request that its batch (here one held reservation) would be predicted to
// step too slowly for is refused RESOURCE_EXHAUSTED, holding nothing; a reachable target, or
// none, is admitted; and a colocated request is checked the same way.
TEST_F(ServicesTest, DecodeRefusesARequestItsBatchWouldServeTooSlowly) {
  TestCluster c(model_);
  const auto prompt = TestPrompt(8, 3);
  v1::DecodeRequest warm;  // fits the cost model: one engine step per token
  warm.set_request_id("warm");
  for (int32_t t : prompt) warm.add_prompt_token_ids(t);
  *warm.mutable_sampling() = services::SamplingToProto(Seeded(48, 5));
  warm.set_prefill_locally(true);
  ASSERT_TRUE(c.Decode(warm).status.ok());
  ASSERT_TRUE(c.Reserve("held", 8, 8).ok());
  const int32_t free_before = c.DecodeStats().kv_blocks_free();

  auto reserve = [&](const std::string& id, double tpot_target_s) {
    grpc::ClientContext ctx;
    v1::ReserveRequest rq;
    rq.set_request_id(id);
    rq.set_prompt_tokens(8);
    rq.set_max_tokens(8);
    rq.set_tpot_target_s(tpot_target_s);
    v1::ReserveResponse resp;
    return c.decode_stub->Reserve(&ctx, rq, &resp);
  };
  // No step of any model takes a microsecond.
  const grpc::Status refused = reserve("tight", 1e-6);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("per output token"), std::string::npos)
      << refused.error_message();
  EXPECT_EQ(c.DecodeStats().kv_blocks_free(), free_before) << "a refusal holds no blocks";
  EXPECT_EQ(reserve("bad", -1).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(reserve("loose", 10.0).ok());
  EXPECT_TRUE(reserve("none", 0).ok());

  v1::DecodeRequest local = warm;
  local.set_request_id("local-tight");
  local.set_tpot_target_s(1e-6);
  EXPECT_EQ(c.Decode(local).status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  local.set_request_id("local-loose");
  local.set_tpot_target_s(10.0);
  EXPECT_TRUE(c.Decode(local).status.ok());
}

TEST_F(ServicesTest, RefusesWhatCannotBeServed) {
  TestCluster c(model_);
  const auto prompt = TestPrompt(40, 1);
  absl::StatusOr<v1::ReserveResponse> r = c.Reserve("x", 40, 8);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(c.Reserve("x", 40, 8).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(c.Reserve("huge", 200, 100).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Reserve("zero", 0, 8).status().code(), absl::StatusCode::kInvalidArgument);

  v1::PrefillRequest pr;
  pr.set_request_id("x");
  for (int32_t t : prompt) pr.add_prompt_token_ids(t);
  *pr.mutable_destination() = r->destination();
  v1::PrefillResponse presp;
  {
    v1::PrefillRequest bad = pr;
    bad.mutable_destination()->set_head_dim(r->destination().head_dim() * 2);
    grpc::Status st = c.Prefill(bad, &presp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_NE(st.error_message().find("head_dim"), std::string::npos);
  }
  {
    v1::PrefillRequest bad = pr;
    bad.mutable_destination()->mutable_block_ids()->RemoveLast();
    EXPECT_EQ(c.Prefill(bad, &presp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    v1::PrefillRequest bad = pr;
    bad.mutable_destination()->set_region("not a descriptor");
    EXPECT_EQ(c.Prefill(bad, &presp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    v1::PrefillRequest bad = pr;
    bad.mutable_destination()->set_block_ids(0, 1 << 20);  // outside the region
    EXPECT_EQ(c.Prefill(bad, &presp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    v1::PrefillRequest bad = pr;
    bad.mutable_sampling()->set_top_p(2.0f);
    grpc::Status st = c.Prefill(bad, &presp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("top_p"), std::string::npos) << st.error_message();
  }
  {
    v1::PrefillRequest bad = pr;
    bad.set_prompt_token_ids(3, 1 << 20);
    EXPECT_EQ(c.Prefill(bad, &presp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Nothing was written; the reservation still stands. Decode with a wrong number of
  // checksums is refused and frees it.
  EXPECT_EQ(c.DecodeStats().reservations(), 1);
  v1::DecodeRequest dr;
  dr.set_request_id("x");
  *dr.mutable_prompt_token_ids() = pr.prompt_token_ids();
  dr.add_block_checksums(0);
  EXPECT_EQ(c.Decode(dr).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(c.Decode(dr).status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(c.DecodeStats().kv_integrity_failures(), 0u);

  // A full pool answers RESOURCE_EXHAUSTED, and frees up again.
  const int total = c.DecodeStats().kv_blocks_total();
  int held = 0;
  absl::Status last;
  for (int i = 0; i < total; ++i) {
    last = c.Reserve("fill-" + std::to_string(i), 100, 60).status();  // 10 blocks each
    if (!last.ok()) break;
    ++held;
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_EQ(held, total / 10);
  for (int i = 0; i < held; ++i) {
    c.CancelOnDecode("fill-" + std::to_string(i));
  }
  ExpectPoolsAtRest(c);
}

// The reserve handshake carries decode's speculative configuration; a prefill worker set up
// differently refuses the request before computing anything, and nothing leaks.
TEST_F(ServicesTest, SpeculativeMismatchIsFailedPrecondition) {
  // (decode, prefill): one side off, or two different proposers. (This model's file is gone
  // once loaded, so the prefill worker runs with --draft-kv decode and loads no draft: it needs
  // the setting only to compare.)
  const std::pair<const char*, const char*> cases[] = {
      {"ngram", "off"}, {"off", "ngram"}, {"ngram", "self:q4_0"}};
  for (const auto& [decode_spec, prefill_spec] : cases) {
    SCOPED_TRACE(absl::StrCat(decode_spec, " / ", prefill_spec));
    ClusterOptions co;
    co.decode_speculative = *engine::ParseSpeculative(decode_spec, 4);
    co.prefill_speculative = *engine::ParseSpeculative(prefill_spec, 4);
    co.prefill_draft_kv = false;
    TestCluster c(model_, co);
    const v1::WorkerStats at_rest = c.DecodeStats();
    const auto prompt = TestPrompt(20, 4);
    absl::StatusOr<v1::ReserveResponse> r = c.Reserve("mismatch", 20, 8, /*lease_ms=*/300);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->destination().speculative(), decode_spec);
    v1::PrefillRequest pr;
    pr.set_request_id("mismatch");
    for (int32_t t : prompt) pr.add_prompt_token_ids(t);
    *pr.mutable_sampling() = services::SamplingToProto(Greedy(8));
    *pr.mutable_destination() = r->destination();
    v1::PrefillResponse presp;
    const grpc::Status st = c.Prefill(pr, &presp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_NE(st.error_message().find("speculative"), std::string::npos) << st.error_message();
    EXPECT_NE(st.error_message().find(decode_spec), std::string::npos) << st.error_message();
    EXPECT_NE(st.error_message().find(prefill_spec), std::string::npos) << st.error_message();
    EXPECT_EQ(c.PrefillStats().transport_bytes_written(), 0u);
    // The unclaimed reservation expires and its blocks come back.
    ASSERT_TRUE(c.WaitForDecode([&](const v1::WorkerStats& s) {
      return s.reservations() == 0 && s.kv_blocks_free() == at_rest.kv_blocks_free();
    })) << c.DecodeStats().DebugString();
  }
}

TEST_F(ServicesTest, PrefillToAVanishedDecodeWorkerIsUnavailable) {
  TestCluster c(model_);
  // A destination whose transport endpoint is gone, as when a decode worker dies after Reserve.
  absl::StatusOr<v1::ReserveResponse> r = c.Reserve("orphan", 40, 8);
  ASSERT_TRUE(r.ok());
  v1::KvDestination dst = r->destination();
  {
    std::vector<uint8_t> mem(1 << 20);
    auto ghost = transfer::CreateInProcessTransport("ghost");
    auto region = ghost->RegisterRegion(mem.data(), mem.size());
    ASSERT_TRUE(region.ok());
    transfer::RegionDescriptor d = *region;
    d.length = 1ull << 40;  // large enough for any offset: the failure must come from the peer
    dst.set_region(d.Serialize());
  }
  v1::PrefillRequest pr;
  pr.set_request_id("orphan");
  for (int32_t t : TestPrompt(40, 2)) pr.add_prompt_token_ids(t);
  *pr.mutable_destination() = dst;
  v1::PrefillResponse presp;
  grpc::Status st = c.Prefill(pr, &presp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  const v1::WorkerStats p = c.PrefillStats();
  EXPECT_EQ(p.kv_blocks_free(), p.kv_blocks_total());
  EXPECT_EQ(p.running(), 0);
}

TEST_F(ServicesTest, CancelAbortsRunningAndQueuedPrefills) {
  // The prefill engine stops before its first step until the test lets it go.
  absl::Notification entered, release;
  std::atomic<bool> first{true};
  ClusterOptions co;
  co.prefill_before_step = [&] {
    if (first.exchange(false)) {
      entered.Notify();
      release.WaitForNotification();
    }
  };
  TestCluster c(model_, co);
  const v1::WorkerStats at_rest = c.DecodeStats();
  auto start = [&](const std::string& id, grpc::Status* st) {
    absl::StatusOr<v1::ReserveResponse> r = c.Reserve(id, 60, 8);
    EXPECT_TRUE(r.ok());
    v1::PrefillRequest pr;
    pr.set_request_id(id);
    for (int32_t t : TestPrompt(60, 8)) pr.add_prompt_token_ids(t);
    *pr.mutable_destination() = r->destination();
    return std::thread([&c, pr, st] {
      v1::PrefillResponse resp;
      *st = c.Prefill(pr, &resp);
    });
  };
  grpc::Status running_st, queued_st;
  std::thread running = start("running", &running_st);
  entered.WaitForNotification();
  // The second arrives while the engine is held: it waits in the queue, or joins the next step.
  std::thread queued = start("queued", &queued_st);
  for (const char* id : {"running", "queued"}) {
    // The queued call may still be on its way to the server: retry (explicit timeout).
    bool found = false;
    for (const absl::Time end = absl::Now() + absl::Seconds(10); !found && absl::Now() < end;) {
      grpc::ClientContext ctx;
      v1::CancelRequest creq;
      creq.set_request_id(id);
      v1::CancelResponse cresp;
      ASSERT_TRUE(c.prefill_stub->Cancel(&ctx, creq, &cresp).ok());
      found = cresp.found();
      if (!found) absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_TRUE(found) << id;
  }
  release.Notify();
  running.join();
  queued.join();
  EXPECT_EQ(running_st.error_code(), grpc::StatusCode::CANCELLED) << running_st.error_message();
  EXPECT_EQ(queued_st.error_code(), grpc::StatusCode::CANCELLED) << queued_st.error_message();
  const v1::WorkerStats p = c.PrefillStats();
  EXPECT_EQ(p.kv_blocks_free(), p.kv_blocks_total());
  EXPECT_EQ(p.running() + p.waiting(), 0);
  // Unknown ids are reported as such; the decode side's reservations are the router's to free.
  grpc::ClientContext ctx;
  v1::CancelRequest creq;
  creq.set_request_id("running");
  v1::CancelResponse cresp;
  ASSERT_TRUE(c.prefill_stub->Cancel(&ctx, creq, &cresp).ok());
  EXPECT_FALSE(cresp.found());
  EXPECT_EQ(c.DecodeStats().reservations(), 2);
  EXPECT_LT(c.DecodeStats().kv_blocks_free(), at_rest.kv_blocks_free());
}

TEST_F(ServicesTest, DestroyingWorkersEndsTheirInFlightWork) {
  auto transport = transfer::CreateInProcessTransport("shutdown");
  {
    decode::DecodeWorkerOptions d;
    d.model = model_;
    d.engine = TestEngineOptions(64, kernels::DType::kF32);
    d.before_step = [] { absl::SleepFor(absl::Milliseconds(5)); };
    auto w = std::move(*decode::DecodeWorker::Create(d));
    v1::DecodeRequest dr;
    dr.set_request_id("long");
    for (int32_t t : TestPrompt(10, 1)) dr.add_prompt_token_ids(t);
    *dr.mutable_sampling() = services::SamplingToProto(Greedy(200));
    dr.set_prefill_locally(true);
    absl::StatusOr<std::shared_ptr<decode::TokenStream>> stream = w->StartDecode(dr);
    ASSERT_TRUE(stream.ok()) << stream.status();
    engine::TokenEvent ev;
    ASSERT_TRUE((*stream)->Next(absl::Now() + absl::Seconds(10), &ev));
    w.reset();
    int n = 1;
    while ((*stream)->Next(absl::Now() + absl::Seconds(10), &ev) && !ev.finished) ++n;
    EXPECT_TRUE(ev.finished);
    EXPECT_EQ(ev.status.code(), absl::StatusCode::kCancelled);
    EXPECT_LT(n, 150);
  }
  {
    absl::Notification entered, release;
    prefill::PrefillWorkerOptions p;
    p.model = model_;
    p.engine = TestEngineOptions(24, kernels::DType::kF32);
    p.transport = transport.get();
    p.before_step = [&] {
      entered.Notify();
      release.WaitForNotification();
    };
    auto w = std::move(*prefill::PrefillWorker::Create(p));
    // A destination in this process: a registered buffer shaped like a 64-block pool.
    auto sink = transfer::CreateInProcessTransport("sink");
    engine::KvCacheOptions ko;
    ko.num_layers = model_->config().n_layer;
    ko.num_kv_heads = model_->config().n_head_kv;
    ko.head_dim = model_->config().head_dim;
    ko.num_blocks = 64;
    auto kv = std::move(*engine::KvCache::Create(ko));
    auto region = sink->RegisterRegion(kv->memory().data(), kv->memory().size());
    ASSERT_TRUE(region.ok());
    v1::PrefillRequest pr;
    pr.set_request_id("pending");
    for (int32_t t : TestPrompt(40, 2)) pr.add_prompt_token_ids(t);
    services::FillKvLayout(*kv, pr.mutable_destination());
    pr.mutable_destination()->set_region(region->Serialize());
    for (int b = 0; b < 3; ++b) pr.mutable_destination()->add_block_ids(b);
    absl::StatusOr<v1::PrefillResponse> result;
    std::thread caller([&] { result = w->Prefill(pr, absl::Now() + absl::Seconds(30)); });
    entered.WaitForNotification();
    std::thread destroyer([&] { w.reset(); });
    absl::SleepFor(absl::Milliseconds(20));
    release.Notify();
    destroyer.join();
    caller.join();
    EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable) << result.status();
  }
}

// Raw bytes over a generic gRPC call: the test needs no generated health/reflection stubs.
std::string CallUnaryRaw(grpc::Channel* ch, const char* method, const std::string& request,
                         grpc::Status* status) {
  grpc::Slice slice(request.data(), request.size());
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  *status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      ch, grpc::internal::RpcMethod(method, grpc::internal::RpcMethod::NORMAL_RPC), &ctx, req,
      &resp);
  std::vector<grpc::Slice> slices;
  std::string out;
  if (status->ok() && resp.Dump(&slices).ok()) {
    for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

// One raw ServerReflectionRequest on ServerReflectionInfo; the raw responses, concatenated.
std::string Reflect(grpc::Channel* ch, const std::string& request) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          ch,
          grpc::internal::RpcMethod(
              "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
              grpc::internal::RpcMethod::BIDI_STREAMING),
          &ctx));
  grpc::Slice slice(request.data(), request.size());
  grpc::ByteBuffer req(&slice, 1), resp;
  EXPECT_TRUE(stream->Write(req));
  stream->WritesDone();
  std::string out;
  while (stream->Read(&resp)) {
    std::vector<grpc::Slice> slices;
    if (resp.Dump(&slices).ok()) {
      for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  EXPECT_TRUE(stream->Finish().ok());
  return out;
}

std::string ListServicesByReflection(grpc::Channel* ch) {
  return Reflect(ch, std::string("\x3a\x00", 2));  // field 7 (list_services), empty string
}

// file_containing_symbol (field 4): the descriptor of the file declaring `symbol`, or an
// error_response (field 7) when the server's pool does not hold it.
std::string DescribeByReflection(grpc::Channel* ch, const std::string& symbol) {
  std::string req = "\x22";
  req += static_cast<char>(symbol.size());
  req += symbol;
  return Reflect(ch, req);
}

TEST_F(ServicesTest, StatsHealthAndReflectionRespond) {
  TestCluster c(model_);
  const v1::WorkerStats d = c.DecodeStats();
  EXPECT_EQ(d.kv_blocks_total(), c.decode->kv_blocks_total());
  EXPECT_EQ(d.kv_blocks_total(), 4 * 256 / 16);
  EXPECT_EQ(d.kv_blocks_free(), d.kv_blocks_total());
  const v1::WorkerStats p = c.PrefillStats();
  EXPECT_EQ(p.kv_blocks_total(), c.prefill->kv_blocks_total());

  for (grpc::Channel* ch : {c.decode_channel.get(), c.prefill_channel.get()}) {
    grpc::Status st;
    // HealthCheckRequest{service: ""} is empty; the answer is {status: SERVING (1)}.
    const std::string health = CallUnaryRaw(ch, "/grpc.health.v1.Health/Check", "", &st);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(health, std::string("\x08\x01", 2));
  }
  const std::string dlist = ListServicesByReflection(c.decode_channel.get());
  EXPECT_NE(dlist.find("tandem.v1.DecodeWorker"), std::string::npos);
  EXPECT_NE(dlist.find("grpc.health.v1.Health"), std::string::npos);
  const std::string plist = ListServicesByReflection(c.prefill_channel.get());
  EXPECT_NE(plist.find("tandem.v1.PrefillWorker"), std::string::npos);
  // Reflection describes the health service, not only names it (what `buf curl` needs).
  for (const char* symbol : {"grpc.health.v1.Health", "tandem.v1.DecodeWorker"}) {
    const std::string d = DescribeByReflection(c.decode_channel.get(), symbol);
    EXPECT_NE(d.find(std::string(symbol).rfind("grpc", 0) == 0 ? "grpc/health/v1/health.proto"
                                                                 : "tandem/v1/worker.proto"),
              std::string::npos)
        << symbol;
    EXPECT_EQ(d.find("not found"), std::string::npos) << symbol << ": " << d;
  }

  // After shutdown a server answers nothing (checked on a server of its own).
  decode::DecodeService spare(c.decode.get());
  services::GrpcServerOptions so;
  so.services = {&spare};
  auto extra = std::move(*services::GrpcServer::Start(so));
  auto ch = grpc::CreateChannel(extra->address(), grpc::InsecureChannelCredentials());
  grpc::Status st;
  EXPECT_EQ(CallUnaryRaw(ch.get(), "/grpc.health.v1.Health/Check", "", &st),
            std::string("\x08\x01", 2));
  extra->Shutdown(absl::ZeroDuration());
  CallUnaryRaw(ch.get(), "/grpc.health.v1.Health/Check", "", &st);
  EXPECT_FALSE(st.ok());
}

}  // namespace
}  // namespace tandem::testing
