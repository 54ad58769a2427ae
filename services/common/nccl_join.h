// The control-plane half of the "nccl" KV transport: the DecodeWorker.JoinKvGroup RPC that
// bootstraps one two-rank NCCL communicator per (prefill, decode) pair
// (common/transfer/nccl/nccl_pair_transport.h keeps gRPC out of common/transfer).
//
// Threading: everything here is thread-safe. The join client blocks its caller (a join thread
// of the pair transport) for at most the deadline it is given. Errors: gRPC statuses are
// converted once, here.
#pragma once

#include <chrono>
#include <functional>

#include "absl/status/statusor.h"
#include "common/transfer/nccl/nccl_pair_transport.h"
#include "grpcpp/server_context.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::services {

// The receiver's side, as the decode service calls it.
using KvJoinHandler = std::function<absl::StatusOr<transfer::NcclJoinReply>(
    const transfer::NcclJoinRequest&, std::chrono::steady_clock::time_point deadline)>;

// Sender side: dials the decode worker at the address the descriptor names (with the
// process's TLS settings) and calls JoinKvGroup with the write's deadline.
transfer::NcclJoinFn GrpcNcclJoin();

// Server side: answers one JoinKvGroup with `handler`; the join's deadline is the call's,
// capped at `max_wait` (a call without a deadline must not pin a half-joined rank forever).
grpc::Status HandleJoinKvGroup(const KvJoinHandler& handler, grpc::ServerContext* ctx,
                               const v1::JoinKvGroupRequest& req, v1::JoinKvGroupResponse* resp,
                               std::chrono::milliseconds max_wait = std::chrono::seconds(30));

}  // namespace tandem::services
