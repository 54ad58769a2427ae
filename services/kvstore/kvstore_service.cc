#include "services/kvstore/kvstore_service.h"

#include <vector>

#include "services/common/grpc_status.h"

namespace tandem::kvstore {

v1::KvTier ToProtoTier(TierKind k) {
  switch (k) {
    case TierKind::kDevice:
      return v1::KV_TIER_DEVICE;
    case TierKind::kHost:
      return v1::KV_TIER_HOST;
    case TierKind::kSsd:
      return v1::KV_TIER_SSD;
  }
  return v1::KV_TIER_UNSPECIFIED;
}

grpc::Status KvStoreService::Lookup(grpc::ServerContext*, const v1::KvLookupRequest* req,
                                    v1::KvLookupResponse* resp) {
  trace::Span span(tracer_, "Lookup", "rpc");
  const std::vector<uint64_t> hashes(req->block_hashes().begin(), req->block_hashes().end());
  const PrefixMatch m = store_->LookupPrefix(hashes);
  resp->set_matched(m.matched);
  span.Arg("blocks", hashes.size());
  span.Arg("matched", m.matched);
  for (TierKind t : m.tiers) resp->add_tiers(ToProtoTier(t));
  return grpc::Status::OK;
}

grpc::Status KvStoreService::Put(grpc::ServerContext*, const v1::KvPutRequest* req,
                                 v1::KvPutResponse* resp) {
  trace::Span span(tracer_, "Put", "rpc");
  span.Arg("blocks", req->blocks_size());
  for (const v1::KvBlock& b : req->blocks()) {
    const auto* p = reinterpret_cast<const uint8_t*>(b.data().data());
    absl::Status st = store_->Put(b.hash(), std::span<const uint8_t>(p, b.data().size()));
    if (!st.ok()) return services::ToGrpcStatus(st);
    resp->set_stored(resp->stored() + 1);
  }
  return grpc::Status::OK;
}

grpc::Status KvStoreService::Get(grpc::ServerContext*, const v1::KvGetRequest* req,
                                 v1::KvGetResponse* resp) {
  trace::Span span(tracer_, "Get", "rpc");
  span.Arg("blocks", req->block_hashes_size());
  absl::Status stop;
  std::vector<TieredStore::Found> found = store_->GetPrefix(
      std::span<const uint64_t>(req->block_hashes().data(), req->block_hashes_size()), &stop);
  if (!stop.ok() && !absl::IsNotFound(stop) && !absl::IsDataLoss(stop)) {
    return services::ToGrpcStatus(stop);
  }
  if (absl::IsDataLoss(stop)) resp->set_integrity_failures(resp->integrity_failures() + 1);
  for (size_t i = 0; i < found.size(); ++i) {
    v1::KvBlock* b = resp->add_blocks();
    b->set_hash(req->block_hashes(static_cast<int>(i)));
    b->set_data(found[i].data.data(), found[i].data.size());
    b->set_tier(ToProtoTier(found[i].tier));
  }
  return grpc::Status::OK;
}

namespace {

grpc::Status NoDataPlane() {
  return services::ToGrpcStatus(absl::FailedPreconditionError(
      "this kvstore has no KV transport (--transport none): use the inline Put and Get"));
}

}  // namespace

grpc::Status KvStoreService::Read(grpc::ServerContext* ctx, const v1::KvReadRequest* req,
                                  v1::KvReadResponse* resp) {
  if (data_plane_ == nullptr) return NoDataPlane();
  trace::Span span(tracer_, "Read", "kv");
  span.Arg("blocks", req->block_hashes_size());
  absl::StatusOr<v1::KvReadResponse> r =
      data_plane_->Read(*req, services::FromChronoDeadline(ctx->deadline()));
  if (!r.ok()) return services::ToGrpcStatus(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status KvStoreService::Stage(grpc::ServerContext*, const v1::KvStageRequest* req,
                                   v1::KvStageResponse* resp) {
  if (data_plane_ == nullptr) return NoDataPlane();
  trace::Span span(tracer_, "Stage", "kv");
  absl::StatusOr<v1::KvStageResponse> r = data_plane_->Stage(*req);
  if (!r.ok()) return services::ToGrpcStatus(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status KvStoreService::Commit(grpc::ServerContext*, const v1::KvCommitRequest* req,
                                    v1::KvCommitResponse* resp) {
  if (data_plane_ == nullptr) return NoDataPlane();
  trace::Span span(tracer_, "Commit", "kv");
  absl::StatusOr<v1::KvCommitResponse> r = data_plane_->Commit(*req);
  if (!r.ok()) return services::ToGrpcStatus(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status KvStoreService::Stats(grpc::ServerContext*, const v1::KvStatsRequest*,
                                   v1::KvStatsResponse* resp) {
  const TieredStoreStats s = store_->stats();
  for (int t = 0; t < kNumTiers; ++t) {
    if (store_->tier(static_cast<TierKind>(t)) == nullptr) continue;
    const TierStats& ts = s.tiers[t];
    v1::KvTierStats* out = resp->add_tiers();
    out->set_tier(ts.label.empty() ? TierKindName(static_cast<TierKind>(t)) : ts.label);
    out->set_backend(ts.name);
    out->set_capacity_bytes(ts.capacity_bytes);
    out->set_used_bytes(ts.used_bytes);
    out->set_blocks(ts.blocks);
    out->set_hits(ts.hits);
    out->set_misses(ts.misses);
    out->set_integrity_failures(ts.integrity_failures);
    out->set_demoted_in(ts.demoted_in);
    out->set_promoted_out(ts.promoted_out);
    out->set_evicted(ts.evicted);
  }
  resp->set_puts(s.puts);
  resp->set_gets(s.gets);
  resp->set_dropped_cold(s.dropped_cold);
  return grpc::Status::OK;
}

}  // namespace tandem::kvstore
