// An engine whose KV pool peers can write into: the setup prefill and decode workers share.
//
// Where the transport can allocate memory that peers write most cheaply (UCX: shared memory a
// local peer maps, so a put is one memcpy), the engine's pool lives there; otherwise the engine
// maps its own and the transport registers it. Either way the whole pool is one region,
// registered once, so requests cost no registration.
//
// Ownership: the caller owns the engine and the registration. Teardown order matters and
// differs by case: a transport-allocated pool is freed by DeregisterRegion, so the engine must
// go first; an engine-mapped pool must be deregistered while the engine still maps it.
#pragma once

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "common/transfer/transfer.h"
#include "engine/runtime/engine.h"
#include "services/common/metrics.h"

namespace tandem::services {

struct EngineInRegion {
  std::unique_ptr<engine::Engine> engine;
  std::optional<transfer::RegionDescriptor> region;  // set when the pool is registered
  bool in_transport_memory = false;                  // the pool is transport-allocated memory
};

// Whether a worker can keep its KV pool where `options.device` puts it, moving KV with
// `transport` (null: none). A host pool always can. A pool in GPU memory (Device::kCuda) needs a
// usable GPU (FAILED_PRECONDITION "device cuda: no CUDA device is visible ...", or "built
// without CUDA") and a transport that registers and reads device memory
// (Capabilities::device_memory: cuda_ipc, or UCX built with CUDA, detected at run time);
// Debian's UCX has no CUDA support, and staging every transfer through host memory would hide
// that cost, so that is FAILED_PRECONDITION naming what is needed. Checksums, prefix onboarding
// and publishing of a device pool run on the device or through pinned staging (kv_device.h).
// Called by both workers before they create their engine.
absl::Status CheckWorkerKvPlacement(const engine::EngineOptions& options,
                                    const transfer::KvTransport* transport);

// Creates the engine; with a transport, its KV pool becomes one registered region. Without
// one (nullptr) the engine maps its own pool and nothing is registered. On error nothing is
// left registered or allocated.
absl::StatusOr<EngineInRegion> CreateEngineInRegion(std::shared_ptr<const engine::Model> model,
                                                    const engine::EngineOptions& options,
                                                    transfer::KvTransport* transport);

// What a worker's KV pools refused since the last call (engine/kv/block_pool.h: a double free,
// a use after free): logged once, naming the worker and the last violation of each pool, and
// counted in `metrics` (may be null). `*seen` is the count already reported; `draft_pool` may
// be null. Engine thread.
void ReportKvInvariants(const std::string& worker, const engine::BlockPool& pool,
                        const engine::BlockPool* draft_pool, uint64_t* seen,
                        ServingMetrics* metrics);

}  // namespace tandem::services
