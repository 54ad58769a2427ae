#include "services/decode/decode_service.h"

#include "services/common/grpc_status.h"
#include "services/common/sampling_convert.h"

namespace tandem::decode {
namespace {

v1::FinishReason ToProto(const engine::TokenEvent& ev) {
  if (ev.status.code() == absl::StatusCode::kCancelled) return v1::FINISH_REASON_CANCELLED;
  if (!ev.status.ok()) return v1::FINISH_REASON_ERROR;
  switch (ev.reason) {
    case engine::FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case engine::FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case engine::FinishReason::kNone:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

}  // namespace

grpc::Status DecodeService::Reserve(grpc::ServerContext* ctx, const v1::ReserveRequest* req,
                                    v1::ReserveResponse* resp) {
  trace::Span span(worker_->tracer(), "Reserve", "rpc", req->request_id());
  absl::StatusOr<v1::ReserveResponse> r = worker_->Reserve(*req);
  span.Arg("status", r.status().ToString());
  if (!r.ok()) return services::ToGrpcStatus(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status DecodeService::Decode(grpc::ServerContext* ctx, const v1::DecodeRequest* req,
                                   grpc::ServerWriter<v1::GenerateResponse>* writer) {
  trace::Span span(worker_->tracer(), "Decode", "rpc", req->request_id());
  // Where the request's flow ends (it started at the router's prefill call).
  span.Flow('f');
  absl::StatusOr<std::shared_ptr<TokenStream>> stream = worker_->StartDecode(*req);
  if (!stream.ok()) {
    span.Arg("status", stream.status().ToString());
    return services::ToGrpcStatus(stream.status());
  }
  const std::string& id = req->request_id();
  int32_t completion = 0;
  struct Tokens {  // the slice's args, whichever way the stream ends
    trace::Span& span;
    const int32_t& n;
    ~Tokens() { span.Arg("completion_tokens", n); }
  } tokens{span, completion};
  for (;;) {
    engine::TokenEvent ev;
    if (!(*stream)->Next(absl::Now() + cancel_poll_, &ev)) {
      // gRPC marks the call cancelled when the client cancels or the deadline passes.
      if (ctx->IsCancelled()) {
        worker_->Cancel(id);
        return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled or deadline passed");
      }
      continue;
    }
    v1::GenerateResponse msg;
    msg.set_request_id(id);
    msg.set_decode_worker(worker_->worker_id());
    if (ev.token >= 0) {
      msg.add_token_ids(ev.token);
      if (ev.logprobs) *msg.add_logprobs() = services::LogprobsToProto(*ev.logprobs);
      ++completion;
    }
    msg.set_text(ev.text);
    if (ev.finished) {
      const bool cancelled = ev.status.code() == absl::StatusCode::kCancelled;
      if (!ev.status.ok() && !cancelled) return services::ToGrpcStatus(ev.status);
      msg.set_finished(true);
      msg.set_finish_reason(ToProto(ev));
      v1::Usage* u = msg.mutable_usage();
      u->set_prompt_tokens(req->prompt_token_ids_size());
      u->set_completion_tokens(completion);
      u->set_spec_verify_steps(ev.spec.verify_steps);
      u->set_spec_draft_tokens(ev.spec.draft_tokens);
      u->set_spec_accepted_tokens(ev.spec.accepted_tokens);
      writer->Write(msg);
      return grpc::Status::OK;
    }
    if (!writer->Write(msg)) {
      worker_->Cancel(id);
      return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
  }
}

grpc::Status DecodeService::Cancel(grpc::ServerContext* ctx, const v1::CancelRequest* req,
                                   v1::CancelResponse* resp) {
  resp->set_found(worker_->Cancel(req->request_id()));
  return grpc::Status::OK;
}

grpc::Status DecodeService::JoinKvGroup(grpc::ServerContext* ctx,
                                        const v1::JoinKvGroupRequest* req,
                                        v1::JoinKvGroupResponse* resp) {
  // Returns once this worker's rank is joining in the background: no gRPC thread waits on
  // NCCL.
  return services::HandleJoinKvGroup(join_handler_, ctx, *req, resp);
}

grpc::Status DecodeService::Stats(grpc::ServerContext* ctx, const v1::WorkerStatsRequest* req,
                                  v1::WorkerStats* resp) {
  *resp = worker_->Stats();
  return grpc::Status::OK;
}

}  // namespace tandem::decode
