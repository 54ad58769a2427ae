#include "services/common/grpc_server.h"

#include <mutex>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "services/common/grpc_status.h"

namespace tandem::services {

std::string JoinHostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && host.front() != '[') {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerOptions& o) {
  if (o.port < 0 || o.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("port ", o.port, " is outside [0, 65535]"));
  }
  // Both are process-wide switches that the builder reads when it is constructed.
  static std::once_flag once;
  std::call_once(once, [] {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  });
  grpc::ServerBuilder builder;
  int bound = 0;
  const std::string want = JoinHostPort(o.host, o.port);
  builder.AddListeningPort(want, grpc::InsecureServerCredentials(), &bound);
  builder.SetMaxReceiveMessageSize(o.max_message_bytes);
  builder.SetMaxSendMessageSize(o.max_message_bytes);
  for (grpc::Service* s : o.services) builder.RegisterService(s);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", want, " (address in use or not local?)"));
  }
  return std::unique_ptr<GrpcServer>(
      new GrpcServer(std::move(server), bound, JoinHostPort(o.host, bound)));
}

GrpcServer::GrpcServer(std::unique_ptr<grpc::Server> server, int port, std::string address)
    : server_(std::move(server)), port_(port), address_(std::move(address)) {}

GrpcServer::~GrpcServer() { Shutdown(absl::ZeroDuration()); }

void GrpcServer::Shutdown(absl::Duration grace) {
  std::call_once(shutdown_once_, [&] {
    if (grpc::HealthCheckServiceInterface* h = server_->GetHealthCheckService()) {
      h->SetServingStatus(false);
    }
    server_->Shutdown(ToChronoDeadline(absl::Now() + grace));
  });
  server_->Wait();
}

void GrpcServer::Wait() { server_->Wait(); }

}  // namespace tandem::services
