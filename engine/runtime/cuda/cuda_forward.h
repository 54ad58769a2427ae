// The CUDA forward pass of Engine (EngineOptions::device == Device::kCuda).
//
// What runs where:
// - Create, once: every matrix the forward pass multiplies by is uploaded. Q8_0, Q4_0, Q4_K and
//   MXFP4 keep their GGUF rows and go through kernels::cuda::QuantGemv (at most kMaxGemvBatch
//   activation rows per call, so a step of T tokens makes ceil(T / 8) calls per matrix); F32,
//   F16, BF16 and Q6_K are widened or rounded once to BF16 on the host and multiplied with
//   cuBLASLt (CublasLtGemm::Bf16, activations rounded to BF16 per call). Norm weights, biases
//   and rope frequency factors are uploaded as f32. The KV pool is device memory: allocated here
//   unless the caller passed EngineOptions::kv_memory (then it must be device memory of the
//   current device).
// - Step, on the host: token embedding rows (the table stays in host memory, memory-mapped),
//   positions, KV slot numbers and the block tables of the batch; one upload of each.
// - Step, on the GPU, per layer: RMSNorm, the Q/K/V projections (+ biases), RoPE, the KV write
//   (converting or quantising into the cache type), paged attention (the decode kernel for runs
//   of single-token chunks, the prefill kernel for longer chunks), the output projection and
//   residual, RMSNorm, gate/up, SwiGLU, down and residual. Then the final norm of the rows whose
//   logits were asked for, the classifier, and one copy of those logits to the host.
// Everything is queued on one stream; Step synchronises before on_layer_done (so layer l's
// K/V are in device memory when it runs) and once at the end.
//
// Built only with CUDA (TANDEM_HAVE_CUDA); engine.cc reports "built without CUDA" otherwise.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/model/model.h"
#include "engine/runtime/device_forward.h"
#include "engine/runtime/engine.h"

namespace tandem::engine {

// FAILED_PRECONDITION "device cuda: no CUDA device is visible ..." unless a GPU is usable.
absl::Status CudaDeviceAvailable();

// `o` has its defaults resolved (Engine::Create does that); kv_bytes is the KV pool size.
// Uses the calling thread's current CUDA device.
// FAILED_PRECONDITION: no visible device, or one older than compute capability 8.0.
// INVALID_ARGUMENT: a weight type with no GPU path (the message names the tensor), a head_dim
// the attention kernels do not take, max_batch_tokens over 65535, or kv_memory that is not
// device memory of the current device. RESOURCE_EXHAUSTED: out of device memory.
absl::StatusOr<std::unique_ptr<DeviceForward>> CreateCudaForward(std::shared_ptr<const Model> model,
                                                                 const EngineOptions& o,
                                                                 uint64_t kv_bytes);

}  // namespace tandem::engine
