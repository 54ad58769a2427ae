// The GPU cost model of `tandem simulate` / `tandem plan --device`: a roofline of the model's
// shape (from its GGUF header) against a device's published peaks. Checked on the real model
// against its own tensor table, across devices, and through LoadCosts' flag rules.
#include "tools/tandem/device_costs.h"

#include <cmath>
#include <filesystem>
#include <string>

#include "common/gguf/gguf.h"
#include "engine/model/model.h"
#include "gtest/gtest.h"
#include "tools/tandem/simulate.h"

namespace tandem::tools {
namespace {

const std::string kModel = std::string(TANDEM_SHARED_MODELS_DIR) + "/stories260K/stories260K.gguf";

TEST(DeviceCostsTest, TheModelsDemandIsWhatItsTensorsHold) {
  if (!std::filesystem::exists(kModel)) GTEST_SKIP() << "no model at " << kModel;
  absl::StatusOr<ModelDemand> m = DemandOf(kModel);
  ASSERT_TRUE(m.ok()) << m.status();
  auto f = *gguf::GgufFile::Open(kModel);
  const engine::ModelConfig c = *engine::ModelConfig::FromGguf(*f);
  // Every byte of the file's tensors but an untied embedding table is read each step.
  double all = 0, embd = 0, vocab_by_embd = 0;
  bool tied = true;
  for (const gguf::TensorInfo& t : f->tensors()) {
    all += static_cast<double>(t.nbytes);
    if (t.name == "token_embd.weight") {
      embd = static_cast<double>(t.nbytes);
      vocab_by_embd = static_cast<double>(t.NumElements());
    }
    if (t.name == "output.weight") tied = false;
  }
  EXPECT_DOUBLE_EQ(m->weight_bytes, tied ? all : all - embd);
  // 2 FLOPs per matrix weight per token: about twice the parameter count.
  const double params = static_cast<double>(c.n_layer) *
                            (2.0 * c.n_embd * c.n_head * c.head_dim +
                             2.0 * c.n_embd * c.n_head_kv * c.head_dim + 3.0 * c.n_embd * c.n_ff) +
                        vocab_by_embd;  // the output matrix, the embedding's shape
  EXPECT_NEAR(m->flops_per_token, 2 * params, 0.01 * 2 * params);
  EXPECT_DOUBLE_EQ(m->kv_bytes_per_position, 2.0 * c.n_layer * c.n_head_kv * c.head_dim * 2.0);
}

TEST(DeviceCostsTest, CoefficientsScaleWithTheDevicesPeaks) {
  // Llama-3-8B in BF16: 16.06 GB of weights, 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes.
  const ModelDemand m{16.06e9, 16.06e9, 131072, 32};
  const DeviceEfficiency eff;
  const router::sim::Costs h100 = CostsFromDevice(m, *FindDevice("h100"), eff);
  const router::sim::Costs h200 = CostsFromDevice(m, *FindDevice("h200"), eff);
  const router::sim::Costs a100 = CostsFromDevice(m, *FindDevice("a100"), eff);
  // Batch-1 decode of 16 GB of weights on an H100 at 75% of 3.35 TB/s: 6.4 ms a token.
  EXPECT_NEAR(h100.decode.Seconds(0, 1, 1000), 16.06e9 / (0.75 * 3.35e12), 0.2e-3);
  EXPECT_NEAR(h100.decode.intercept_s / h200.decode.intercept_s, 4.8 / 3.35, 1e-9);
  EXPECT_DOUBLE_EQ(h100.prefill.prefill_token_s, h200.prefill.prefill_token_s);  // same FLOPs
  EXPECT_NEAR(a100.prefill.prefill_token_s / h100.prefill.prefill_token_s, 989.0 / 312.0, 1e-9);
  // A 2,000-token prefill is compute-bound: about 65 ms on an H100 at half its BF16 rate.
  EXPECT_NEAR(h100.prefill.Seconds(2000, 0, 0), 2000 * 16.06e9 / (0.5 * 989e12) + 6.4e-3, 1e-3);
  // 128 KiB a position over 50 GB/s, of which one layer's share (1/32) is not hidden.
  EXPECT_NEAR(h100.transfer_s_per_token, 131072 / 50e9 / 32, 1e-12);
  EXPECT_FALSE(FindDevice("b300").ok());
}

TEST(DeviceCostsTest, LoadCostsTakesADeviceWithAModelOnly) {
  if (!std::filesystem::exists(kModel)) GTEST_SKIP() << "no model at " << kModel;
  CostSources s;
  s.device = "h100";
  std::string source;
  EXPECT_EQ(LoadCosts(s, &source).status().code(), absl::StatusCode::kInvalidArgument)
      << "a device needs a model";
  s.model = kModel;
  absl::StatusOr<router::sim::Costs> c = LoadCosts(s, &source);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NE(source.find("H100"), std::string::npos) << source;
  EXPECT_GT(c->decode.intercept_s, 0);
  s.device_memory_efficiency = 1.5;
  EXPECT_EQ(LoadCosts(s, &source).status().code(), absl::StatusCode::kInvalidArgument);
  s.device_memory_efficiency = 0.75;
  s.device = "tpu";
  const absl::Status unknown = LoadCosts(s, &source).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.message().find("h200"), std::string::npos) << "names the known devices";
}

}  // namespace
}  // namespace tandem::tools
