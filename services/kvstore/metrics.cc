#include "services/kvstore/metrics.h"

#include "absl/strings/str_cat.h"

namespace tandem::kvstore {
namespace {

template <typename Builder>
auto& KvFamily(Builder b, const char* name, const char* help, services::Metrics* m) {
  // The registry merges a second registration of a name into the first: this is a lookup
  // after the first call.
  return b.Name(absl::StrCat(services::kMetricPrefix, name)).Help(help).Register(m->registry());
}

}  // namespace

void UpdateKvStoreMetrics(const TieredStoreStats& s, const std::string& model_name,
                          const std::string& role, services::Metrics* m) {
  auto& capacity = KvFamily(prometheus::BuildGauge(), "kvstore_tier_capacity_bytes",
                            "Capacity of each KV store tier.", m);
  auto& blocks = KvFamily(prometheus::BuildGauge(), "kvstore_tier_blocks",
                          "Blocks held by each KV store tier.", m);
  auto& hits = KvFamily(prometheus::BuildCounter(), "kvstore_tier_hits_total",
                        "Gets served by each KV store tier.", m);
  auto& misses = KvFamily(prometheus::BuildCounter(), "kvstore_tier_misses_total",
                          "Gets that looked past each KV store tier.", m);
  int64_t integrity = s.rejected_blocks;
  for (int k = 0; k < kNumTiers; ++k) {
    const TierStats& t = s.tiers[k];
    integrity += t.integrity_failures;
    if (t.name.empty()) continue;  // tier disabled
    const std::string tier = t.label.empty() ? TierKindName(static_cast<TierKind>(k)) : t.label;
    const prometheus::Labels l = {{"model_name", model_name}, {"role", role}, {"tier", tier}};
    m->KvStoreTierBytes(model_name, role, tier).Set(static_cast<double>(t.used_bytes));
    capacity.Add(l).Set(static_cast<double>(t.capacity_bytes));
    blocks.Add(l).Set(static_cast<double>(t.blocks));
    services::AdvanceCounterTo(hits.Add(l), static_cast<double>(t.hits));
    services::AdvanceCounterTo(misses.Add(l), static_cast<double>(t.misses));
  }
  services::AdvanceCounterTo(m->KvIntegrityFailures(model_name, role),
                             static_cast<double>(integrity));
}

void ExportKvStoreMetrics(const TieredStore* store, const std::string& model_name,
                          const std::string& role, services::Metrics* metrics) {
  UpdateKvStoreMetrics(store->stats(), model_name, role, metrics);
  metrics->AddScrapeHook([store, model_name, role, metrics] {
    UpdateKvStoreMetrics(store->stats(), model_name, role, metrics);
  });
}

std::string PrometheusText(const TieredStoreStats& s, const std::string& model_name,
                           const std::string& role) {
  services::Metrics m;
  UpdateKvStoreMetrics(s, model_name, role, &m);
  return m.Render();
}

}  // namespace tandem::kvstore
