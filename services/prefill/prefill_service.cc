#include "services/prefill/prefill_service.h"

#include "services/common/grpc_status.h"

namespace tandem::prefill {

grpc::Status PrefillService::Prefill(grpc::ServerContext* ctx, const v1::PrefillRequest* req,
                                     v1::PrefillResponse* resp) {
  const absl::Time deadline = services::FromChronoDeadline(ctx->deadline());
  trace::Span span(worker_->tracer(), "Prefill", "rpc", req->request_id());
  span.Flow('t');
  absl::StatusOr<v1::PrefillResponse> r =
      worker_->Prefill(*req, deadline, [ctx] { return ctx->IsCancelled(); });
  if (span.on()) {
    span.Arg("prompt_tokens", req->prompt_token_ids_size());
    span.Arg("status", r.status().ToString());
    if (r.ok()) {
      span.Arg("kv_bytes", r->bytes_transferred());
      span.Arg("cached_tokens", r->onboarded_tokens());
    }
  }
  if (!r.ok()) {
    if (services::IsDestinationFault(r.status())) {
      ctx->AddTrailingMetadata(services::kFaultKey, services::kFaultDestination);
    }
    return services::ToGrpcStatus(r.status());
  }
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status PrefillService::Cancel(grpc::ServerContext* ctx, const v1::CancelRequest* req,
                                    v1::CancelResponse* resp) {
  resp->set_found(worker_->Cancel(req->request_id()));
  return grpc::Status::OK;
}

grpc::Status PrefillService::Stats(grpc::ServerContext* ctx, const v1::WorkerStatsRequest* req,
                                   v1::WorkerStats* resp) {
  *resp = worker_->Stats();
  return grpc::Status::OK;
}

}  // namespace tandem::prefill
