#include "tools/tandem/device_costs.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/gguf/gguf.h"
#include "common/util/status_util.h"
#include "engine/model/model.h"

namespace tandem::tools {

const std::vector<DeviceSpec>& KnownDevices() {
  // NVIDIA's data sheets: SXM parts, dense (not sparse) BF16 tensor rates.
  static const std::vector<DeviceSpec> d = {
      {"h100", 3.35e12, 989e12, "H100 SXM5 80 GB: HBM3 3.35 TB/s, BF16 989 TFLOP/s"},
      {"h200", 4.8e12, 989e12, "H200 SXM 141 GB: HBM3e 4.8 TB/s, BF16 989 TFLOP/s"},
      {"a100", 2.039e12, 312e12, "A100 SXM4 80 GB: HBM2e 2.039 TB/s, BF16 312 TFLOP/s"},
      {"l40s", 0.864e12, 362e12, "L40S 48 GB: GDDR6 864 GB/s, BF16 362 TFLOP/s"},
  };
  return d;
}

absl::StatusOr<DeviceSpec> FindDevice(std::string_view name) {
  std::vector<std::string> names;
  for (const DeviceSpec& d : KnownDevices()) {
    if (d.name == name) return d;
    names.push_back(d.name);
  }
  return absl::InvalidArgumentError(absl::StrCat("--device: unknown device '", std::string(name),
                                                 "' (known: ", absl::StrJoin(names, ", "), ")"));
}

absl::StatusOr<ModelDemand> DemandOf(const std::string& model_path) {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<gguf::GgufFile> f, gguf::GgufFile::Open(model_path));
  TANDEM_ASSIGN_OR_RETURN(engine::ModelConfig c, engine::ModelConfig::FromGguf(*f));
  bool tied = true;  // no output.weight: the embedding table is also the output matrix
  for (const gguf::TensorInfo& t : f->tensors()) {
    if (t.name == "output.weight") tied = false;
  }
  ModelDemand m;
  for (const gguf::TensorInfo& t : f->tensors()) {
    const bool embedding = t.name == "token_embd.weight";
    if (t.dims.size() < 2) {  // norms and biases: read, not multiplied by
      m.weight_bytes += static_cast<double>(t.nbytes);
      continue;
    }
    if (embedding && !tied) continue;  // a lookup reads one row per token
    m.weight_bytes += static_cast<double>(t.nbytes);
    m.flops_per_token += 2.0 * static_cast<double>(t.NumElements());
  }
  m.kv_bytes_per_position = 2.0 * c.n_layer * c.n_head_kv * c.head_dim * 2.0;
  m.n_layer = std::max(1, c.n_layer);
  return m;
}

router::sim::Costs CostsFromDevice(const ModelDemand& m, const DeviceSpec& d,
                                   const DeviceEfficiency& eff) {
  const double bw = d.memory_bps * eff.memory;
  const double fl = d.flops * eff.compute;
  router::sim::StepCoefficients s;
  s.intercept_s = m.weight_bytes / bw;
  s.prefill_token_s = m.flops_per_token / fl;
  s.decode_seq_s = m.flops_per_token / fl;
  s.decode_kv_token_s = m.kv_bytes_per_position / bw;
  router::sim::Costs c;
  c.prefill = c.decode = c.colocated = s;
  c.transfer_s_per_token = m.kv_bytes_per_position / 50e9 / m.n_layer;
  c.dispatch_s = 0.5e-3;
  return c;
}

}  // namespace tandem::tools
