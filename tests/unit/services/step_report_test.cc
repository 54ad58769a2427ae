// StepReporter's per-expert load series: after real engine steps of a tiny MoE model,
// expert_tokens_total holds, for every (layer, expert), the tokens the engine routed there.
#include "services/common/step_report.h"

#include <unistd.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "engine/runtime/engine.h"
#include "gtest/gtest.h"
#include "services/common/metrics.h"
#include "tests/fakes/tiny_model.h"
#include "tests/unit/services/metrics_scrape.h"

namespace tandem::services {
namespace {

TEST(StepReporterTest, ExpertTokensFollowTheEnginesRouting) {
  testing::TinyModelOptions o;
  o.arch = "qwen3moe";
  o.n_expert = 8;
  o.n_expert_used = 2;
  const std::string path = (std::filesystem::temp_directory_path() /
                            absl::StrCat("tandem-step-report-", getpid(), ".gguf"))
                               .string();
  ASSERT_TRUE(testing::WriteTinyModel(o, path).ok());
  auto model = engine::Model::Load(path);
  ASSERT_TRUE(model.ok()) << model.status();
  std::filesystem::remove(path);
  engine::EngineOptions eo;
  eo.threads = 1;
  eo.ctx_size = 32;
  eo.max_seqs = 1;
  auto e = engine::Engine::Create(std::shared_ptr<const engine::Model>(std::move(*model)), eo);
  ASSERT_TRUE(e.ok()) << e.status();
  Metrics metrics;
  StepReporter report({20.0, 100.0}, "cpu", &metrics.Utilization("tiny", "decode"));

  const std::vector<int32_t> tokens = testing::RandomTokens(7, (*e)->model().config().n_vocab, 3);
  auto blocks = *(*e)->kv().pool().AllocateN(2);
  std::vector<float> logits;
  for (int32_t pos = 0; pos < 7; ++pos) {
    engine::SeqChunk ch{{&tokens[pos], 1}, pos, blocks, true};
    ASSERT_TRUE((*e)->Step({&ch, 1}, &logits).ok());
    report.Update(**e);
    report.Update(**e);  // no new step: nothing counted twice
  }
  const std::string text = metrics.Render();
  const std::vector<int64_t>& routed = (*e)->expert_tokens();
  for (int32_t l = 0; l < o.n_layer; ++l) {
    double layer_sum = 0;
    for (int32_t x = 0; x < o.n_expert; ++x) {
      const std::string series = absl::StrCat(
          "tandem_expert_tokens_total{expert=\"", x, "\",layer=\"", l,
          "\",model_name=\"tiny\",role=\"decode\"}");
      const std::optional<double> v = testing::SampleValue(text, series);
      ASSERT_TRUE(v.has_value()) << series << "\n" << text;
      EXPECT_EQ(*v, double(routed[size_t(l) * o.n_expert + x])) << series;
      layer_sum += *v;
    }
    EXPECT_EQ(layer_sum, 7 * 2) << "layer " << l;
  }
}

}  // namespace
}  // namespace tandem::services
