// Prometheus metrics every tandem service shares: one registry holding the families DESIGN.md
// fixes (names prefixed `tandem_`, every series labelled model_name and role), per-(model, role)
// handles the services record into, and an HTTP exposer that serves the registry on /metrics.
//
// A family appears in the exposition only once it has a series: Metrics() registers every
// family, ServingMetrics() creates the request-path series at zero, the KV store creates its
// per-tier series. So a worker shows the serving families and a KV store its tier families.
// The exposer adds prometheus-cpp's own unlabelled exposer_* series to /metrics (scrapes,
// bytes served, scrape latency); Render() has only the registry's.
// Units: seconds and bytes; kv_cache_usage_perc is a fraction in [0, 1] (1 = every block used).
//
// Threading: everything here is thread-safe. Recording through a handle (Observe, Increment,
// Set) is a few atomics; ServingMetrics(), RequestSuccess() and KvStoreTierBytes() look series
// up under a mutex, so hot paths keep the reference they return. Scrape hooks run, one at a
// time, on the exposer's thread at every scrape (and in Render) before the registry is read.
// Ownership: a Metrics owns its families, series and handles; references stay valid while it
// lives. A MetricsServer borrows its Metrics, which must outlive it; whatever a scrape hook
// reads must outlive the MetricsServer (stop the server first).
// Errors: MetricsServer::Start returns UNAVAILABLE when it cannot listen. prometheus-cpp throws
// only for programmer errors (bad names, unsorted buckets); no exception leaves this module.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
class Collectable;
}  // namespace prometheus

namespace tandem::services {

// The metric name prefix DESIGN.md fixes.
inline constexpr char kMetricPrefix[] = "tandem_";

// The finished_reason values request_success_total starts with (at zero): the proto's finish
// reasons in lower case. "error" counts requests that ended with a failure status.
inline constexpr const char* kFinishReasons[] = {"stop", "length", "cancelled", "error"};

// The model_name label for a model file: its stem ("stories260K" for .../stories260K.gguf), the
// name the router matches workers by, so router and worker series join on it.
std::string ModelNameFromPath(const std::string& path);

// Bucket boundaries. LLM latencies span milliseconds (a decode step of a small model) to minutes
// (a long queue or generation); byte sizes span one small block to a whole long context.
const std::vector<double>& TtftBuckets();               // 1 ms .. 120 s
const std::vector<double>& InterTokenBuckets();         // 0.5 ms .. 5 s
const std::vector<double>& RequestLatencyBuckets();     // e2e and queue time: 5 ms .. 30 min
const std::vector<double>& KvTransferSecondsBuckets();  // 50 us .. 30 s
const std::vector<double>& KvTransferBytesBuckets();    // 4 KiB .. 16 GiB, powers of 4

// Raises a counter to `total` (a cumulative count kept elsewhere, e.g. a store's stats). Never
// lowers it: a total that went backwards (its owner restarted) is ignored. Only one thread may
// advance a given counter (scrape hooks run one at a time, which is enough).
void AdvanceCounterTo(prometheus::Counter& counter, double total);

// The request-path series of one (model_name, role): what a prefill, decode or colocated worker
// records, and what the router will record (TTFT, e2e, queue time, migrations).
class ServingMetrics {
 public:
  // Histograms.
  prometheus::Histogram& time_to_first_token;  // arrival -> first token, where that is seen
  prometheus::Histogram& inter_token_latency;  // between consecutive tokens of one request
  prometheus::Histogram& e2e_request_latency;  // arrival -> the request's end, any outcome
  prometheus::Histogram& request_queue_time;   // arrival -> admission (compute starts)
  prometheus::Histogram& kv_transfer_seconds;  // transfer time compute did not hide
  prometheus::Histogram& kv_transfer_bytes;    // bytes of one request's KV transfer
  // Gauges.
  prometheus::Gauge& num_requests_running;
  prometheus::Gauge& num_requests_waiting;
  prometheus::Gauge& kv_cache_usage_perc;  // fraction of KV blocks not free, in [0, 1]
  // Counters.
  prometheus::Counter& prefix_cache_queries;  // blocks looked up in the prefix cache
  prometheus::Counter& prefix_cache_hits;     // blocks it served
  prometheus::Counter& kv_integrity_failures;
  // KV block reference-count invariants broken (engine/kv/block_pool.h): a caller's bug.
  prometheus::Counter& kv_invariant_violations;
  prometheus::Counter& migrations;

