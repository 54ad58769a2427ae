#include "services/common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <exception>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/text_serializer.h"

namespace tandem::services {
namespace {

std::string Name(const char* base) { return absl::StrCat(kMetricPrefix, base); }

prometheus::Labels BaseLabels(const std::string& model_name, const std::string& role) {
  return {{"model_name", model_name}, {"role", role}};
}

template <typename Builder>
auto& Register(Builder b, const char* name, const char* help, prometheus::Registry& r) {
  return b.Name(Name(name)).Help(help).Register(r);
}

bool IsWildcard(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

std::string HostPort(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return v6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

// A port the kernel reports free on the loopback interface right now. Used only when civetweb
// cannot report the port it bound for port 0; the caller retries if another process takes it.
int PickFreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  int port = 0;
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

}  // namespace

std::string ModelNameFromPath(const std::string& path) {
  return std::filesystem::path(path).stem().string();
}

const std::vector<double>& TtftBuckets() {
  static const auto* b = new std::vector<double>{
      0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
      1.0,   1.5,   2.0,  3.0,  5.0,  7.5,  10,   15,  20,   30,  60,  120};
  return *b;
}

const std::vector<double>& InterTokenBuckets() {
  static const auto* b = new std::vector<double>{
      0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
      0.075,  0.1,   0.15,   0.2,   0.3,    0.4,  0.5,   0.75, 1.0,   2.5,  5.0};
  return *b;
}

const std::vector<double>& RequestLatencyBuckets() {
  static const auto* b =
      new std::vector<double>{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,  10,  15,
                              20,    30,   45,    60,   90,  120,  180, 300, 600, 1200, 1800};
  return *b;
}

const std::vector<double>& KvTransferSecondsBuckets() {
  static const auto* b =
      new std::vector<double>{0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                              0.05,    0.1,    0.25,    0.5,    1.0,   2.5,    5.0,   10,   30};
  return *b;
}

const std::vector<double>& KvTransferBytesBuckets() {
  static const auto* b = [] {
    auto* v = new std::vector<double>;
    for (double x = 4096; x <= 16.0 * (1ull << 30); x *= 4) v->push_back(x);
    return v;
  }();
  return *b;
}

void AdvanceCounterTo(prometheus::Counter& counter, double total) {
  const double now = counter.Value();
  if (total > now) counter.Increment(total - now);
}

ServingMetrics::ServingMetrics(prometheus::Histogram& ttft, prometheus::Histogram& itl,
                               prometheus::Histogram& e2e, prometheus::Histogram& queue,
                               prometheus::Histogram& xfer_s, prometheus::Histogram& xfer_b,
                               prometheus::Gauge& running, prometheus::Gauge& waiting,
                               prometheus::Gauge& usage, prometheus::Counter& pc_queries,
                               prometheus::Counter& pc_hits, prometheus::Counter& integrity,
                               prometheus::Counter& invariants, prometheus::Counter& migrations,
                               prometheus::Family<prometheus::Counter>* success,
                               std::string model_name, std::string role)
    : time_to_first_token(ttft),
      inter_token_latency(itl),
      e2e_request_latency(e2e),
      request_queue_time(queue),
      kv_transfer_seconds(xfer_s),
      kv_transfer_bytes(xfer_b),
      num_requests_running(running),
      num_requests_waiting(waiting),
      kv_cache_usage_perc(usage),
      prefix_cache_queries(pc_queries),
      prefix_cache_hits(pc_hits),
      kv_integrity_failures(integrity),
      kv_invariant_violations(invariants),
      migrations(migrations),
      success_(success),
      model_name_(std::move(model_name)),
      role_(std::move(role)) {}

prometheus::Counter& ServingMetrics::RequestSuccess(const std::string& finished_reason) {
  prometheus::Labels l = BaseLabels(model_name_, role_);
  l["finished_reason"] = finished_reason;
  return success_->Add(l);
}

// Runs the owner's scrape hooks, then reads the registry. The exposer holds it by weak_ptr, so
// a Metrics that is gone is simply not scraped.
class Metrics::Collector : public prometheus::Collectable {
 public:
  explicit Collector(const Metrics* owner) : owner_(owner) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    owner_->RunScrapeHooks();
    return owner_->registry_->Collect();
  }

 private:
  const Metrics* owner_;
};

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      collector_(std::make_shared<Collector>(this)) {
  prometheus::Registry& r = *registry_;
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  ttft_ = &Register(BuildHistogram(), "time_to_first_token_seconds",
                    "Time from a request's arrival to its first token.", r);
  itl_ = &Register(BuildHistogram(), "inter_token_latency_seconds",
                   "Time between consecutive tokens of one request.", r);
  e2e_ = &Register(BuildHistogram(), "e2e_request_latency_seconds",
                   "Time from a request's arrival to its end, whatever the outcome.", r);
  queue_ = &Register(BuildHistogram(), "request_queue_time_seconds",
                     "Time a request waited before its compute started.", r);
  xfer_seconds_ = &Register(BuildHistogram(), "kv_transfer_seconds",
                            "KV transfer time of one request that compute did not hide.", r);
  xfer_bytes_ =
      &Register(BuildHistogram(), "kv_transfer_bytes", "Bytes of one request's KV transfer.", r);
  running_ = &Register(BuildGauge(), "num_requests_running", "Requests being computed.", r);
  waiting_ = &Register(BuildGauge(), "num_requests_waiting", "Requests queued for compute.", r);
  kv_usage_ = &Register(BuildGauge(), "kv_cache_usage_perc",
                        "Fraction of KV cache blocks in use (1 means all of them).", r);
  tier_bytes_ =
      &Register(BuildGauge(), "kvstore_tier_bytes", "Bytes held by each KV store tier.", r);
  pc_queries_ = &Register(BuildCounter(), "prefix_cache_queries_total",
                          "KV blocks looked up in the prefix cache.", r);
  pc_hits_ = &Register(BuildCounter(), "prefix_cache_hits_total",
                       "KV blocks the prefix cache served instead of recomputing them.", r);
  integrity_ = &Register(BuildCounter(), "kv_integrity_failures_total",
                         "KV blocks that failed their checksum.", r);
  invariants_ = &Register(BuildCounter(), "kv_invariant_violations_total",
                          "KV block reference counts taken or dropped on a free block or an id "
                          "outside the pool (refused, and a bug).", r);
  transport_bytes_ = &Register(BuildCounter(), "kv_transport_bytes_total",
                               "KV bytes sent over the KV transport, by the lanes they used.", r);
  success_ = &Register(BuildCounter(), "request_success_total",
                       "Requests that ended, by finish reason.", r);
  migrations_ =
      &Register(BuildCounter(), "migrations_total", "Requests moved to another worker.", r);
  spec_draft_ = &Register(BuildCounter(), "spec_draft_tokens_total",
                          "Draft tokens speculative decoding verified.", r);
  spec_accepted_ = &Register(BuildCounter(), "spec_accepted_tokens_total",
                             "Draft tokens the target model accepted.", r);
  spec_acceptance_ = &Register(BuildHistogram(), "spec_acceptance_length",
                               "Draft tokens accepted per verify step.", r);
  mbu_ = &Register(BuildGauge(), "model_bandwidth_utilization",
                   "Bytes the recent engine steps had to move per second over the measured peak "
                   "read bandwidth.", r);
  mfu_ = &Register(BuildGauge(), "model_flops_utilization",
                   "FLOPs of the recent engine steps per second over the measured peak.", r);
  step_seconds_ = &Register(BuildHistogram(), "engine_step_seconds", "Wall time of one engine step.", r);
  step_mbu_ = &Register(BuildHistogram(), "step_bandwidth_utilization",
                        "Model bandwidth utilisation of one engine step.", r);
  step_mfu_ = &Register(BuildHistogram(), "step_flops_utilization",
                        "Model FLOPs utilisation of one engine step.", r);
  expert_tokens_ = &Register(BuildCounter(), "expert_tokens_total",
                             "Tokens the engine routed to each expert of each MoE layer.", r);
}

std::vector<prometheus::Counter*>& UtilizationMetrics::ExpertTokens(int32_t n_layer,
                                                                    int32_t n_expert) {
  if (expert_tokens.empty() && expert_family != nullptr) {
    for (int32_t l = 0; l < n_layer; ++l) {
      for (int32_t e = 0; e < n_expert; ++e) {
        prometheus::Labels series = labels;
        series["layer"] = std::to_string(l);
        series["expert"] = std::to_string(e);
        expert_tokens.push_back(&expert_family->Add(series));
      }
    }
  }
  return expert_tokens;
}

Metrics::~Metrics() = default;

ServingMetrics& Metrics::Serving(const std::string& model_name, const std::string& role) {
  absl::MutexLock l(&mu_);
  std::unique_ptr<ServingMetrics>& m = serving_[{model_name, role}];
  if (m != nullptr) return *m;
  const prometheus::Labels base = BaseLabels(model_name, role);
  m.reset(new ServingMetrics(
      ttft_->Add(base, TtftBuckets()), itl_->Add(base, InterTokenBuckets()),
      e2e_->Add(base, RequestLatencyBuckets()), queue_->Add(base, RequestLatencyBuckets()),
      xfer_seconds_->Add(base, KvTransferSecondsBuckets()),
      xfer_bytes_->Add(base, KvTransferBytesBuckets()), running_->Add(base), waiting_->Add(base),
      kv_usage_->Add(base), pc_queries_->Add(base), pc_hits_->Add(base), integrity_->Add(base),
      invariants_->Add(base), migrations_->Add(base), success_, model_name, role));
  for (const char* reason : kFinishReasons) m->RequestSuccess(reason);
  return *m;
}

prometheus::Gauge& Metrics::KvStoreTierBytes(const std::string& model_name, const std::string& role,
                                             const std::string& tier) {
  prometheus::Labels l = BaseLabels(model_name, role);
  l["tier"] = tier;
  return tier_bytes_->Add(l);
}

prometheus::Counter& Metrics::KvIntegrityFailures(const std::string& model_name,
                                                  const std::string& role) {
  return integrity_->Add(BaseLabels(model_name, role));
}

prometheus::Counter& Metrics::KvTransportBytes(const std::string& model_name,
                                               const std::string& role,
                                               const std::string& transport,
                                               const std::string& lanes) {
  prometheus::Labels l = BaseLabels(model_name, role);
  l["transport"] = transport;
  l["lanes"] = lanes;
  return transport_bytes_->Add(l);
}

SpecMetrics& Metrics::Speculative(const std::string& model_name, const std::string& role,
                                  const std::string& proposer) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<SpecMetrics>& m = spec_[{model_name, role, proposer}];
  if (m != nullptr) return *m;
  prometheus::Labels l = BaseLabels(model_name, role);
  l["proposer"] = proposer;
  // Upper bounds 0, 1, .., 16: one bucket per accepted count up to the largest --spec-tokens.
  std::vector<double> buckets;
  for (int n = 0; n <= 16; ++n) buckets.push_back(n);
  m.reset(new SpecMetrics{spec_draft_->Add(l), spec_accepted_->Add(l),
                          spec_acceptance_->Add(l, buckets)});
  return *m;
}

UtilizationMetrics& Metrics::Utilization(const std::string& model_name, const std::string& role) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<UtilizationMetrics>& m = util_[{model_name, role}];
  if (m != nullptr) return *m;
  const prometheus::Labels l = BaseLabels(model_name, role);
  // Fractions 0.05 .. 1 (and above, for a peak measured low), and step times 0.5 ms .. 10 s.
  const std::vector<double> fractions = {0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
  const std::vector<double> seconds = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                       0.25, 0.5, 1, 2.5, 5, 10};
  m.reset(new UtilizationMetrics{mbu_->Add(l), mfu_->Add(l), step_seconds_->Add(l, seconds),
                                 step_mbu_->Add(l, fractions), step_mfu_->Add(l, fractions),
                                 expert_tokens_, l});
  return *m;
}

