// Quantised KV caches (int8, fp8-e4m3) end to end on the CPU: the cache's byte layout and sizes,
// that a slot's bytes depend only on its token (any write order, any thread, any block give the
// same bytes, which is what makes prefill and decode agree), paged attention over a quantised
// cache against its double reference and against the f32 cache within a stated bound, and the
// engine running a tiny model with each KV type.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "engine/kv/kv_cache.h"
#include "engine/runtime/engine.h"
#include "gtest/gtest.h"
#include "tandem/kernels/attention.h"
#include "tandem/kernels/kv_quant.h"
#include "tests/fakes/tiny_model.h"
#include "tests/unit/kernels/kernel_test_util.h"

namespace tandem::engine {
namespace {

using kernels::DType;

KvCacheOptions Shape(DType t) {
  KvCacheOptions o;
  o.num_layers = 2;
  o.num_kv_heads = 2;
  o.head_dim = 32;
  o.block_size = 16;
  o.num_blocks = 8;
  o.type = t;
  return o;
}

std::vector<float> Normal(size_t n, uint32_t seed, float sigma) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

class QuantKvTest : public ::testing::TestWithParam<DType> {};

TEST_P(QuantKvTest, SizesIncludeThePerSlotScales) {
  auto kv = KvCache::Create(Shape(GetParam()));
  ASSERT_TRUE(kv.ok()) << kv.status();
  KvCache& c = **kv;
  EXPECT_EQ(c.elem_bytes(), 1u);
  EXPECT_EQ(c.slot_bytes(), 2u * 32 + 2 * 4);
  EXPECT_EQ(c.block_bytes(), 16u * (2 * 32 + 2 * 4));
  EXPECT_EQ(KvCache::RequiredBytes(Shape(GetParam())), 2u * 2 * 8 * c.block_bytes());
  EXPECT_EQ(c.memory().size(), KvCache::RequiredBytes(Shape(GetParam())));
  EXPECT_EQ(c.v_layer(0) - c.k_layer(0), static_cast<ptrdiff_t>(c.layer_bytes()));
}

// Writes `n` tokens of random K/V (token t's data from seed t) into `kv` in the given order.
void WriteTokens(KvCache& kv, const std::vector<int32_t>& blocks, const std::vector<int>& order) {
  const int64_t e = kv.slot_elems();
  for (int t : order) {
    for (int32_t l = 0; l < kv.options().num_layers; ++l) {
      // Heads of very different magnitude, so a shared scale would be visible.
      std::vector<float> k = Normal(e, 1000 * l + t, 1.0f), v = Normal(e, 7000 * l + t, 0.3f);
      for (int64_t i = e / 2; i < e; ++i) k[i] *= 50.0f;
      kv.Write(l, blocks, t, k.data(), v.data());
    }
  }
}

TEST_P(QuantKvTest, SlotBytesDependOnlyOnTheToken) {
  const std::vector<int32_t> blocks = {5, 2, 7};
  const int n = 40;  // two full blocks and a partial one
  std::vector<int> forward(n);
  for (int i = 0; i < n; ++i) forward[i] = i;
  std::vector<int> shuffled = forward;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(3));

  auto a = KvCache::Create(Shape(GetParam()));
  auto b = KvCache::Create(Shape(GetParam()));
  ASSERT_TRUE(a.ok() && b.ok());
  WriteTokens(**a, blocks, forward);
  // b: shuffled order, split over 4 threads writing slots of the same blocks concurrently.
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      std::vector<int> mine;
      for (int i = w; i < n; i += 4) mine.push_back(shuffled[i]);
      WriteTokens(**b, blocks, mine);
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ((*a)->memory().size(), (*b)->memory().size());
  EXPECT_EQ(0, std::memcmp((*a)->memory().data(), (*b)->memory().data(), (*a)->memory().size()));