  // request_success_total{finished_reason}: one of kFinishReasons, or any other reason (its
  // series is created on first use).
  prometheus::Counter& RequestSuccess(const std::string& finished_reason);

  const std::string& model_name() const { return model_name_; }
  const std::string& role() const { return role_; }

 private:
  friend class Metrics;
  ServingMetrics(prometheus::Histogram& ttft, prometheus::Histogram& itl,
                 prometheus::Histogram& e2e, prometheus::Histogram& queue,
                 prometheus::Histogram& xfer_s, prometheus::Histogram& xfer_b,
                 prometheus::Gauge& running, prometheus::Gauge& waiting, prometheus::Gauge& usage,
                 prometheus::Counter& pc_queries, prometheus::Counter& pc_hits,
                 prometheus::Counter& integrity, prometheus::Counter& invariants,
                 prometheus::Counter& migrations,
                 prometheus::Family<prometheus::Counter>* success, std::string model_name,
                 std::string role);

  prometheus::Family<prometheus::Counter>* success_;
  std::string model_name_;
  std::string role_;
};

// Speculative decoding series of one (model, role, proposer): draft tokens verified, those
// accepted, and how many were accepted per verify step. The decode worker advances them from
// its scheduler's counts (engine::SchedulerStats).
struct SpecMetrics {
  prometheus::Counter& draft_tokens;     // spec_draft_tokens_total
  prometheus::Counter& accepted_tokens;  // spec_accepted_tokens_total
  prometheus::Histogram& acceptance;     // spec_acceptance_length, buckets 0, 1, .., 16
};

// Engine utilisation of one (model, role), from its steps (services/common/step_report.h):
// model_bandwidth_utilization and model_flops_utilization (gauges, recent steps) and one
// observation per engine step in engine_step_seconds, step_bandwidth_utilization and
// step_flops_utilization (histograms). Of an MoE model also expert_tokens_total{layer, expert},
// the tokens routed to each expert: the load that expert placement balances.
struct UtilizationMetrics {
  prometheus::Gauge& mbu;
  prometheus::Gauge& mfu;
  prometheus::Histogram& step_seconds;
  prometheus::Histogram& step_mbu;
  prometheus::Histogram& step_mfu;
  // The expert_tokens_total series of (layer, expert), [layer * n_expert + expert], created by
  // the first call (later calls return the same series); from the stepping thread only.
  std::vector<prometheus::Counter*>& ExpertTokens(int32_t n_layer, int32_t n_expert);

  prometheus::Family<prometheus::Counter>* expert_family = nullptr;
  prometheus::Labels labels;
  std::vector<prometheus::Counter*> expert_tokens;
};

class Metrics {
 public:
  // Registers every DESIGN.md family (no series yet) on a registry of its own.
  Metrics();
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The request-path handle for (model_name, role), created on first use with every series at
  // zero (and request_success_total for each of kFinishReasons). The same object afterwards.
  ServingMetrics& Serving(const std::string& model_name, const std::string& role);

  // kvstore_tier_bytes{tier} and kv_integrity_failures_total for services that are not on the
  // request path (the KV store). Created on first use.
  prometheus::Gauge& KvStoreTierBytes(const std::string& model_name, const std::string& role,
                                      const std::string& tier);
  prometheus::Counter& KvIntegrityFailures(const std::string& model_name, const std::string& role);
  // kv_transport_bytes_total{transport, lanes}: KV bytes this process sent over its transport,
  // by the lanes they went over (services/common/transport_metrics.h keeps it current).
  prometheus::Counter& KvTransportBytes(const std::string& model_name, const std::string& role,
                                        const std::string& transport, const std::string& lanes);
  // The speculative series labelled proposer (its method name); created on first use, the
  // same object afterwards.
  SpecMetrics& Speculative(const std::string& model_name, const std::string& role,
                           const std::string& proposer);
  // The utilisation series of (model_name, role); created on first use.
  UtilizationMetrics& Utilization(const std::string& model_name, const std::string& role);

