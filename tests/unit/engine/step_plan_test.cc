// StepPlan: the per-step upload and attention launches of a device forward pass, checked
// entry by entry on a batch in the scheduler's shape (decode tokens split by a prefill chunk,
// block tables longer than the positions need).
#include "engine/runtime/step_plan.h"

#include <vector>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

std::vector<int32_t> Range(int32_t from, int32_t n) {
  std::vector<int32_t> v(n);
  for (int32_t i = 0; i < n; ++i) v[i] = from + i;
  return v;
}

TEST(StepPlanTest, DecodeRunsAndPrefillChunks) {
  const std::vector<int32_t> a_tok = {5}, c_tok = Range(100, 17), b_tok = {6}, d_tok = {7};
  const std::vector<int32_t> a_tab = {3, 4, 10}, c_tab = {7, 8}, b_tab = {5, 6, 9}, d_tab = {1};
  const SeqChunk chunks[] = {
      {a_tok, 20, a_tab, true},  // decode: keys 0..20, blocks 3, 4 (10 is not used yet)
      {c_tok, 0, c_tab, false},  // prefill of 17 tokens: blocks 7, 8
      {b_tok, 33, b_tab, true},  // decode: keys 0..33, blocks 5, 6, 9
      {d_tok, 15, d_tab, true},  // decode: keys 0..15, block 1
  };
  StepPlan p;
  p.Build(chunks, /*block_size=*/16, /*decode_kernel=*/true);

  std::vector<int32_t> positions = {20};
  for (int32_t i = 0; i < 17; ++i) positions.push_back(i);
  positions.push_back(33);
  positions.push_back(15);
  ASSERT_GE(p.ints.size(), positions.size());
  EXPECT_EQ(std::vector<int32_t>(p.ints.begin(), p.ints.begin() + 20), positions);

  std::vector<int64_t> slots = {4 * 16 + 4};
  for (int32_t i = 0; i < 16; ++i) slots.push_back(7 * 16 + i);
  slots.push_back(8 * 16);
  slots.push_back(9 * 16 + 1);
  slots.push_back(1 * 16 + 15);
  EXPECT_EQ(p.slots, slots);
  EXPECT_EQ(p.logit_rows, (std::vector<int64_t>{0, 18, 19}));

  ASSERT_EQ(p.launches.size(), 3u);
  auto ints = [&](int64_t off, int64_t n) {
    return std::vector<int32_t>(p.ints.begin() + off, p.ints.begin() + off + n);
  };
  const AttentionLaunch& l0 = p.launches[0];
  EXPECT_TRUE(l0.decode);
  EXPECT_EQ(l0.row, 0);
  EXPECT_EQ(l0.n, 1);
  EXPECT_EQ(l0.max_len, 21);
  EXPECT_EQ(l0.table_width, 2);
  EXPECT_EQ(ints(l0.lens_off, 1), (std::vector<int32_t>{21}));
  EXPECT_EQ(ints(l0.table_off, 2), (std::vector<int32_t>{3, 4}));

  const AttentionLaunch& l1 = p.launches[1];
  EXPECT_FALSE(l1.decode);
  EXPECT_EQ(l1.row, 1);
  EXPECT_EQ(l1.n, 17);
  EXPECT_EQ(l1.max_pos, 16);
  EXPECT_EQ(ints(l1.table_off, 2), (std::vector<int32_t>{7, 8}));

  const AttentionLaunch& l2 = p.launches[2];
  EXPECT_TRUE(l2.decode);
  EXPECT_EQ(l2.row, 18);
  EXPECT_EQ(l2.n, 2);
  EXPECT_EQ(l2.max_len, 34);
  EXPECT_EQ(l2.table_width, 3);
  EXPECT_EQ(ints(l2.lens_off, 2), (std::vector<int32_t>{34, 16}));
  EXPECT_EQ(ints(l2.table_off, 6), (std::vector<int32_t>{5, 6, 9, 1, 0, 0}));
  // Nothing past the last table: the upload is exactly what the launches read.
  EXPECT_EQ(static_cast<int64_t>(p.ints.size()), l2.table_off + 6);
}

TEST(StepPlanTest, WithoutTheDecodeKernelEveryChunkIsAPrefillLaunch) {
  const std::vector<int32_t> a_tok = {5}, b_tok = {6, 7};
  const std::vector<int32_t> a_tab = {3, 4}, b_tab = {2};
  const SeqChunk chunks[] = {{a_tok, 16, a_tab, true}, {b_tok, 0, b_tab, true}};
  StepPlan p;
  p.Build(chunks, 16, /*decode_kernel=*/false);
  ASSERT_EQ(p.launches.size(), 2u);
  EXPECT_FALSE(p.launches[0].decode);
  EXPECT_EQ(p.launches[0].n, 1);
  EXPECT_EQ(p.launches[0].max_pos, 16);
  EXPECT_EQ(p.ints[p.launches[0].table_off], 3);
  EXPECT_EQ(p.ints[p.launches[0].table_off + 1], 4);
  EXPECT_FALSE(p.launches[1].decode);
  EXPECT_EQ(p.launches[1].row, 1);
  EXPECT_EQ(p.launches[1].n, 2);
  EXPECT_EQ(p.ints[p.launches[1].table_off], 2);
  EXPECT_EQ(p.logit_rows, (std::vector<int64_t>{0, 2}));
  // Rebuilding starts from scratch.
  p.Build({chunks, 1}, 16, true);
  EXPECT_EQ(p.slots.size(), 1u);
  EXPECT_EQ(p.launches.size(), 1u);
  EXPECT_TRUE(p.launches[0].decode);
}

}  // namespace
}  // namespace tandem::engine