  // The same token written into another block (as a decode pool would hold it) is the same
  // bytes, scales included.
  auto c = KvCache::Create(Shape(GetParam()));
  ASSERT_TRUE(c.ok());
  const std::vector<int32_t> other = {0, 3, 1};
  WriteTokens(**c, other, forward);
  const size_t bb = (*a)->block_bytes();
  for (int32_t l = 0; l < 2; ++l) {
    for (int i = 0; i < 3; ++i) {
      const size_t used = i < 2 ? bb : (n - 32) * (*a)->slot_bytes();
      EXPECT_EQ(0, std::memcmp((*a)->k_layer(l) + blocks[i] * bb, (*c)->k_layer(l) + other[i] * bb,
                               used));
      EXPECT_EQ(0, std::memcmp((*a)->v_layer(l) + blocks[i] * bb, (*c)->v_layer(l) + other[i] * bb,
                               used));
    }
  }
}

TEST_P(QuantKvTest, ReadBackIsWithinTheFormatsBound) {
  auto kv = KvCache::Create(Shape(GetParam()));
  ASSERT_TRUE(kv.ok());
  const std::vector<int32_t> blocks = {4, 6};
  const int64_t e = (*kv)->slot_elems();
  const int64_t hd = (*kv)->options().head_dim;
  for (int t = 0; t < 20; ++t) {
    std::vector<float> k = Normal(e, t, 2.0f), v = Normal(e, 100 + t, 0.5f);
    (*kv)->Write(1, blocks, t, k.data(), v.data());
    const uint8_t* ks = (*kv)->k_layer(1) +
                        (size_t(blocks[t / 16]) * 16 + t % 16) * (*kv)->slot_bytes();
    std::vector<float> back(e, NAN);
    kernels::DequantizeKvSlot(GetParam(), ks, 2, hd, back.data());
    for (int h = 0; h < 2; ++h) {
      double amax = 0;
      for (int i = 0; i < hd; ++i) amax = std::max(amax, std::fabs(double(k[h * hd + i])));
      for (int i = 0; i < hd; ++i) {
        const double x = k[h * hd + i];
        // int8: half a step of amax/127. fp8: half an ulp (1/16 relative), or half the
        // subnormal step of amax/448.
        const double bound = GetParam() == DType::kI8
                                 ? amax / 254 * 1.0001
                                 : std::max(std::fabs(x) / 16, amax / 448 / 1024) * 1.0001;
        ASSERT_LE(std::fabs(back[h * hd + i] - x), bound) << "t=" << t << " h=" << h;
      }
    }
  }
}

// One sequence's K/V written into an f32 cache and into a quantised one, then attention over
// both: the quantised kernel must match its double reference over the same quantised cache
// tightly, and the f32 result within the bound the format allows.
TEST_P(QuantKvTest, AttentionOverQuantisedCache) {
  // (n_kv_head, head_dim): head_dim 48 is stories15M's (three 16-float chunks); 36 and 8 are not
  // multiples of 16, so the AVX-512 path loads their last chunk masked.
  for (auto [n_kv, hd] : {std::pair{1, 64}, std::pair{2, 64}, std::pair{3, 48}, std::pair{2, 36},
                          std::pair{4, 8}}) {
    KvCacheOptions o = Shape(GetParam());
    o.num_layers = 1;
    o.num_kv_heads = n_kv;
    o.head_dim = hd;
    o.num_blocks = 12;
    KvCacheOptions of = o;
    of.type = DType::kF32;
    auto q8 = KvCache::Create(o);
    auto f32 = KvCache::Create(of);
    ASSERT_TRUE(q8.ok() && f32.ok());
    const int ctx = 150;
    std::vector<int32_t> blocks = {11, 3, 9, 0, 5, 7, 2, 10, 1, 4};
    const int64_t e = (*q8)->slot_elems();
    double v_amax = 0;
    for (int t = 0; t < ctx; ++t) {
      std::vector<float> k = Normal(e, t, 1.5f), v = Normal(e, 500 + t, 1.0f);
      // Some values small enough for fp8's subnormal codes and int8's small codes.
      for (int64_t i = 0; i < e; i += 7) v[i] *= 1e-4f;
      for (float x : v) v_amax = std::max(v_amax, std::fabs(double(x)));
      (*q8)->Write(0, blocks, t, k.data(), v.data());
      (*f32)->Write(0, blocks, t, k.data(), v.data());
    }
    const int n_head = 2 * n_kv, n_q = 3;
    const std::vector<float> q = Normal(size_t(n_q) * n_head * hd, 99, 1.0f);
    std::vector<int32_t> pos = {ctx - 3, ctx - 2, ctx - 1};
    kernels::PagedAttentionParams p;
    p.q = q.data();
    p.q_stride = n_head * hd;
    p.n_q = n_q;
    p.q_pos = pos.data();
    p.n_head = n_head;
    p.n_kv_head = n_kv;
    p.head_dim = hd;
    p.scale = 1.0f / std::sqrt(float(hd));
    p.block_size = 16;
    p.block_table = blocks.data();
    p.out_stride = n_head * hd;
    auto run = [&](const KvCache& kv, bool reference) {
      std::vector<float> out(size_t(n_q) * n_head * hd, NAN);
      kernels::PagedAttentionParams pp = p;
      pp.kv_type = kv.options().type;
      pp.k_cache = kv.k_layer(0);
      pp.v_cache = kv.v_layer(0);
      pp.out = out.data();
      if (reference) {
        kernels::PagedAttentionReference(pp);
      } else {
        kernels::PagedAttention(pp, nullptr);
      }
      return out;
    };
    const std::vector<float> ref = run(**q8, true);
    const std::vector<float> exact = run(**f32, false);
    // The kernel on every ISA level the machine has (AVX-512 and the scalar fallback) against
    // the double reference over the same quantised cache.
    std::vector<float> got;
    for (kernels::Isa isa : kernels::testing::AvailableIsas()) {
      kernels::testing::ScopedIsaCap cap(isa);
      got = run(**q8, false);
      double kernel_err = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_FALSE(std::isnan(got[i])) << i;
        kernel_err = std::max(kernel_err, std::fabs(double(got[i]) - ref[i]));
      }
      EXPECT_LT(kernel_err, 2e-5) << "isa " << static_cast<int>(isa);
    }
    double quant_err = 0, mean_err = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      quant_err = std::max(quant_err, std::fabs(double(got[i]) - exact[i]));
      mean_err += std::fabs(double(got[i]) - exact[i]);
    }
    mean_err /= got.size();
    // Stated bound: one quantisation step of the largest |V| (int8: amax/127; fp8: its 1/16
    // relative half-ulp), which covers the V rounding (at most half of it, the outputs being
    // convex combinations of V rows) plus the reweighting that K's rounding causes. Measured
    // worst cases over these seeds were about 40% of it (0.011 of 0.028 for int8, 0.083 of
    // 0.22 for fp8); the mean error is well under a quarter of it.
    const double max_bound = GetParam() == DType::kI8 ? v_amax / 127 : v_amax / 16;
    EXPECT_LT(quant_err, max_bound) << "n_kv=" << n_kv << " hd=" << hd;
    EXPECT_GT(quant_err, 0.0);  // the quantised cache really was used
    EXPECT_LT(mean_err, max_bound / 4);
    std::printf("attention n_kv=%d hd=%d %s: max err %.3g mean %.3g\n", n_kv, hd,
                std::string(kernels::KvTypeName(GetParam())).c_str(), quant_err, mean_err);
  }
}

