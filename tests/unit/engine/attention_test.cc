// PagedAttention against its double-precision reference over scattered block tables, on every
// ISA level the machine has (the AVX-512 path and the scalar fallback), and the batched entry
// point against one call per sequence.
#include "tandem/kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "common/util/thread_pool.h"
#include "gtest/gtest.h"
#include "tandem/kernels/cpu_features.h"
#include "tandem/kernels/fp16.h"
#include "tests/unit/kernels/kernel_test_util.h"

namespace tandem::kernels {
namespace {

struct Case {
  int n_head, n_kv_head, head_dim, block_size, ctx, n_q;
  DType type;
};

// One sequence's cache, queries and parameters, filled with random normals.
struct Problem {
  std::vector<float> kf, vf, q;
  std::vector<uint16_t> kh, vh;
  std::vector<int32_t> table, pos;
  PagedAttentionParams p;

  Problem(const Case& c, std::mt19937& rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int n_blocks = (c.ctx + c.block_size - 1) / c.block_size + 3;
    const int slot = c.n_kv_head * c.head_dim;
    kf.resize(size_t(n_blocks) * c.block_size * slot);
    vf.resize(kf.size());
    for (auto& x : kf) x = 2.0f * nd(rng);  // wide enough that softmax is far from uniform
    for (auto& x : vf) x = nd(rng);
    kh.resize(kf.size());
    vh.resize(vf.size());
    F32ToFp16Row(kf.data(), kh.data(), kf.size());
    F32ToFp16Row(vf.data(), vh.data(), vf.size());
    // A scattered block table: reversed, skipping block 0.
    for (int b = n_blocks - 1; b >= 1; --b) table.push_back(b);
    const int q_dim = c.n_head * c.head_dim;
    q.resize(size_t(c.n_q) * q_dim);
    for (auto& x : q) x = nd(rng);
    pos.resize(c.n_q);
    for (int i = 0; i < c.n_q; ++i) pos[i] = c.ctx - c.n_q + i;
    p.q = q.data();
    p.q_stride = q_dim;
    p.n_q = c.n_q;
    p.q_pos = pos.data();
    p.n_head = c.n_head;
    p.n_kv_head = c.n_kv_head;
    p.head_dim = c.head_dim;
    p.scale = 1.0f / std::sqrt(float(c.head_dim));
    p.kv_type = c.type;
    p.k_cache = c.type == DType::kF16 ? static_cast<const void*>(kh.data()) : kf.data();
    p.v_cache = c.type == DType::kF16 ? static_cast<const void*>(vh.data()) : vf.data();
    p.block_size = c.block_size;
    p.block_table = table.data();
    p.out_stride = q_dim;
  }
  size_t out_size() const { return size_t(p.n_q) * p.out_stride; }
};

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    m = std::max(m, double(std::fabs(a[i] - b[i])));
  }
  return m;
}

TEST(PagedAttentionTest, MatchesReferenceOnEveryIsa) {
  const Case cases[] = {
      {4, 4, 16, 16, 37, 1, DType::kF32},
      {8, 2, 32, 16, 70, 5, DType::kF32},
      {6, 3, 64, 8, 100, 100, DType::kF32},
      {8, 2, 32, 16, 70, 3, DType::kF16},
      {6, 6, 48, 16, 129, 33, DType::kF16},
      {32, 8, 64, 16, 300, 40, DType::kF16},
      {14, 2, 64, 16, 50, 17, DType::kF32},
      {4, 1, 128, 16, 65, 9, DType::kF16},
      // Head dims that are not multiples of 16: the AVX-512 path masks its last chunk.
      {4, 2, 8, 16, 20, 20, DType::kF32},
      {8, 4, 8, 16, 300, 7, DType::kF32},
      {8, 4, 8, 16, 45, 3, DType::kF16},
      {6, 2, 24, 16, 61, 5, DType::kF32},
      {4, 4, 72, 8, 33, 2, DType::kF16},
      {2, 1, 5, 16, 19, 4, DType::kF32},
  };
  std::mt19937 rng(3);
  util::ThreadPool pool(2);
  for (const Case& c : cases) {
    Problem pr(c, rng);
    std::vector<float> want(pr.out_size(), NAN);
    pr.p.out = want.data();
    PagedAttentionReference(pr.p);
    for (Isa isa : testing::AvailableIsas()) {
      testing::ScopedIsaCap cap(isa);
      for (util::ThreadPool* tp : {&pool, static_cast<util::ThreadPool*>(nullptr)}) {
        std::vector<float> got(pr.out_size(), NAN);
        pr.p.out = got.data();
        PagedAttention(pr.p, tp);
        EXPECT_LT(MaxAbsDiff(got, want), 2e-5)
            << IsaName(isa) << " heads=" << c.n_head << "/" << c.n_kv_head << " dim=" << c.head_dim
            << " ctx=" << c.ctx << " pool=" << (tp != nullptr);
      }
    }
  }
}

