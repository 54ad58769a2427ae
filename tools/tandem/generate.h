// `tandem generate`: single-process, single-node generation with the in-process scheduler.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "engine/runtime/engine.h"
#include "engine/sampling/sampler.h"
#include "engine/spec/proposer.h"
#include "tandem/kernels/dtype.h"

namespace tandem::tools {

struct GenerateOptions {
  std::string model_path;
  std::string prompt;
  engine::SamplingParams sampling;
  int32_t threads = 1;
  int32_t ctx_size = 0;
  int32_t batch_tokens = 512;
  kernels::DType kv_type = kernels::DType::kF32;
  // kCuda: weights and KV cache on the GPU (engine/runtime/cuda/cuda_forward.h).
  engine::Device device = engine::Device::kCpu;
  // --speculative / --spec-tokens (ParseSpeculative); off by default.
  engine::SpeculativeOptions speculative;
  bool json = false;
};

// Prints the prompt, then the completion as it streams (or one JSON object with --json).
absl::Status RunGenerate(const GenerateOptions& o);

}  // namespace tandem::tools
