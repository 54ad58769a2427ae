#include "services/common/grpc_server.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpc/grpc.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_interceptor.h"
#include "services/common/grpc_status.h"
#include "services/common/tls.h"

namespace tandem::services {

// Counts the calls a server is serving: one interceptor per call, created when gRPC matches the
// call to a handler and destroyed with the call's context after its status went out.
namespace internal {
struct CallCounter {
  std::atomic<int> in_flight{0};
};
}  // namespace internal

namespace {

using internal::CallCounter;

class CountingInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit CountingInterceptor(std::shared_ptr<CallCounter> c) : c_(std::move(c)) {
    c_->in_flight.fetch_add(1);
  }
  ~CountingInterceptor() override { c_->in_flight.fetch_sub(1); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  std::shared_ptr<CallCounter> c_;
};

class CountingInterceptorFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CountingInterceptorFactory(std::shared_ptr<CallCounter> c) : c_(std::move(c)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // A health Watch lasts as long as its client likes; it must not hold up a shutdown.
    if (std::strcmp(info->method(), "/grpc.health.v1.Health/Watch") == 0) return nullptr;
    return new CountingInterceptor(c_);
  }

 private:
  std::shared_ptr<CallCounter> c_;
};

}  // namespace

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
    // Referenced so the linker keeps the health service's descriptor (its file registers
    // itself with the pool reflection reads when linked in).
    (void)grpc::health::v1::HealthCheckRequest::descriptor();
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  });
  grpc::ServerBuilder builder;
  int bound = 0;
  const std::string want = JoinHostPort(o.host, o.port);
  builder.AddListeningPort(
      want, o.credentials != nullptr ? o.credentials : ProcessServerCredentials(), &bound);
  builder.SetMaxReceiveMessageSize(o.max_message_bytes);
  builder.SetMaxSendMessageSize(o.max_message_bytes);
  // Keepalive (tls.h): ping clients with open calls, drop the calls of one that stops
  // answering, and take the clients' own pings at their rate, never as abuse.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, absl::ToInt64Milliseconds(kKeepaliveTime));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             absl::ToInt64Milliseconds(kKeepaliveTimeout));
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  for (grpc::Service* s : o.services) builder.RegisterService(s);
  auto calls = std::make_shared<CallCounter>();
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(std::make_unique<CountingInterceptorFactory>(calls));
  builder.experimental().SetInterceptorCreators(std::move(creators));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", want, " (address in use or not local?)"));
  }
  std::unique_ptr<GrpcServer> s(
      new GrpcServer(std::move(server), std::move(calls), bound, JoinHostPort(o.host, bound)));
  if (!o.serving_at_start) s->SetServing(false);
  return s;
}

void GrpcServer::SetServing(bool serving) {
  if (shutting_down_.load()) return;
  if (grpc::HealthCheckServiceInterface* h = server_->GetHealthCheckService()) {
    h->SetServingStatus(serving);
  }
}

void GrpcServer::SetServing(const std::string& service, bool serving) {
  if (shutting_down_.load()) return;
  if (grpc::HealthCheckServiceInterface* h = server_->GetHealthCheckService()) {
    h->SetServingStatus(service, serving);
  }
}

GrpcServer::GrpcServer(std::unique_ptr<grpc::Server> server, std::shared_ptr<CallCounter> calls,
                       int port, std::string address)
    : server_(std::move(server)),
      calls_(std::move(calls)),
      port_(port),
      address_(std::move(address)) {}

int GrpcServer::calls_in_flight() const { return calls_->in_flight.load(); }

GrpcServer::~GrpcServer() { Shutdown(absl::ZeroDuration()); }

void GrpcServer::Shutdown(absl::Duration grace) {
  std::call_once(shutdown_once_, [&] {
    shutting_down_.store(true);
    if (grpc::HealthCheckServiceInterface* h = server_->GetHealthCheckService()) {
      h->SetServingStatus(false);
    }
    // grpc::Server::Shutdown waits, up to its deadline, for every client connection to close
    // after its GOAWAY as well as for the calls; an idle client only reads the GOAWAY at its
    // next backup poll, seconds later. So it runs on a helper thread while this one watches the
    // calls: once none is in flight, the connections are closed from this side.
    const absl::Time deadline = absl::Now() + grace;
    absl::Notification done;
    std::thread shutdown([&] {
      server_->Shutdown(ToChronoDeadline(deadline));
      done.Notify();
    });
    while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(5))) {
      // Calling this before the helper thread began the shutdown is harmless: it only cuts
      // connections, and the next turn calls it again.
      if (calls_->in_flight.load() == 0) grpc_server_cancel_all_calls(server_->c_server());
    }
    shutdown.join();
  });
  server_->Wait();
}

void GrpcServer::Wait() { server_->Wait(); }

}  // namespace tandem::services
