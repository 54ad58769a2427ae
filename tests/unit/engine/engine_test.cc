// Engine::Step against a double-precision reference forward, and the invariants continuous
// batching relies on: chunking, batching and decode order do not change the logits.
#include "engine/runtime/engine.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <numeric>

#include "gtest/gtest.h"
#include "tests/fakes/tiny_model.h"
#include "tests/unit/engine/reference_model.h"

#if defined(TANDEM_HAVE_CUDA)
#include "tandem/cuda/cuda_common.h"
#endif

namespace tandem::engine {
namespace {

using testing::TinyModelOptions;
using testing::RandomTokens;

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          (name + "-" + std::to_string(getpid()) + ".gguf"))
      .string();
}

std::shared_ptr<const Model> LoadTiny(const TinyModelOptions& o, const std::string& tag) {
  const std::string path = TempPath("tandem-engine-" + tag);
  absl::Status st = testing::WriteTinyModel(o, path);
  EXPECT_TRUE(st.ok()) << st;
  auto m = Model::Load(path);
  EXPECT_TRUE(m.ok()) << m.status();
  std::filesystem::remove(path);  // the mapping stays valid
  return std::shared_ptr<const Model>(std::move(*m));
}

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<const Model> m, int threads = 2,
                                   kernels::DType kv = kernels::DType::kF32) {
  EngineOptions o;
  o.threads = threads;
  o.ctx_size = 128;
  o.max_seqs = 4;
  o.kv_type = kv;
  o.block_size = 16;
  auto e = Engine::Create(std::move(m), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

// Runs `tokens` through one sequence in chunks of `chunk` and returns the last logits.
std::vector<float> RunChunked(Engine& e, const std::vector<int32_t>& tokens, int chunk,
                              std::vector<int32_t>& blocks) {
  std::vector<float> logits;
  for (size_t start = 0; start < tokens.size(); start += chunk) {
    const size_t n = std::min<size_t>(chunk, tokens.size() - start);
    SeqChunk ch;
    ch.tokens = std::span<const int32_t>(tokens).subspan(start, n);
    ch.start_pos = static_cast<int32_t>(start);
    ch.block_table = blocks;
    ch.want_logits = start + n == tokens.size();
    absl::Status st = e.Step({&ch, 1}, &logits);
    EXPECT_TRUE(st.ok()) << st;
  }
  return logits;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

class EngineArchTest : public ::testing::TestWithParam<std::string> {};

TEST_P(EngineArchTest, MatchesDoublePrecisionReference) {
  TinyModelOptions o;
  o.arch = GetParam();
  auto model = LoadTiny(o, GetParam());
  auto e = MakeEngine(model);
  const auto tokens = RandomTokens(37, model->config().n_vocab, 7);
  auto blocks = *e->kv().pool().AllocateN(3);
  std::vector<float> got = RunChunked(*e, tokens, 37, blocks);
  std::vector<double> want = testing::ReferenceForward(*model, tokens);
  ASSERT_EQ(got.size(), want.size());
  double max_err = 0, spread = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    max_err = std::max(max_err, std::fabs(got[i] - want[i]));
    spread = std::max(spread, std::fabs(want[i]));
  }
  EXPECT_GT(spread, 0.1) << "logits degenerate; the test would prove nothing";
  EXPECT_LT(max_err, 1e-3 * spread) << "max error " << max_err << " of spread " << spread;
}

// Decode (one token per step: the MoE path where every chosen expert shares the input) and
// small chunks (tokens grouped by expert) give the reference's logits too.
TEST_P(EngineArchTest, TokenByTokenAndChunkedMatchTheReference) {
  TinyModelOptions o;
  o.arch = GetParam();
  o.seed = 5;
  auto model = LoadTiny(o, GetParam() + "-chunks");
  const auto tokens = RandomTokens(21, model->config().n_vocab, 11);
  std::vector<double> want = testing::ReferenceForward(*model, tokens);
  double spread = 0;
  for (double v : want) spread = std::max(spread, std::fabs(v));
  ASSERT_GT(spread, 0.1);
  for (int chunk : {1, 5}) {
    SCOPED_TRACE(chunk);
    auto e = MakeEngine(model);
    auto blocks = *e->kv().pool().AllocateN(2);
    std::vector<float> got = RunChunked(*e, tokens, chunk, blocks);
    ASSERT_EQ(got.size(), want.size());
    double max_err = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      max_err = std::max(max_err, std::fabs(got[i] - want[i]));
    }
    EXPECT_LT(max_err, 1e-3 * spread);
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, EngineArchTest,
                         ::testing::Values("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe",
                                           "mixtral", "gpt-oss"));

// Device::kCuda fails at Create, with a message saying why, wherever it cannot run: a build
// without CUDA, or no visible device (with one, cuda_engine_test covers the device path).
TEST(EngineTest, CudaDeviceFailsCleanlyWhereItCannotRun) {
  auto model = LoadTiny({}, "nodevice");
  EngineOptions o;
  o.ctx_size = 64;
  o.device = Device::kCuda;
#if defined(TANDEM_HAVE_CUDA)
  if (kernels::cuda::VisibleDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is visible";
  const std::string why = "no CUDA device";
#else
  const std::string why = "built without CUDA";
#endif
  auto e = Engine::Create(model, o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
  EXPECT_NE(e.status().message().find(why), std::string::npos) << e.status();
  EXPECT_EQ(DeviceFromName("cuda"), Device::kCuda);
  EXPECT_EQ(DeviceFromName("cpu"), Device::kCpu);
  EXPECT_EQ(DeviceFromName("gpu"), std::nullopt);
  EXPECT_STREQ(DeviceName(Device::kCuda), "cuda");
}

TEST(EngineTest, ChunkedPrefillAndDecodeAgreeWithOneShot) {
  auto model = LoadTiny({}, "chunk");
  auto e = MakeEngine(model);
  const auto tokens = RandomTokens(50, model->config().n_vocab, 11);
  auto b1 = *e->kv().pool().AllocateN(4);
  auto b2 = *e->kv().pool().AllocateN(4);
  auto b3 = *e->kv().pool().AllocateN(4);
  auto one = RunChunked(*e, tokens, 50, b1);
  auto chunked = RunChunked(*e, tokens, 7, b2);
  auto decode = RunChunked(*e, tokens, 1, b3);
  EXPECT_LT(MaxAbsDiff(one, chunked), 1e-4);
  EXPECT_LT(MaxAbsDiff(one, decode), 1e-4);
}

TEST(EngineTest, BatchedSequencesMatchSeparateRuns) {
  auto model = LoadTiny({}, "batch");
  auto e = MakeEngine(model);
  const int vocab = model->config().n_vocab;
  const auto a = RandomTokens(20, vocab, 1), b = RandomTokens(33, vocab, 2);
  auto ba = *e->kv().pool().AllocateN(3), bb = *e->kv().pool().AllocateN(3);
  auto alone_a = RunChunked(*e, a, 20, ba);
  auto alone_b = RunChunked(*e, b, 33, bb);

  auto ca = *e->kv().pool().AllocateN(3), cb = *e->kv().pool().AllocateN(3);
  // Prefill a fully and b partly in one step, then b's rest plus a decode token of a.
  SeqChunk chunks[2];
  chunks[0] = {std::span<const int32_t>(a), 0, ca, true};
  chunks[1] = {std::span<const int32_t>(b).subspan(0, 30), 0, cb, false};
  std::vector<float> logits;
  ASSERT_TRUE(e->Step(chunks, &logits).ok());
  ASSERT_EQ(logits.size(), size_t(vocab));
  EXPECT_LT(MaxAbsDiff(logits, alone_a), 1e-4);
  chunks[0] = {std::span<const int32_t>(b).subspan(30), 30, cb, true};
  ASSERT_TRUE(e->Step({chunks, 1}, &logits).ok());
  EXPECT_LT(MaxAbsDiff(logits, alone_b), 1e-4);
}

TEST(EngineTest, F16KvCacheStaysClose) {
  auto model = LoadTiny({}, "f16kv");
  auto e32 = MakeEngine(model, 1, kernels::DType::kF32);
  auto e16 = MakeEngine(model, 1, kernels::DType::kF16);
  const auto tokens = RandomTokens(40, model->config().n_vocab, 5);
  auto b32 = *e32->kv().pool().AllocateN(3);
  auto b16 = *e16->kv().pool().AllocateN(3);
  auto l32 = RunChunked(*e32, tokens, 40, b32);
  auto l16 = RunChunked(*e16, tokens, 40, b16);
  const double d = MaxAbsDiff(l32, l16);
  EXPECT_GT(d, 0.0) << "f16 cache should round somewhere";
  EXPECT_LT(d, 2e-2);
}

TEST(EngineTest, QuantisedWeightsRun) {
  for (auto t : {kernels::DType::kQ8_0, kernels::DType::kQ4_0}) {
    TinyModelOptions o;
    o.type = t;
    auto model = LoadTiny(o, "quant");
    auto e = MakeEngine(model);
    const auto tokens = RandomTokens(20, model->config().n_vocab, 3);
    auto blocks = *e->kv().pool().AllocateN(2);
    auto got = RunChunked(*e, tokens, 20, blocks);
    auto want = testing::ReferenceForward(*model, tokens);
    double max_err = 0, spread = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      max_err = std::max(max_err, std::fabs(got[i] - want[i]));
      spread = std::max(spread, std::fabs(want[i]));
    }
    // Activations are quantised to 8 bits inside the matmuls, as llama.cpp does.
    EXPECT_LT(max_err, 0.05 * spread) << kernels::Traits(t).name;
  }
}

TEST(EngineTest, KvCacheInCallerMemory) {
  // A decode worker puts its KV pool in memory its transport allocated.
  auto model = LoadTiny({}, "extmem");
  EngineOptions o;
  o.threads = 1;
  o.ctx_size = 64;
  o.max_seqs = 2;
  const uint64_t bytes = *Engine::KvBytes(*model, o);
  ASSERT_GT(bytes, 0u);
  std::vector<uint8_t> mem(bytes, 0xAB);
  o.kv_memory = mem.data();
  o.kv_memory_bytes = bytes - 1;
  EXPECT_EQ(Engine::Create(model, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.kv_memory_bytes = bytes;
  auto ext = std::move(*Engine::Create(model, o));
  EXPECT_EQ(ext->kv().memory().data(), mem.data());
  auto own = MakeEngine(model, 1);
  const auto tokens = RandomTokens(30, model->config().n_vocab, 4);
  auto be = *ext->kv().pool().AllocateN(2);
  auto bo = *own->kv().pool().AllocateN(2);
  EXPECT_EQ(RunChunked(*ext, tokens, 30, be), RunChunked(*own, tokens, 30, bo));
}

TEST(EngineTest, RejectsBadInput) {
  auto model = LoadTiny({}, "bad");
  auto e = MakeEngine(model);
  auto blocks = *e->kv().pool().AllocateN(1);
  std::vector<float> logits;
  std::vector<int32_t> bad = {1, model->config().n_vocab};
  SeqChunk ch{bad, 0, blocks, true};
  absl::Status st = e->Step({&ch, 1}, &logits);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("vocabulary"), std::string::npos) << st;

  std::vector<int32_t> ok = {1, 5};
  SeqChunk far{ok, 127, blocks, true};
  EXPECT_EQ(e->Step({&far, 1}, &logits).code(), absl::StatusCode::kInvalidArgument);
  SeqChunk short_table{ok, 15, blocks, true};  // positions 15..16 need two blocks
  EXPECT_EQ(e->Step({&short_table, 1}, &logits).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::engine
