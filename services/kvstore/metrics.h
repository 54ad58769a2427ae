// Prometheus text exposition of the KV store's stats under the names DESIGN.md fixes
// (prefix `tandem:`, labels model_name and role): the gauge kvstore_tier_bytes{tier} and the
// counter kv_integrity_failures_total, plus per-tier blocks, capacity, hits and misses.
// Whatever serves /metrics (not built yet) appends this text. Pure function, thread-safe.
#pragma once

#include <string>

#include "services/kvstore/tiered_store.h"

namespace tandem::kvstore {

std::string PrometheusText(const TieredStoreStats& s, const std::string& model_name,
                           const std::string& role = "kvstore");

}  // namespace tandem::kvstore
