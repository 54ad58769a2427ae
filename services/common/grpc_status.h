// The one conversion between absl::Status (used everywhere inside tandem) and grpc::Status (used
// only at a service's edge), plus the deadline arithmetic every hop needs.
//
// The two code spaces share google.rpc.Code numbering, so codes map one to one; a code outside
// that range (a newer peer) becomes UNKNOWN rather than an invalid enum value.
// Pure functions, thread-safe.
#pragma once

#include <chrono>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/support/status.h"

namespace tandem::services {

grpc::Status ToGrpcStatus(const absl::Status& st);
absl::Status FromGrpcStatus(const grpc::Status& st);

// gRPC deadlines are std::chrono::system_clock time points, where "no deadline" is a point far
// in the future; services reason in absl::Time with InfiniteFuture for "none".
std::chrono::system_clock::time_point ToChronoDeadline(absl::Time t);
absl::Time FromChronoDeadline(std::chrono::system_clock::time_point t);

// A call that failed because of the peer it was sending to on the caller's behalf, not because
// of the called worker itself: a prefill whose KV could not reach the decode worker's
// reservation. The status carries it as a payload; at the service's edge it becomes the
// trailing metadata kFaultKey = kFaultDestination, which the router reads to avoid that decode
// worker instead of blaming the prefill worker.
inline constexpr char kFaultKey[] = "tandem-fault";
inline constexpr char kFaultDestination[] = "destination";
absl::Status MarkDestinationFault(absl::Status st);
bool IsDestinationFault(const absl::Status& st);

}  // namespace tandem::services
