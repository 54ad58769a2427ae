// The step API shared by prefill and decode.
//
// Step runs one forward pass over a batch that mixes chunks of several sequences: a prefill
// chunk (many tokens of one sequence) or a single decode token look the same, a span of tokens
// at consecutive positions starting at start_pos. Every weight matrix is read once per step
// for the whole batch, which is what makes continuous batching and chunked prefill pay.
// Each chunk's K/V are written into its sequence's blocks; for chunks that ask, the logits of
// the chunk's last token are returned.
//
// Block allocation belongs to the caller (the scheduler, or a decode service that reserved
// blocks for a remote prefill): a chunk's block table must already cover its positions.
// Threading: one thread calls Step at a time; Step uses the engine's thread pool inside.
//
// Devices: EngineOptions::device picks where the forward pass runs. kCpu is the SIMD CPU
// path below. kCuda (engine/runtime/cuda/) uploads the weights to the GPU at Create, keeps the
// KV pool in device memory (kv().on_device()) and runs every layer there; Step copies back only
// the logits asked for. Callers see the same Step API either way; only code that reads KV bytes
// on the host (checksums, host-memory transfers) has to check kv().on_device().
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/util/thread_pool.h"
#include "engine/kv/kv_cache.h"
#include "engine/model/model.h"
#include "engine/runtime/moe.h"
#include "engine/runtime/step_cost.h"
#include "tandem/kernels/attention.h"

namespace tandem::engine {

enum class Device { kCpu, kCuda };

class DeviceForward;  // engine/runtime/device_forward.h

struct EngineOptions {
  int32_t threads = 1;
  int32_t ctx_size = 0;      // max positions per sequence; 0: min(model context, 4096)
  int32_t max_seqs = 8;      // sizes the KV pool when kv_blocks is 0
  int32_t kv_blocks = 0;     // 0: enough for max_seqs full contexts
  int32_t block_size = 16;
  // kF32, kF16, or kI8 / kFp8E4M3 (codes plus per-slot scales, tandem/kernels/kv_quant.h).
  kernels::DType kv_type = kernels::DType::kF32;
  int32_t max_batch_tokens = 512;  // tokens per step (chunked prefill splits longer prompts)
  // Optional memory for the KV cache (see KvCacheOptions::external_memory); query the size
  // with Engine::KvBytes first. With kCuda it must be device memory of the current device.
  void* kv_memory = nullptr;
  uint64_t kv_memory_bytes = 0;
  // kCuda: weights and KV pool on the calling thread's current CUDA device. Create fails with
  // FAILED_PRECONDITION when tandem was built without CUDA or no device is visible, and with
  // INVALID_ARGUMENT naming the tensor when a weight's type has no GPU path.
  Device device = Device::kCpu;
  // Expert parallelism (engine/runtime/expert_parallel.h): the other ranks of this worker's
  // group, which compute the experts the placement does not give rank 0. Borrowed; must
  // outlive the engine. A step they fail fails with their status (UNAVAILABLE when a rank is
  // gone), and its K/V writes are then to be discarded like any failed step's.
  ExpertPeers* expert_peers = nullptr;
};

// "cpu" / "cuda" (flags and logs); DeviceFromName is nullopt for anything else.
const char* DeviceName(Device d);
std::optional<Device> DeviceFromName(std::string_view name);
// Whether this process can run on `d` at all, checked before loading a model: OK for the CPU;
// for CUDA, FAILED_PRECONDITION "device cuda: no CUDA device is visible ..." when no GPU is
// usable, or "... built without CUDA" in a build without the CUDA engine.
absl::Status CheckDeviceAvailable(Device d);

struct SeqChunk {
  std::span<const int32_t> tokens;
  int32_t start_pos = 0;
  std::span<const int32_t> block_table;
  bool want_logits = false;
  // With want_logits: the logits of the chunk's last n_logits tokens (1 .. tokens.size()), in
  // position order. Speculative verification asks for every position of its k+1 tokens.
  int32_t n_logits = 1;
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(std::shared_ptr<const Model> model,
                                                        const EngineOptions& o);
  ~Engine();
  // Bytes of KV memory Create will need for these options (after defaults are applied).
  static absl::StatusOr<uint64_t> KvBytes(const Model& model, const EngineOptions& o);

  // INVALID_ARGUMENT for a token id outside the vocabulary, positions past ctx_size, a block
  // table too short, n_logits outside [1, tokens], or more than max_batch_tokens tokens. On
  // success `logits` holds n_vocab floats for each logit row (n_logits per chunk with
  // want_logits), chunk after chunk.
  // on_layer_done(l), when given, runs on the calling thread as soon as layer l's K/V of every
  // chunk are in the cache, so a prefill worker can start sending layer l while later layers
  // compute. (With kCuda the device has finished layer l's K/V writes when it runs.)
  // A device failure mid-step is INTERNAL with the CUDA error.
  absl::Status Step(std::span<const SeqChunk> chunks, std::vector<float>* logits,
                    const std::function<void(int32_t layer)>& on_layer_done = nullptr);

  // The last successful step: its shape, wall time and least work (engine/runtime/step_cost.h),
  // and how many steps have succeeded; the cost model fitted over them.
  struct StepRecord {
    StepShape shape;
    double seconds = 0;
    StepWork work;
  };
  const StepRecord& last_step() const { return last_; }
  int64_t steps() const { return steps_; }
  const StepCostModel& step_cost() const { return cost_; }

  const Model& model() const { return *model_; }
  KvCache& kv() { return *kv_; }
  const EngineOptions& options() const { return o_; }
  int32_t ctx_size() const { return o_.ctx_size; }
  util::ThreadPool& pool() { return pool_; }
  // MoE models: tokens routed to each (layer, expert) since Create, [layer * n_expert + expert]
  // (empty for a dense model). Read between steps, on the stepping thread.
  const std::vector<int64_t>& expert_tokens() const { return expert_tokens_; }

 private:
  Engine(std::shared_ptr<const Model> model, const EngineOptions& o,
         std::unique_ptr<DeviceForward> device, std::unique_ptr<KvCache> kv);
  absl::Status Validate(std::span<const SeqChunk> chunks, int64_t* n_tokens) const;
  absl::Status CpuStep(std::span<const SeqChunk> chunks, int64_t n_tokens,
                       std::vector<float>* logits,
                       const std::function<void(int32_t layer)>& on_layer_done);

  std::shared_ptr<const Model> model_;
  EngineOptions o_;
  std::unique_ptr<DeviceForward> device_;  // null on the CPU; owns device KV memory it made
  std::unique_ptr<KvCache> kv_;
  util::ThreadPool pool_;
  int64_t kv_bytes_per_position_;  // K and V of every layer
  StepRecord last_;
  int64_t steps_ = 0;
  StepCostModel cost_;

  // Scratch, grown on demand and reused between steps.
  std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, tmp_;
  std::vector<kernels::PagedAttentionParams> attn_params_;  // per layer, one per chunk
  std::vector<int32_t> pos_;
  MoeFfn moe_;
  std::vector<int64_t> expert_tokens_;
};

}  // namespace tandem::engine