  // Runs before every scrape and Render, one hook at a time: refreshes series from a source that
  // keeps its own stats (gauges Set, counters AdvanceCounterTo). Hooks must be thread-safe with
  // respect to their source and cannot be removed.
  void AddScrapeHook(std::function<void()> hook);

  // The text exposition format (what GET /metrics returns), after running the scrape hooks.
  std::string Render() const;

  // For families a service adds beside the shared ones (same registry, same exposition). Name
  // them with kMetricPrefix and label them model_name and role.
  prometheus::Registry& registry() { return *registry_; }

  // What an exposer collects: the scrape hooks, then the registry.
  std::weak_ptr<prometheus::Collectable> collectable() const;

 private:
  class Collector;
  void RunScrapeHooks() const;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<Collector> collector_;

  prometheus::Family<prometheus::Histogram>* ttft_;
  prometheus::Family<prometheus::Histogram>* itl_;
  prometheus::Family<prometheus::Histogram>* e2e_;
  prometheus::Family<prometheus::Histogram>* queue_;
  prometheus::Family<prometheus::Histogram>* xfer_seconds_;
  prometheus::Family<prometheus::Histogram>* xfer_bytes_;
  prometheus::Family<prometheus::Gauge>* running_;
  prometheus::Family<prometheus::Gauge>* waiting_;
  prometheus::Family<prometheus::Gauge>* kv_usage_;
  prometheus::Family<prometheus::Gauge>* tier_bytes_;
  prometheus::Family<prometheus::Counter>* pc_queries_;
  prometheus::Family<prometheus::Counter>* pc_hits_;
  prometheus::Family<prometheus::Counter>* integrity_;
  prometheus::Family<prometheus::Counter>* invariants_;
  prometheus::Family<prometheus::Counter>* transport_bytes_;
  prometheus::Family<prometheus::Counter>* success_;
  prometheus::Family<prometheus::Counter>* spec_draft_;
  prometheus::Family<prometheus::Counter>* spec_accepted_;
  prometheus::Family<prometheus::Histogram>* spec_acceptance_;
  std::map<std::tuple<std::string, std::string, std::string>, std::unique_ptr<SpecMetrics>>
      spec_ ABSL_GUARDED_BY(mu_);
  prometheus::Family<prometheus::Counter>* migrations_;
  prometheus::Family<prometheus::Gauge>* mbu_;
  prometheus::Family<prometheus::Gauge>* mfu_;
  prometheus::Family<prometheus::Histogram>* step_seconds_;
  prometheus::Family<prometheus::Histogram>* step_mbu_;
  prometheus::Family<prometheus::Histogram>* step_mfu_;
  prometheus::Family<prometheus::Counter>* expert_tokens_;
  std::map<std::pair<std::string, std::string>, std::unique_ptr<UtilizationMetrics>> util_
      ABSL_GUARDED_BY(mu_);

  absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, std::unique_ptr<ServingMetrics>> serving_
      ABSL_GUARDED_BY(mu_);
  mutable absl::Mutex hooks_mu_;  // held while hooks run: one scrape's hooks at a time
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(hooks_mu_);
};

// Serves a Metrics over HTTP: GET /metrics returns Render()'s text plus the exposer_* series.
// Two civetweb threads answer scrapes; recording never waits for them. Stopping takes about 2 s
// once a scrape has been served (civetweb's worker threads wind down on a timer).
class MetricsServer {
 public:
  // Listens on host:port ("0.0.0.0" or "::" for every interface); port 0 picks a free port.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& host, int port,
                                                              Metrics* metrics);
  // Stops listening; a scrape in progress finishes first.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const { return port_; }
  // http://host:port/metrics, with a wildcard host shown as 127.0.0.1.
  std::string url() const;

 private:
  MetricsServer() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string host_;
  int port_ = 0;
};

}  // namespace tandem::services
