// The KV store's Prometheus series, on the shared registry of services/common/metrics.h, under
// the names DESIGN.md fixes (prefix `tandem_`, labels model_name and role): the gauge
// kvstore_tier_bytes{tier} and the counter kv_integrity_failures_total, plus per tier
// kvstore_tier_capacity_bytes, kvstore_tier_blocks, kvstore_tier_hits_total and
// kvstore_tier_misses_total. A disabled tier has no series.
//
// Threading: thread-safe (the store and the registry are). Counters follow the store's
// cumulative stats; only scrape hooks (one at a time) or one caller may update a registry.
// Ownership: ExportKvStoreMetrics borrows the store, which must outlive every scrape of
// `metrics` (stop its MetricsServer first).
#pragma once

#include <string>

#include "services/common/metrics.h"
#include "services/kvstore/tiered_store.h"

namespace tandem::kvstore {

// Sets the series of `metrics` from a snapshot of the store's stats.
void UpdateKvStoreMetrics(const TieredStoreStats& s, const std::string& model_name,
                          const std::string& role, services::Metrics* metrics);

// Creates the series now and refreshes them from store->stats() before every scrape.
void ExportKvStoreMetrics(const TieredStore* store, const std::string& model_name,
                          const std::string& role, services::Metrics* metrics);

// The text exposition of one snapshot, rendered through a registry of its own: for callers
// that serve or log metrics without a registry.
std::string PrometheusText(const TieredStoreStats& s, const std::string& model_name,
                           const std::string& role = "kvstore");

}  // namespace tandem::kvstore
