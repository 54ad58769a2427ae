// WorkerChannels: one gRPC channel per worker address, created on first use and shared by all
// requests (a channel multiplexes calls over one HTTP/2 connection and reconnects by itself).
//
// Threading: thread-safe. Channels are never removed: a worker that comes back at the same
// address reuses its channel, and the number of addresses a router ever sees is small.
#pragma once

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"

namespace tandem::router {

class WorkerChannels {
 public:
  std::shared_ptr<grpc::Channel> Get(const std::string& address);

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router