void Metrics::AddScrapeHook(std::function<void()> hook) {
  absl::MutexLock l(&hooks_mu_);
  hooks_.push_back(std::move(hook));
}

void Metrics::RunScrapeHooks() const {
  absl::MutexLock l(&hooks_mu_);
  for (const auto& h : hooks_) h();
}

std::string Metrics::Render() const {
  return prometheus::TextSerializer().Serialize(collector_->Collect());
}

std::weak_ptr<prometheus::Collectable> Metrics::collectable() const { return collector_; }

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& host,
                                                                    int port, Metrics* metrics) {
  if (metrics == nullptr) return absl::InvalidArgumentError("MetricsServer needs a Metrics");
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", port, " is out of range"));
  }
  const std::string bind_host = host.empty() ? "0.0.0.0" : host;
  std::unique_ptr<MetricsServer> s(new MetricsServer);
  s->host_ = bind_host;
  std::string last_error;
  // Port 0: civetweb binds a free port but may not report which; then pick one ourselves and
  // retry if another process takes it first.
  const int attempts = port == 0 ? 8 : 1;
  for (int i = 0; i < attempts; ++i) {
    const int want = (port == 0 && i > 0) ? PickFreePort() : port;
    try {
      auto exposer = std::make_unique<prometheus::Exposer>(HostPort(bind_host, want), 2);
      const std::vector<int> ports = exposer->GetListeningPorts();
      const int bound = ports.empty() ? want : ports.front();
      if (bound == 0) continue;  // bound somewhere we cannot name: pick a port ourselves
      exposer->RegisterCollectable(metrics->collectable(), "/metrics");
      s->exposer_ = std::move(exposer);
      s->port_ = bound;
      return s;
    } catch (const std::exception& e) {
      last_error = e.what();
    }
  }
  return absl::UnavailableError(
      absl::StrCat("cannot serve metrics on ", HostPort(bind_host, port), ": ", last_error));
}

MetricsServer::~MetricsServer() = default;

std::string MetricsServer::url() const {
  return absl::StrCat("http://", HostPort(IsWildcard(host_) ? "127.0.0.1" : host_, port_),
                      "/metrics");
}

}  // namespace tandem::services
