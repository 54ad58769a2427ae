#include "services/common/transport_metrics.h"

namespace tandem::services {

void ExportTransportMetrics(Metrics* metrics, const std::string& model_name,
                            const std::string& role, const transfer::KvTransport* transport) {
  if (metrics == nullptr || transport == nullptr) return;
  const std::string name = transport->capabilities().name;
  metrics->AddScrapeHook([=] {
    for (const auto& [lanes, bytes] : transport->stats().bytes_written_by_lanes) {
      AdvanceCounterTo(metrics->KvTransportBytes(model_name, role, name, lanes),
                       static_cast<double>(bytes));
    }
  });
}

}  // namespace tandem::services
