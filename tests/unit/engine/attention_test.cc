// PagedAttention against its double-precision reference, over scattered block tables.
#include "tandem/kernels/attention.h"

#include <cmath>
#include <random>
#include <vector>

#include "common/util/thread_pool.h"
#include "gtest/gtest.h"
#include "tandem/kernels/fp16.h"

namespace tandem::kernels {
namespace {

struct Case {
  int n_head, n_kv_head, head_dim, block_size, ctx, n_q;
  DType type;
};

TEST(PagedAttentionTest, MatchesReference) {
  const Case cases[] = {
      {4, 4, 16, 16, 37, 1, DType::kF32},  {8, 2, 32, 16, 70, 5, DType::kF32},
      {6, 3, 64, 8, 100, 100, DType::kF32}, {8, 2, 32, 16, 70, 3, DType::kF16},
  };
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  util::ThreadPool pool(2);
  for (const Case& c : cases) {
    const int n_blocks = (c.ctx + c.block_size - 1) / c.block_size + 3;
    const int slot = c.n_kv_head * c.head_dim;
    std::vector<float> kf(size_t(n_blocks) * c.block_size * slot), vf(kf.size());
    for (auto& x : kf) x = nd(rng);
    for (auto& x : vf) x = nd(rng);
    std::vector<uint16_t> kh(kf.size()), vh(vf.size());
    F32ToFp16Row(kf.data(), kh.data(), kf.size());
    F32ToFp16Row(vf.data(), vh.data(), vf.size());
    // A scattered block table: reversed, skipping block 0.
    std::vector<int32_t> table;
    for (int b = n_blocks - 1; b >= 1; --b) table.push_back(b);
    const int q_dim = c.n_head * c.head_dim;
    std::vector<float> q(size_t(c.n_q) * q_dim);
    for (auto& x : q) x = nd(rng);
    std::vector<int32_t> pos(c.n_q);
    for (int i = 0; i < c.n_q; ++i) pos[i] = c.ctx - c.n_q + i;

    PagedAttentionParams p;
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
    std::vector<float> got(size_t(c.n_q) * q_dim, NAN), want(got.size(), NAN);
    p.out_stride = q_dim;
    p.out = got.data();
    PagedAttention(p, &pool);
    p.out = want.data();
    PagedAttentionReference(p);
    double max_err = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_FALSE(std::isnan(got[i])) << i;
      max_err = std::max(max_err, double(std::fabs(got[i] - want[i])));
    }
    EXPECT_LT(max_err, 1e-4) << "case heads=" << c.n_head << " ctx=" << c.ctx;
  }
}

}  // namespace
}  // namespace tandem::kernels