// A NaN in one V element reaches the attention output as it would from an f32 cache: fp8 has a
// NaN code (only that column is NaN), int8 marks the vector's scale NaN (the whole head is).
// Checked on every ISA path, since the AVX-512 fp8 widening must patch NaN codes by hand.
TEST_P(QuantKvTest, NaNInVReachesTheOutput) {
  KvCacheOptions o = Shape(GetParam());
  o.num_layers = 1;
  o.num_kv_heads = 1;
  auto kv = KvCache::Create(o);
  ASSERT_TRUE(kv.ok());
  const std::vector<int32_t> blocks = {1, 0};
  const int64_t hd = o.head_dim;
  for (int t = 0; t < 20; ++t) {
    std::vector<float> k = Normal(hd, t, 1.0f), v = Normal(hd, 50 + t, 1.0f);
    if (t == 7) v[5] = std::numeric_limits<float>::quiet_NaN();
    (*kv)->Write(0, blocks, t, k.data(), v.data());
  }
  const std::vector<float> q = Normal(hd, 3, 1.0f);
  const int32_t pos = 19;
  for (kernels::Isa isa : kernels::testing::AvailableIsas()) {
    kernels::testing::ScopedIsaCap cap(isa);
    std::vector<float> out(hd, 0.0f);
    kernels::PagedAttentionParams p;
    p.q = q.data();
    p.q_stride = hd;
    p.n_q = 1;
    p.q_pos = &pos;
    p.n_head = 1;
    p.n_kv_head = 1;
    p.head_dim = hd;
    p.scale = 0.2f;
    p.kv_type = GetParam();
    p.k_cache = (*kv)->k_layer(0);
    p.v_cache = (*kv)->v_layer(0);
    p.block_size = o.block_size;
    p.block_table = blocks.data();
    p.out = out.data();
    p.out_stride = hd;
    kernels::PagedAttention(p, nullptr);
    for (int64_t i = 0; i < hd; ++i) {
      const bool want_nan = GetParam() == DType::kI8 || i == 5;
      EXPECT_EQ(std::isnan(out[i]), want_nan) << "isa " << static_cast<int>(isa) << " i=" << i;
    }
  }
}

