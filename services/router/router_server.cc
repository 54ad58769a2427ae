#include "services/router/router_server.h"

#include "absl/strings/str_cat.h"
#include "common/gguf/gguf.h"
#include "common/util/status_util.h"
#include "services/router/log.h"

namespace tandem::router {

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Create(const RouterOptions& o,
                                                                   const HttpFrontOptions& http) {
  TANDEM_RETURN_IF_ERROR(ValidateRouterOptions(o));
  auto s = std::unique_ptr<RouterServer>(new RouterServer());
  s->o_ = o;
  TANDEM_ASSIGN_OR_RETURN(s->model_, RouterModel::Load(o.model_path, o.model_id, o.ctx_size));
  RegistryOptions ro;
  ro.lease = o.worker_lease;
  ro.policy = o.policy;
  // Workers report general.name (or the architecture when the file has none).
  const engine::ModelConfig& mc = s->model_->config();
  ro.model_names = {s->model_->id(), s->model_->path(), mc.name.empty() ? mc.arch_name : mc.name};
  s->registry_ = std::make_unique<WorkerRegistry>(ro);
  s->admission_ = std::make_unique<Admission>(o.max_inflight, o.max_queue);
  s->channels_ = std::make_unique<WorkerChannels>();
  s->inference_ = std::make_unique<InferenceService>(s->model_.get(), s->registry_.get(),
                                                     s->admission_.get(), s->channels_.get(), o);
  s->registry_service_ = std::make_unique<RegistryService>(s->registry_.get());

  services::GrpcServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.services = {s->inference_.get(), s->registry_service_.get()};
  TANDEM_ASSIGN_OR_RETURN(s->server_, services::GrpcServer::Start(so));
  s->sweeper_ = std::thread([raw = s.get()] { raw->SweepLoop(); });
  if (http.enabled) {
    // The chat template is GGUF metadata the tokenizer does not keep: read it here (the
    // mapping is opened again, but only the metadata is touched).
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<gguf::GgufFile> file,
                            gguf::GgufFile::Open(s->model_->path()));
    TANDEM_ASSIGN_OR_RETURN(ChatTemplate chat, ChatTemplate::FromGguf(*file));
    if (chat.is_fallback()) {
      Logf("chat: %s; /v1/chat/completions renders chatml-shaped plain text",
           chat.description().c_str());
    }
    HttpServerOptions ho;
    ho.host = o.host;
    ho.port = http.port;
    ho.router_address = s->address();
    ho.verbose = o.verbose;
    ho.metrics_text = http.metrics_text;
    TANDEM_ASSIGN_OR_RETURN(s->http_, HttpServer::Start(ho, s->model_.get(), std::move(chat)));
  }
  Logf("serving %s (%s, context %d, vocab %d) on %s:%d, policy %s, lease %lld ms",
       s->model_->id().c_str(), s->model_->config().arch_name.c_str(), s->model_->ctx_size(),
       s->model_->vocab_size(), o.host.c_str(), s->server_->port(), PolicyName(o.policy),
       static_cast<long long>(absl::ToInt64Milliseconds(o.worker_lease)));
  return s;
}

std::string RouterServer::address() const {
  const std::string host = (o_.host == "0.0.0.0" || o_.host == "::" || o_.host.empty())
                               ? std::string("127.0.0.1")
                               : o_.host;
  return services::JoinHostPort(host, server_->port());
}

void RouterServer::SweepLoop() {
  const absl::Duration period =
      std::max(absl::Milliseconds(20), std::min(o_.worker_lease / 4, absl::Seconds(1)));
  while (!stop_.WaitForNotificationWithTimeout(period)) {
    for (const std::string& id : registry_->ExpireLeases()) {
      Logf("worker %s dropped: its lease expired without a heartbeat", id.c_str());
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
  stop_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
}

RouterServer::~RouterServer() { Shutdown(absl::ZeroDuration()); }

}  // namespace tandem::router
