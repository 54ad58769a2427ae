// The tandem.v1.KvStore gRPC service over a TieredStore.
//
// Threading: handlers run on gRPC's threads; the TieredStore is thread-safe, so no locking here.
// Ownership: the store and the data plane are borrowed and must outlive the service.
// Without a data plane (no transport), Read, Stage and Commit answer FAILED_PRECONDITION and
// only the inline-bytes Put and Get move data.
// Errors: store errors map one to one onto gRPC codes (services::ToGrpcStatus); a Get that meets
// a missing or corrupt block ends its reply there rather than failing the call.
#pragma once

#include "common/trace/trace.h"
#include "services/kvstore/data_plane.h"
#include "services/kvstore/tiered_store.h"
#include "tandem/v1/kvstore.grpc.pb.h"

namespace tandem::kvstore {

v1::KvTier ToProtoTier(TierKind k);

class KvStoreService final : public v1::KvStore::Service {
 public:
  // `tracer` (may be null, not owned) gets a slice per RPC.
  explicit KvStoreService(TieredStore* store, KvDataPlane* data_plane = nullptr,
                          trace::Tracer* tracer = nullptr)
      : store_(store), data_plane_(data_plane), tracer_(tracer) {}

  grpc::Status Read(grpc::ServerContext* ctx, const v1::KvReadRequest* req,
                    v1::KvReadResponse* resp) override;
  grpc::Status Stage(grpc::ServerContext* ctx, const v1::KvStageRequest* req,
                     v1::KvStageResponse* resp) override;
  grpc::Status Commit(grpc::ServerContext* ctx, const v1::KvCommitRequest* req,
                      v1::KvCommitResponse* resp) override;

  grpc::Status Lookup(grpc::ServerContext* ctx, const v1::KvLookupRequest* req,
                      v1::KvLookupResponse* resp) override;
  grpc::Status Put(grpc::ServerContext* ctx, const v1::KvPutRequest* req,
                   v1::KvPutResponse* resp) override;
  grpc::Status Get(grpc::ServerContext* ctx, const v1::KvGetRequest* req,
                   v1::KvGetResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::KvStatsRequest* req,
                     v1::KvStatsResponse* resp) override;

 private:
  TieredStore* store_;
  KvDataPlane* data_plane_;
  trace::Tracer* tracer_;
};

}  // namespace tandem::kvstore
