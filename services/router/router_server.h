// RouterServer: the router process minus flag parsing. Owns the model's tokenizer (model_holder.h),
// the worker registry, admission control, the worker channels and the gRPC server
// (services/common's bootstrap) that hosts the Inference and Registry services plus grpc.health.v1
// and reflection. A background thread expires worker leases. With HttpFrontOptions::enabled it also
// runs the OpenAI-compatible HTTP front door (http_server.h), which sends completions to this
// router's own gRPC endpoint over loopback, so both front doors share one code path. It records
// Prometheus metrics (router_metrics.h) served on the HTTP front door's GET /metrics and, with
// RouterOptions::metrics_port, on a /metrics endpoint of their own.
//
// Lifecycle: Create (listens and serves before it returns) -> Shutdown (health turns
// NOT_SERVING, new requests are refused with UNAVAILABLE, running ones get `grace` to finish,
// then everything left is cancelled and connections close) -> destruction.
// Threading: port() and the accessors may be called from any thread; Shutdown once.
// Without RouterOptions::model_path the router learns the model from the first worker that
// registers (model_holder.h): until then requests get UNAVAILABLE and grpc.health.v1 says
// NOT_SERVING (the HTTP /health 503).
// Errors: Create fails on bad options (INVALID_ARGUMENT), an unreadable model, or a port it
// cannot bind (UNAVAILABLE).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "services/common/grpc_server.h"
#include "services/common/metrics.h"
#include "services/router/admission.h"
#include "services/router/http_server.h"
#include "services/router/model_holder.h"
#include "services/router/router_model.h"
#include "services/router/router_service.h"
#include "services/router/worker_channels.h"
#include "services/router/worker_registry.h"

namespace tandem::router {

// The HTTP front door; off unless enabled.
struct HttpFrontOptions {
  bool enabled = false;
  int port = 0;                               // 0: any free port (see RouterServer::http_port())
  std::function<std::string()> metrics_text;  // GET /metrics body (default: the router's)
};

class RouterServer {
 public:
  static absl::StatusOr<std::unique_ptr<RouterServer>> Create(const RouterOptions& o,
                                                              const HttpFrontOptions& http = {});
  ~RouterServer();
  RouterServer(const RouterServer&) = delete;
  RouterServer& operator=(const RouterServer&) = delete;

  int port() const { return server_->port(); }
  std::string address() const;  // host:port as clients on this host reach it
  int http_port() const { return http_ == nullptr ? 0 : http_->port(); }  // 0: no HTTP
  HttpServer* http() { return http_.get(); }                              // null without HTTP
  void Shutdown(absl::Duration grace = absl::Seconds(5));

  WorkerRegistry& registry() { return *registry_; }
  const Admission& admission() const { return *admission_; }
  // The served model; only once it is known (with a model file: always).
  const RouterModel& model() const { return *models_->model(); }
  const ModelHolder& models() const { return *models_; }
  const InferenceService& inference() const { return *inference_; }
  services::Metrics& metrics() { return *metrics_; }
  RouterMetrics& router_metrics() { return *router_metrics_; }
  int metrics_port() const { return metrics_server_ == nullptr ? 0 : metrics_server_->port(); }

 private:
  RouterServer() = default;
  void SweepLoop();
  void RefreshMetrics();  // the scrape hook: gauges from admission and the registry

  RouterOptions o_;
  std::unique_ptr<ModelHolder> models_;
  absl::Mutex learn_mu_;  // orders learning the model after server_ is set
  std::unique_ptr<WorkerRegistry> registry_;
  std::unique_ptr<Admission> admission_;
  std::unique_ptr<WorkerChannels> channels_;
  std::unique_ptr<services::Metrics> metrics_;
  std::unique_ptr<RouterMetrics> router_metrics_;
  std::unique_ptr<InferenceService> inference_;
  std::unique_ptr<RegistryService> registry_service_;
  std::unique_ptr<services::GrpcServer> server_;
  std::unique_ptr<HttpServer> http_;  // after server_: destroyed (stopped) first
  std::unique_ptr<services::MetricsServer> metrics_server_;  // reads all of the above
  absl::Notification stop_;
  std::thread sweeper_;
  bool shut_down_ = false;
};

}  // namespace tandem::router