std::shared_ptr<const Model> LoadTiny() {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("tandem-kvq-" + std::to_string(getpid()) + ".gguf"))
                               .string();
  testing::TinyModelOptions o;
  absl::Status st = testing::WriteTinyModel(o, path);
  EXPECT_TRUE(st.ok()) << st;
  auto m = Model::Load(path);
  EXPECT_TRUE(m.ok()) << m.status();
  std::filesystem::remove(path);
  return std::shared_ptr<const Model>(std::move(*m));
}

std::vector<float> Prefill(Engine& e, const std::vector<int32_t>& tokens, int chunk) {
  std::vector<int32_t> blocks = {3, 1, 4, 0, 2};
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

TEST_P(QuantKvTest, EngineLogitsStayCloseToF32Kv) {
  std::shared_ptr<const Model> m = LoadTiny();
  ASSERT_NE(m, nullptr);
  auto make = [&](DType t) {
    EngineOptions o;
    o.threads = 2;
    o.ctx_size = 80;
    o.max_seqs = 1;
    o.kv_type = t;
    auto e = Engine::Create(m, o);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  };
  std::vector<int32_t> tokens(70);
  for (int i = 0; i < 70; ++i) tokens[i] = 3 + (i * 37 + 11) % 250;
  auto ef = make(DType::kF32);
  auto eq = make(GetParam());
  const std::vector<float> lf = Prefill(*ef, tokens, 70);
  const std::vector<float> lq = Prefill(*eq, tokens, 70);
  ASSERT_EQ(lf.size(), lq.size());
  double err = 0, range = 0;
  for (size_t i = 0; i < lf.size(); ++i) {
    err = std::max(err, std::fabs(double(lf[i]) - lq[i]));
    range = std::max(range, std::fabs(double(lf[i])));
  }
  EXPECT_GT(err, 0.0);
  EXPECT_LT(err, (GetParam() == DType::kI8 ? 0.02 : 0.1) * range) << "range " << range;
  std::printf("engine %s: max logit err %.3g (max |logit| %.3g)\n",
              std::string(kernels::KvTypeName(GetParam())).c_str(), err, range);
  // Chunked prefill writes the same cache as one-step prefill up to the rows' own f32
  // differences; the last logits agree closely.
  auto eq2 = make(GetParam());
  const std::vector<float> lc = Prefill(*eq2, tokens, 9);
  double chunk_err = 0;
  for (size_t i = 0; i < lq.size(); ++i) chunk_err = std::max(chunk_err, std::fabs(double(lq[i]) - lc[i]));
  EXPECT_LT(chunk_err, 0.02 * range);
}

INSTANTIATE_TEST_SUITE_P(Types, QuantKvTest, ::testing::Values(DType::kI8, DType::kFp8E4M3),
                         [](const auto& info) {
                           return std::string(kernels::KvTypeName(info.param));
                         });

}  // namespace
}  // namespace tandem::engine
