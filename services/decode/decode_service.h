// gRPC face of the decode worker (tandem.v1.DecodeWorker). Handlers translate messages and
// statuses and wait on per-request streams; the DecodeWorker's engine thread does the work.
//
// Decode streams one GenerateResponse per token (the first carries the token prefill sampled);
// the last message has finished set, the finish reason and the usage. A Cancel RPC ends the
// stream with FINISH_REASON_CANCELLED; a client that goes away (cancel or deadline) has its
// sequence cancelled and its blocks freed within one poll interval.
//
// Threading: handlers run on gRPC's sync-server threads and block only on their own request's
// stream. Ownership: the worker must outlive the service.
#pragma once

#include "absl/time/time.h"
#include "services/common/nccl_join.h"
#include "services/decode/decode_worker.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::decode {

class DecodeService final : public v1::DecodeWorker::Service {
 public:
  explicit DecodeService(DecodeWorker* worker, absl::Duration cancel_poll = absl::Milliseconds(20))
      : worker_(worker), cancel_poll_(cancel_poll) {}

  grpc::Status Reserve(grpc::ServerContext* ctx, const v1::ReserveRequest* req,
                       v1::ReserveResponse* resp) override;
  grpc::Status Decode(grpc::ServerContext* ctx, const v1::DecodeRequest* req,
                      grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Cancel(grpc::ServerContext* ctx, const v1::CancelRequest* req,
                      v1::CancelResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::WorkerStatsRequest* req,
                     v1::WorkerStats* resp) override;
  // --transport nccl: answered by the transport's join handler; UNIMPLEMENTED without one.
  grpc::Status JoinKvGroup(grpc::ServerContext* ctx, const v1::JoinKvGroupRequest* req,
                           v1::JoinKvGroupResponse* resp) override;

  // Before serving: what JoinKvGroup calls (from TransportFromFlags).
  void set_kv_join_handler(services::KvJoinHandler h) { join_handler_ = std::move(h); }

 private:
  DecodeWorker* worker_;
  services::KvJoinHandler join_handler_;
  // How often a waiting stream checks whether its client went away: gRPC's sync API has no
  // cancellation callback.
  absl::Duration cancel_poll_;
};

}  // namespace tandem::decode
