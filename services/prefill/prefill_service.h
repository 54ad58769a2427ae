// gRPC face of the prefill worker (tandem.v1.PrefillWorker). Handlers translate messages and
// statuses and wait; the PrefillWorker's engine thread computes. The RPC deadline bounds both
// the queueing and the KV transfer; a client that cancels cancels the prefill.
//
// Threading: handlers run on gRPC's sync-server threads. Ownership: the worker must outlive the
// service.
#pragma once

#include "services/prefill/prefill_worker.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::prefill {

class PrefillService final : public v1::PrefillWorker::Service {
 public:
  explicit PrefillService(PrefillWorker* worker) : worker_(worker) {}

  grpc::Status Prefill(grpc::ServerContext* ctx, const v1::PrefillRequest* req,
                       v1::PrefillResponse* resp) override;
  grpc::Status Cancel(grpc::ServerContext* ctx, const v1::CancelRequest* req,
                      v1::CancelResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::WorkerStatsRequest* req,
                     v1::WorkerStats* resp) override;

 private:
  PrefillWorker* worker_;
};

}  // namespace tandem::prefill