// gpt-oss's sliding window and attention sinks, against their definition written here in
// double (not the library's reference): query i attends to positions (q_pos - window, q_pos],
// and head h's softmax has one extra logit sinks[h] with no value.
TEST(PagedAttentionTest, SlidingWindowAndSinksFollowTheirDefinition) {
  std::mt19937 rng(17);
  // A 32-wide head over 6 rows (tiles of several rows with different windows), and an 8-wide
  // f16 one over a 40-row prefill chunk.
  for (const Case& c :
       {Case{8, 2, 32, 16, 70, 6, DType::kF32}, Case{4, 2, 8, 16, 90, 40, DType::kF16}}) {
    SCOPED_TRACE(::testing::Message() << "head dim " << c.head_dim);
    Problem pr(c, rng);
    std::vector<float> sinks(c.n_head);
    std::normal_distribution<float> nd(0.0f, 2.0f);
    for (float& x : sinks) x = nd(rng);
    util::ThreadPool pool(2);
    for (int32_t window : {0, 1, 20, 500}) {
      for (bool with_sinks : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "window " << window << " sinks " << with_sinks);
        PagedAttentionParams p = pr.p;
        p.window = window;
        p.sinks = with_sinks ? sinks.data() : nullptr;
        std::vector<float> want(pr.out_size());
        const int group = c.n_head / c.n_kv_head;
        for (int qi = 0; qi < c.n_q; ++qi) {
          const int pos = pr.pos[qi];
          const int first = window > 0 ? std::max(0, pos + 1 - window) : 0;
          for (int h = 0; h < c.n_head; ++h) {
            // The cache's values as the kernel reads them (f16 caches rounded).
            auto at = [&](const std::vector<float>& f32, const std::vector<uint16_t>& f16, int t,
                          int head, int i) -> double {
              const int block = pr.table[t / c.block_size];
              const size_t idx =
                  ((size_t(block) * c.block_size + t % c.block_size) * c.n_kv_head + head / group) *
                      c.head_dim +
                  i;
              return c.type == DType::kF16 ? double(Fp16ToF32(f16[idx])) : double(f32[idx]);
            };
            auto K = [&](int t, int head, int i) { return at(pr.kf, pr.kh, t, head, i); };
            auto V = [&](int t, int head, int i) { return at(pr.vf, pr.vh, t, head, i); };
            std::vector<double> e(pos + 1, 0.0);
            double mx = with_sinks ? sinks[h] : -INFINITY;
            for (int t = first; t <= pos; ++t) {
              double dot = 0;
              for (int i = 0; i < c.head_dim; ++i) {
                dot += double(pr.q[size_t(qi) * p.q_stride + h * c.head_dim + i]) * K(t, h, i);
              }
              e[t] = dot * p.scale;
              mx = std::max(mx, e[t]);
            }
            double sum = with_sinks ? std::exp(sinks[h] - mx) : 0.0;
            for (int t = first; t <= pos; ++t) sum += (e[t] = std::exp(e[t] - mx));
            for (int i = 0; i < c.head_dim; ++i) {
              double acc = 0;
              for (int t = first; t <= pos; ++t) acc += e[t] / sum * V(t, h, i);
              want[size_t(qi) * p.out_stride + h * c.head_dim + i] = float(acc);
            }
          }
        }
        std::vector<float> ref(pr.out_size(), NAN);
        p.out = ref.data();
        PagedAttentionReference(p);
        EXPECT_LT(MaxAbsDiff(ref, want), 1e-6);
        for (Isa isa : testing::AvailableIsas()) {
          testing::ScopedIsaCap cap(isa);
          std::vector<float> got(pr.out_size(), NAN);
          p.out = got.data();
          PagedAttention(p, &pool);
          EXPECT_LT(MaxAbsDiff(got, want), 2e-5) << IsaName(isa);
        }
      }
    }
  }
}

TEST(PagedAttentionTest, BatchEqualsOneCallPerSequence) {
  // A batched decode step: several sequences of different lengths, one query row each, plus a
  // prefill chunk, all in one call.
  std::mt19937 rng(11);
  std::vector<Case> cases;
  for (int i = 0; i < 6; ++i) cases.push_back({8, 2, 64, 16, 20 + 37 * i, 1, DType::kF16});
  cases.push_back({8, 2, 64, 16, 90, 30, DType::kF16});
  std::vector<std::unique_ptr<Problem>> probs;
  std::vector<PagedAttentionParams> params;
  std::vector<std::vector<float>> batched, single;
  for (const Case& c : cases) {
    probs.push_back(std::make_unique<Problem>(c, rng));
    batched.emplace_back(probs.back()->out_size(), NAN);
    single.emplace_back(probs.back()->out_size(), NAN);
  }
  util::ThreadPool pool(2);
  for (size_t i = 0; i < probs.size(); ++i) {
    probs[i]->p.out = single[i].data();
    PagedAttention(probs[i]->p, &pool);
    params.push_back(probs[i]->p);
    params.back().out = batched[i].data();
  }
  PagedAttentionBatch(params, &pool);
  for (size_t i = 0; i < probs.size(); ++i) {
    // The same kernel computes each item either way, so the results are bit-identical.
    EXPECT_EQ(MaxAbsDiff(batched[i], single[i]), 0.0) << "sequence " << i;
  }
  PagedAttentionBatch({}, &pool);  // nothing to do is fine
}

}  // namespace
}  // namespace tandem::kernels
