// The tandem.v1.KvStore gRPC service over a TieredStore.
//
// Threading: handlers run on gRPC's threads; the TieredStore is thread-safe, so no locking here.
// Ownership: the store is borrowed and must outlive the service.
// Errors: store errors map one to one onto gRPC codes (services::ToGrpcStatus); a Get that meets
// a missing or corrupt block ends its reply there rather than failing the call.
#pragma once

#include "services/kvstore/tiered_store.h"
#include "tandem/v1/kvstore.grpc.pb.h"

namespace tandem::kvstore {

v1::KvTier ToProtoTier(TierKind k);

class KvStoreService final : public v1::KvStore::Service {
 public:
  explicit KvStoreService(TieredStore* store) : store_(store) {}

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
};

}  // namespace tandem::kvstore
