// Unset proto sampling fields take the engine's defaults; set ones arrive unchanged.
#include "services/common/sampling_convert.h"

#include "gtest/gtest.h"

namespace tandem::services {
namespace {

TEST(SamplingConvertTest, UnsetFieldsTakeEngineDefaults) {
  const engine::SamplingParams d;
  const engine::SamplingParams s = SamplingFromProto(v1::SamplingParams());
  EXPECT_EQ(s.temperature, d.temperature);
  EXPECT_EQ(s.top_k, d.top_k);
  EXPECT_EQ(s.top_p, d.top_p);
  EXPECT_EQ(s.min_p, d.min_p);
  EXPECT_EQ(s.repetition_penalty, d.repetition_penalty);
  EXPECT_EQ(s.presence_penalty, d.presence_penalty);
  EXPECT_EQ(s.frequency_penalty, d.frequency_penalty);
  EXPECT_EQ(s.penalty_last_n, d.penalty_last_n);
  EXPECT_EQ(s.seed, d.seed);
  EXPECT_EQ(s.max_tokens, d.max_tokens);
  EXPECT_TRUE(s.stop_token_ids.empty());
  EXPECT_TRUE(s.stop_strings.empty());
  EXPECT_FALSE(s.ignore_eos);
}

TEST(SamplingConvertTest, SetFieldsArriveUnchanged) {
  v1::SamplingParams p;
  p.set_temperature(0);  // explicitly greedy: set-to-zero is not "unset"
  p.set_top_k(7);
  p.set_top_p(0.5f);
  p.set_min_p(0.25f);
  p.set_repetition_penalty(1.5f);
  p.set_presence_penalty(-0.5f);
  p.set_frequency_penalty(0.75f);
  p.set_penalty_last_n(-1);
  p.set_seed(0xfeedbeefcafeULL);
  p.set_max_tokens(123);
  p.add_stop_token_ids(5);
  p.add_stop_token_ids(9);
  p.add_stop("\n\n");
  p.set_ignore_eos(true);
  p.set_speculative(false);
  const engine::SamplingParams s = SamplingFromProto(p);
  EXPECT_EQ(s.temperature, 0.0f);
  EXPECT_EQ(s.top_k, 7);
  EXPECT_EQ(s.top_p, 0.5f);
  EXPECT_EQ(s.min_p, 0.25f);
  EXPECT_EQ(s.repetition_penalty, 1.5f);
  EXPECT_EQ(s.presence_penalty, -0.5f);
  EXPECT_EQ(s.frequency_penalty, 0.75f);
  EXPECT_EQ(s.penalty_last_n, -1);
  EXPECT_EQ(s.seed, 0xfeedbeefcafeULL);
  EXPECT_EQ(s.max_tokens, 123);
  EXPECT_EQ(s.stop_token_ids, (std::vector<int32_t>{5, 9}));
  EXPECT_EQ(s.stop_strings, (std::vector<std::string>{"\n\n"}));
  EXPECT_TRUE(s.ignore_eos);
  EXPECT_FALSE(s.speculative);
  EXPECT_TRUE(SamplingFromProto(v1::SamplingParams()).speculative);  // unset: allowed

  // And back: every field explicit, so the round trip is exact.
  const engine::SamplingParams again = SamplingFromProto(SamplingToProto(s));
  EXPECT_EQ(again.top_k, 7);
  EXPECT_EQ(again.seed, s.seed);
  EXPECT_EQ(again.stop_strings, s.stop_strings);
  EXPECT_FALSE(again.speculative);
  EXPECT_TRUE(SamplingToProto(s).has_temperature());
}

}  // namespace
}  // namespace tandem::services
