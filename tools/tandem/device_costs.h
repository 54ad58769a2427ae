// Step costs of a GPU worker that was never measured, for `tandem simulate` and `tandem plan`
// (`--device NAME --model M.gguf`): a roofline from the device's published peak figures and the
// model's shape, read from the GGUF header.
//
//   intercept          = weight bytes (all but an untied embedding table) / achieved bandwidth
//   per decode KV token = K and V bytes per position (f16 cache) / achieved bandwidth
//   per prefill token, per decode sequence = 2 FLOPs per weight / achieved FLOP rate
//   KV transfer, per prompt token = K and V bytes per position / 50 GB/s (one 400 Gb/s NIC)
//     / layers: prefill sends each layer's K/V as it finishes, so about one layer's share is
//     not hidden behind compute
//   dispatch = 0.5 ms (the router's added p50 measured in docs/perf/router-overhead.md)
//
// Achieved = published peak x efficiency: by default 0.75 of the memory bandwidth and 0.5 of the
// dense BF16 tensor FLOP rate, assumptions typical of serving engines on these parts, not
// measurements of tandem's CUDA path (which has not run on a GPU yet). Not modelled: kernel
// launch and host overheads per step, prefill attention's quadratic term, quantised weights'
// dequantisation cost. A step's time is the sum of its memory and compute terms, not their
// maximum, so a step errs long by up to the smaller of the two.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "services/router/sim.h"

namespace tandem::tools {

struct DeviceSpec {
  std::string name;        // as --device takes it
  double memory_bps = 0;   // published peak memory bandwidth, bytes/s
  double flops = 0;        // published peak dense BF16 tensor FLOP/s
  std::string published;   // which part and figures
};

// The devices --device knows; INVALID_ARGUMENT naming them for any other name.
const std::vector<DeviceSpec>& KnownDevices();
absl::StatusOr<DeviceSpec> FindDevice(std::string_view name);

struct DeviceEfficiency {
  double memory = 0.75;
  double compute = 0.5;
};

// What a step needs of the model at `model_path` (a GGUF; only its header is read).
struct ModelDemand {
  double weight_bytes = 0;          // read once per step
  double flops_per_token = 0;       // 2 per weight the token multiplies by
  double kv_bytes_per_position = 0;  // K and V of every layer, f16
  int n_layer = 1;
};
absl::StatusOr<ModelDemand> DemandOf(const std::string& model_path);

router::sim::Costs CostsFromDevice(const ModelDemand& m, const DeviceSpec& d,
                                   const DeviceEfficiency& eff);

}  // namespace tandem::tools
