#include "services/router/router_server.h"

#include <algorithm>
#include <optional>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/gguf/gguf.h"
#include "common/util/status_util.h"
#include "services/router/log.h"
#include "services/router/plan.h"

namespace tandem::router {
namespace {

// How often SweepLoop expires leases: four times a lease, at most every second.
absl::Duration SweepPeriod(absl::Duration lease) {
  return std::max(absl::Milliseconds(20), std::min(lease / 4, absl::Seconds(1)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Create(const RouterOptions& o,
                                                                   const HttpFrontOptions& http) {
  TANDEM_RETURN_IF_ERROR(ValidateRouterOptions(o));
  auto s = std::unique_ptr<RouterServer>(new RouterServer());
  s->o_ = o;
  ModelHolderOptions mo;
  mo.model_path = o.model_path;
  mo.model_id = o.model_id;
  mo.ctx_size = o.ctx_size;
  mo.need_chat = http.enabled;
  // Learned from a card: the health service turns SERVING (it said NOT_SERVING until now).
  mo.on_learned = [raw = s.get()](const RouterModel&) {
    absl::MutexLock l(&raw->learn_mu_);
    if (raw->server_ != nullptr) raw->server_->SetServing(true);
  };
  TANDEM_ASSIGN_OR_RETURN(s->models_, ModelHolder::Create(mo));
  const RouterModel* known = s->models_->model();
  RegistryOptions ro;
  ro.lease = o.worker_lease;
  ro.policy = o.policy;
  // SweepLoop ticks every SweepPeriod; two periods missed (and half a lease) is a stall.
  ro.stall_after = std::max(o.worker_lease / 2, 2 * SweepPeriod(o.worker_lease));
  if (known != nullptr) {
    // Workers report general.name (or the architecture when the file has none). A model
    // learned from a card is checked by its hash instead (ModelHolder::Admit).
    const engine::ModelConfig& mc = known->config();
    ro.model_names = {known->id(), known->path(), mc.name.empty() ? mc.arch_name : mc.name};
  }
  s->registry_ = std::make_unique<WorkerRegistry>(ro);
  s->admission_ = std::make_unique<Admission>(o.max_inflight, o.max_queue);
  s->channels_ = std::make_unique<WorkerChannels>();
  s->metrics_ = std::make_unique<services::Metrics>();
  // The model_name label: without a model file, --model-id (or "unknown") names the series.
  const std::string metrics_model =
      known != nullptr ? known->id() : (o.model_id.empty() ? "unknown" : o.model_id);
  s->router_metrics_ =
      std::make_unique<RouterMetrics>(s->metrics_.get(), metrics_model, o.autoscale);
  s->metrics_->AddScrapeHook([raw = s.get()] { raw->RefreshMetrics(); });
  s->inference_ = std::make_unique<InferenceService>(s->models_.get(), s->registry_.get(),
                                                     s->admission_.get(), s->channels_.get(), o,
                                                     s->router_metrics_.get());
  s->registry_service_ =
      std::make_unique<RegistryService>(s->registry_.get(), s->models_.get());

  services::GrpcServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.services = {s->inference_.get(), s->registry_service_.get()};
  so.max_message_bytes = o.max_message_bytes;
  so.serving_at_start = known != nullptr;
  {
    // A worker may register (and the model be learned) as soon as the server runs: on_learned
    // must see server_ set, so it waits here for the assignment.
    absl::MutexLock l(&s->learn_mu_);
    TANDEM_ASSIGN_OR_RETURN(s->server_, services::GrpcServer::Start(so));
  }
  s->sweeper_ = std::thread([raw = s.get()] { raw->SweepLoop(); });
  if (http.enabled) {
    if (known != nullptr && s->models_->chat()->is_fallback()) {
      Logf("chat: %s; /v1/chat/completions renders chatml-shaped plain text",
           s->models_->chat()->description().c_str());
    }
    HttpServerOptions ho;
    ho.host = o.host;
    ho.port = http.port;
    ho.router_address = s->address();
    ho.verbose = o.verbose;
    ho.auth = o.auth.get();
    ho.max_body_bytes = static_cast<size_t>(o.max_message_bytes);
    ho.metrics_text = http.metrics_text;
    if (!ho.metrics_text) {
      ho.metrics_text = [m = s->metrics_.get()] { return m->Render(); };
    }
    TANDEM_ASSIGN_OR_RETURN(s->http_, HttpServer::Start(ho, s->models_.get()));
  }
  if (o.metrics_port > 0) {
    TANDEM_ASSIGN_OR_RETURN(
        s->metrics_server_,
        services::MetricsServer::Start(o.host, o.metrics_port, s->metrics_.get()));
    Logf("metrics on %s", s->metrics_server_->url().c_str());
  }
  if (known != nullptr) {
    Logf("serving %s (%s, context %d, vocab %d) on %s:%d, policy %s, lease %lld ms",
         known->id().c_str(), known->config().arch_name.c_str(), known->ctx_size(),
         known->vocab_size(), o.host.c_str(), s->server_->port(), PolicyName(o.policy),
         static_cast<long long>(absl::ToInt64Milliseconds(o.worker_lease)));
  } else {
    Logf("serving on %s:%d, policy %s, lease %lld ms; no --model: the model comes from the "
         "first worker's model card (NOT_SERVING until then)",
         o.host.c_str(), s->server_->port(), PolicyName(o.policy),
         static_cast<long long>(absl::ToInt64Milliseconds(o.worker_lease)));
  }
  return s;
}

std::string RouterServer::address() const {
  const std::string host = (o_.host == "0.0.0.0" || o_.host == "::" || o_.host.empty())
                               ? std::string("127.0.0.1")
                               : o_.host;
  return services::JoinHostPort(host, server_->port());
}

void RouterServer::RefreshMetrics() {
  int prefill = 0, decode = 0, both = 0;
  // The planner's worker shape: what the workers registered, the smallest where they differ
  // (a plan the smallest worker can serve); the planner's defaults where none said.
  sim::Topology shape;
  auto smallest = [](int32_t said, auto* field, bool* seen) {
    if (said <= 0) return;
    *field = *seen ? std::min<std::remove_reference_t<decltype(*field)>>(*field, said) : said;
    *seen = true;
  };
  bool seqs_seen = false, tokens_seen = false, blocks_seen = false, block_size_seen = false,
       ctx_seen = false;
  for (const v1::WorkerInfo& w : registry_->List()) {
    if (w.draining()) continue;
    const bool b = w.role() == v1::WORKER_ROLE_BOTH;
    both += b;
    if (b || w.role() == v1::WORKER_ROLE_PREFILL) {
      prefill++;
      smallest(w.max_batch_tokens(), &shape.max_batch_tokens, &tokens_seen);
    }
    if (b || w.role() == v1::WORKER_ROLE_DECODE) {
      decode++;
      smallest(w.max_seqs(), &shape.max_seqs, &seqs_seen);
      smallest(w.kv_blocks_total(), &shape.kv_blocks, &blocks_seen);
    }
    smallest(w.kv_block_size(), &shape.block_size, &block_size_seen);
    smallest(w.ctx_size(), &shape.ctx_size, &ctx_seen);
  }
  // The planner answers for disaggregated clusters whose pools have both fitted their costs.
  std::optional<sim::Costs> costs;
  if (both == 0 && prefill > 0 && decode > 0) {
    std::optional<sim::StepCoefficients> p =
        plan::MeanFittedCost(registry_->Loads(Pool::kPrefill), /*prefill=*/true);
    std::optional<sim::StepCoefficients> d =
        plan::MeanFittedCost(registry_->Loads(Pool::kDecode), /*prefill=*/false);
    if (p.has_value() && d.has_value()) {
      costs.emplace();
      costs->prefill = *p;
      costs->decode = *d;
    }
  }
  router_metrics_->Refresh(admission_->running(), admission_->waiting(), prefill, decode, costs,
                           shape);
  router_metrics_->SetPrefixIndexBlocks(inference_->prefix_index().size());
}

void RouterServer::SweepLoop() {
  while (!stop_.WaitForNotificationWithTimeout(SweepPeriod(o_.worker_lease))) {
    // First the tick: after a stall of this process, leases are renewed before any expires.
    if (const absl::Duration stall = registry_->Tick(); stall > absl::ZeroDuration()) {
      Logf("the router itself was stalled for %.0f ms (no sweep ran): every worker that held a "
           "lease then holds a fresh one, since its heartbeats could not be read",
           absl::ToDoubleMilliseconds(stall));
    }
    for (const std::string& id : registry_->ExpireLeases()) {
      Logf("worker %s dropped: its lease expired without a heartbeat", id.c_str());
    }
    if (o_.policy == Policy::kKvAware) {
      std::vector<PrefixWorker> prefill;
      for (const v1::WorkerInfo& w : registry_->List()) {
        if (w.role() == v1::WORKER_ROLE_PREFILL) {  // only the disaggregated path records
          prefill.push_back({w.worker_id(), w.kv_blocks_total()});
        }
      }
      inference_->SetPrefillWorkers(prefill);
    }
  }
}

void RouterServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  if (server_ != nullptr) {
    // Let running requests finish (up to the grace), then shut down at once. Handing the grace
    // to the gRPC server instead would also wait for idle client connections to close, which
    // an idle gRPC client only notices at its next backup poll, seconds later.
    inference_->StartDraining();
    if (http_ != nullptr) http_->StartDraining();
    const absl::Time deadline = absl::Now() + grace;
    while (inference_->active() > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    // HTTP requests are gRPC calls by now: what the grace left running is cancelled here.
    if (http_ != nullptr) http_->Stop();
    server_->Shutdown(absl::ZeroDuration());
  }
  metrics_server_.reset();  // its scrape hook reads the registry and admission
  stop_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
}

RouterServer::~RouterServer() { Shutdown(absl::ZeroDuration()); }

}  // namespace tandem::router
