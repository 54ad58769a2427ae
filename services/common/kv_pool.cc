#include "services/common/kv_pool.h"

#include <cstdio>
#include <span>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"

namespace tandem::services {

absl::Status CheckWorkerKvPlacement(const engine::EngineOptions& options,
                                    const transfer::KvTransport* transport) {
  if (options.device == engine::Device::kCpu) return absl::OkStatus();
  // First whether there is a GPU at all: the clearest answer on a machine without one.
  TANDEM_RETURN_IF_ERROR(engine::CheckDeviceAvailable(options.device));
  if (transport == nullptr || transport->capabilities().device_memory) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "--device ", engine::DeviceName(options.device),
      " keeps the KV pool in GPU memory, which the KV transport '", transport->capabilities().name,
      "' cannot register or read; use --transport cuda_ipc (GPUs of one node), nccl (any nodes), or a UCX built "
      "with CUDA (its cuda_copy/cuda_ipc transports, which Debian's libucx lacks)"));
}

absl::StatusOr<EngineInRegion> CreateEngineInRegion(std::shared_ptr<const engine::Model> model,
                                                    const engine::EngineOptions& options,
                                                    transfer::KvTransport* transport) {
  engine::EngineOptions eo = options;
  EngineInRegion out;
  // Transport-allocated memory is host memory; a GPU engine's pool is its own device memory,
  // registered below.
  if (transport != nullptr && eo.device == engine::Device::kCpu) {
    TANDEM_ASSIGN_OR_RETURN(const uint64_t bytes, engine::Engine::KvBytes(*model, eo));
    absl::StatusOr<transfer::AllocatedRegion> a = transport->AllocateRegion(bytes);
    if (a.ok()) {
      eo.kv_memory = a->base;
      eo.kv_memory_bytes = bytes;
      out.region = a->descriptor;
      out.in_transport_memory = true;
    } else if (a.status().code() != absl::StatusCode::kUnimplemented) {
      return a.status();
    }
  }
  absl::StatusOr<std::unique_ptr<engine::Engine>> engine = engine::Engine::Create(model, eo);
  if (!engine.ok()) {
    if (out.region) (void)transport->DeregisterRegion(out.region->region_id);
    return engine.status();
  }
  out.engine = std::move(*engine);
  // A GPU pool is the engine's own device memory: registered as it is (cuda_ipc exports it).
  if (transport != nullptr && !out.in_transport_memory) {
    std::span<uint8_t> mem = out.engine->kv().memory();
    TANDEM_ASSIGN_OR_RETURN(out.region, transport->RegisterRegion(mem.data(), mem.size()));
  }
  return out;
}

void ReportKvInvariants(const std::string& worker, const engine::BlockPool& pool,
                        const engine::BlockPool* draft_pool, uint64_t* seen,
                        ServingMetrics* metrics) {
  const uint64_t n = pool.violations() + (draft_pool != nullptr ? draft_pool->violations() : 0);
  if (n == *seen) return;
  *seen = n;
  std::string last = pool.last_violation().ToString();
  if (draft_pool != nullptr && !draft_pool->last_violation().ok()) {
    absl::StrAppend(&last, "; draft pool: ", draft_pool->last_violation().ToString());
  }
  std::fprintf(stderr, "%s: KV invariant violations: %llu so far, the last: %s\n", worker.c_str(),
               static_cast<unsigned long long>(n), last.c_str());
  if (metrics != nullptr) {
    AdvanceCounterTo(metrics->kv_invariant_violations, static_cast<double>(n));
  }
}

}  // namespace tandem::services
