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

}  // namespace tandem::services
