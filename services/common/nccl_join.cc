#include "services/common/nccl_join.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "services/common/grpc_status.h"
#include "services/common/tls.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::services {

using Clock = std::chrono::steady_clock;

transfer::NcclJoinFn GrpcNcclJoin() {
  return [](const std::string& address, const transfer::NcclJoinRequest& req,
            Clock::time_point deadline) -> absl::StatusOr<transfer::NcclJoinReply> {
    // One channel per join: a pair is joined once per (prefill, decode) lifetime.
    std::unique_ptr<v1::DecodeWorker::Stub> stub =
        v1::DecodeWorker::NewStub(CreateClientChannel(address));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::max(Clock::duration::zero(), deadline - Clock::now()));
    v1::JoinKvGroupRequest r;
    r.set_receiver_instance(req.receiver_instance);
    r.set_sender_instance(req.sender_instance);
    v1::JoinKvGroupResponse resp;
    grpc::Status st = stub->JoinKvGroup(&ctx, r, &resp);
    if (!st.ok()) {
      absl::Status s = FromGrpcStatus(st);
      return absl::Status(s.code(), absl::StrCat("JoinKvGroup at ", address, ": ", s.message()));
    }
    transfer::NcclJoinReply out;
    out.unique_id = resp.unique_id();
    for (const v1::KvGroupRegion& g : resp.regions()) {
      out.regions.push_back({g.region_id(), g.pair_region_id()});
    }
    return out;
  };
}

grpc::Status HandleJoinKvGroup(const KvJoinHandler& handler, grpc::ServerContext* ctx,
                               const v1::JoinKvGroupRequest& req, v1::JoinKvGroupResponse* resp,
                               std::chrono::milliseconds max_wait) {
  if (!handler) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        "this worker's KV transport is not nccl (--transport nccl)");
  }
  auto left = std::chrono::duration_cast<Clock::duration>(ctx->deadline() -
                                                          std::chrono::system_clock::now());
  const Clock::time_point deadline =
      Clock::now() + std::clamp<Clock::duration>(left, Clock::duration::zero(), max_wait);
  absl::StatusOr<transfer::NcclJoinReply> r =
      handler({req.receiver_instance(), req.sender_instance()}, deadline);
  if (!r.ok()) return ToGrpcStatus(r.status());
  resp->set_unique_id(r->unique_id);
  for (const auto& [id, pair_id] : r->regions) {
    v1::KvGroupRegion* g = resp->add_regions();
    g->set_region_id(id);
    g->set_pair_region_id(pair_id);
  }
  return grpc::Status::OK;
}

}  // namespace tandem::services
