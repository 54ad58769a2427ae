// The forward pass of an engine whose weights and KV pool live on an accelerator (Engine with
// EngineOptions::device other than kCpu). Engine keeps the API, validation and the KvCache
// bookkeeping; a DeviceForward owns everything on the device: weights, activations, the KV
// memory it allocated, streams and library handles.
//
// Ownership: created by the backend's factory (engine/runtime/cuda/cuda_forward.h) before the
// KvCache, because the cache's memory comes from it; the Engine owns both and destroys the
// cache first. Threading: like Engine::Step, one thread at a time, not necessarily the same
// thread each time. Errors: Step returns INTERNAL for a device failure; the engine is then
// unusable (a CUDA context error is sticky).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "engine/kv/kv_cache.h"
#include "engine/runtime/engine.h"

namespace tandem::engine {

class DeviceForward {
 public:
  virtual ~DeviceForward() = default;

  // KV pool memory the backend allocated (device memory, at least `kv_bytes` of Create), or
  // nullptr when the caller passed EngineOptions::kv_memory.
  virtual void* kv_memory() const = 0;

  // Engine::Step after validation: `chunks` hold n_tokens tokens, every position is covered by
  // its block table, and `kv` is the device-resident cache built on kv_memory().
  virtual absl::Status Step(std::span<const SeqChunk> chunks, int64_t n_tokens, KvCache& kv,
                            std::vector<float>* logits,
                            const std::function<void(int32_t layer)>& on_layer_done) = 0;
};

}  // namespace tandem::engine
