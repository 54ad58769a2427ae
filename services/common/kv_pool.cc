#include "services/common/kv_pool.h"

#include <span>
#include <utility>

#include "common/util/status_util.h"

namespace tandem::services {

absl::StatusOr<EngineInRegion> CreateEngineInRegion(std::shared_ptr<const engine::Model> model,
                                                    const engine::EngineOptions& options,
                                                    transfer::KvTransport* transport) {
  engine::EngineOptions eo = options;
  EngineInRegion out;
  if (transport != nullptr) {
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
  if (transport != nullptr && !out.in_transport_memory) {
    std::span<uint8_t> mem = out.engine->kv().memory();
    TANDEM_ASSIGN_OR_RETURN(out.region, transport->RegisterRegion(mem.data(), mem.size()));
  }
  return out;
}

}  // namespace tandem::services
