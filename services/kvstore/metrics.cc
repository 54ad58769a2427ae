#include "services/kvstore/metrics.h"

#include "absl/strings/str_cat.h"

namespace tandem::kvstore {
namespace {

// Label values may not carry raw quotes, backslashes or newlines.
std::string Escape(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string PrometheusText(const TieredStoreStats& s, const std::string& model_name,
                           const std::string& role) {
  const std::string base =
      absl::StrCat("model_name=\"", Escape(model_name), "\",role=\"", Escape(role), "\"");
  std::string out;
  struct Family {
    const char* name;
    const char* type;
    const char* help;
    int64_t (*get)(const TierStats&);
  };
  const Family families[] = {
      {"kvstore_tier_bytes", "gauge", "Bytes held by each KV store tier.",
       [](const TierStats& t) { return static_cast<int64_t>(t.used_bytes); }},
      {"kvstore_tier_capacity_bytes", "gauge", "Capacity of each KV store tier.",
       [](const TierStats& t) { return static_cast<int64_t>(t.capacity_bytes); }},
      {"kvstore_tier_blocks", "gauge", "Blocks held by each KV store tier.",
       [](const TierStats& t) { return t.blocks; }},
      {"kvstore_tier_hits_total", "counter", "Gets served by each tier.",
       [](const TierStats& t) { return t.hits; }},
      {"kvstore_tier_misses_total", "counter", "Gets that looked past each tier.",
       [](const TierStats& t) { return t.misses; }},
  };
  int64_t integrity = 0;
  for (const TierStats& t : s.tiers) integrity += t.integrity_failures;
  for (const Family& f : families) {
    absl::StrAppend(&out, "# HELP tandem:", f.name, " ", f.help, "\n# TYPE tandem:", f.name, " ",
                    f.type, "\n");
    for (int k = 0; k < kNumTiers; ++k) {
      if (s.tiers[k].name.empty()) continue;  // tier disabled
      absl::StrAppend(&out, "tandem:", f.name, "{", base, ",tier=\"",
                      TierKindName(static_cast<TierKind>(k)), "\"} ", f.get(s.tiers[k]), "\n");
    }
  }
  absl::StrAppend(&out,
                  "# HELP tandem:kv_integrity_failures_total KV blocks that failed their "
                  "checksum.\n# TYPE tandem:kv_integrity_failures_total counter\n",
                  "tandem:kv_integrity_failures_total{", base, "} ", integrity, "\n");
  return out;
}

}  // namespace tandem::kvstore
