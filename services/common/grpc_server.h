// A gRPC server bootstrap shared by every tandem service.
//
// Every server built here serves grpc.health.v1 (the default health service: SERVING while the
// server runs, NOT_SERVING once it drains) and server reflection, so grpcurl, grpc_health_probe
// and Kubernetes probes work against any tandem process.
//
// Ownership: the caller owns the services, which must outlive the server. Threading: all
// methods are thread-safe. Errors: Start returns UNAVAILABLE when the address cannot be bound
// and INVALID_ARGUMENT for a bad port.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "grpcpp/support/channel_arguments.h"

namespace grpc {
class Service;
class ServerCredentials;
}

namespace tandem::services {

namespace internal {
struct CallCounter;  // grpc_server.cc
}  // namespace internal

struct GrpcServerOptions {
  std::string host = "127.0.0.1";  // "0.0.0.0" or "[::]" to listen on every interface
  int port = 0;                    // 0: the kernel picks a free port; port() says which
  std::vector<grpc::Service*> services;
  int max_message_bytes = 64 << 20;
  // Null: the process's (tls.h SetProcessTls), which are plaintext unless --tls-cert was given.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // false: the health service says NOT_SERVING until SetServing(true) (a router that does not
  // know its model yet).
  bool serving_at_start = true;
};

class GrpcServer {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const GrpcServerOptions& o);
  ~GrpcServer();
  GrpcServer(const GrpcServer&) = delete;
  GrpcServer& operator=(const GrpcServer&) = delete;

  int port() const { return port_; }
  // host:port as bound (IPv6 hosts bracketed).
  const std::string& address() const { return address_; }

  // Stops accepting calls and marks the health service NOT_SERVING; calls in flight get up to
  // `grace` to finish, then are cancelled. Returns as soon as no call is in flight (at most
  // `grace` plus the time handlers take to see the cancellation): idle client connections do
  // not hold it up. Returns when every handler has returned. Idempotent.
  void Shutdown(absl::Duration grace);
  // What grpc.health.v1 reports for the server ("" service). Ignored once Shutdown began.
  void SetServing(bool serving);
  // The same for a named health service (e.g. the workers' "liveness").
  void SetServing(const std::string& service, bool serving);
  // Calls being served now (health Watch streams, which last as long as their client wants,
  // are not counted).
  int calls_in_flight() const;
  // Blocks until Shutdown has completed.
  void Wait();

 private:
  using CallCounter = internal::CallCounter;
  GrpcServer(std::unique_ptr<grpc::Server> server, std::shared_ptr<CallCounter> calls, int port,
             std::string address);
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<CallCounter> calls_;
  int port_;
  std::string address_;
  std::once_flag shutdown_once_;
  std::atomic<bool> shutting_down_{false};
};

// "host:port", bracketing an IPv6 literal host.
std::string JoinHostPort(const std::string& host, int port);

}  // namespace tandem::services
