// Exports a KV transport's own counters as Prometheus series of a Metrics registry:
// kv_transport_bytes_total{transport, lanes} from TransportStats::bytes_written_by_lanes, read
// at every scrape. Used by every process that sends KV (prefill, decode, kvstore), so an
// operator (and the pod harness) can see which lanes KV took, e.g. tcp between pods and never
// shared memory.
//
// Ownership: borrows both; the transport must outlive every scrape of `metrics` (in the
// services, both live until main returns). Threading: the hook runs on the exposer's thread;
// KvTransport::stats() is thread-safe.
#pragma once

#include <string>

#include "common/transfer/transfer.h"
#include "services/common/metrics.h"

namespace tandem::services {

void ExportTransportMetrics(Metrics* metrics, const std::string& model_name,
                            const std::string& role, const transfer::KvTransport* transport);

}  // namespace tandem::services
