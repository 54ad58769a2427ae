// services::GrpcServer::Shutdown: a running call gets its grace, a call that outlives the grace
// is cancelled, and idle client connections (here, in another process, as a router's would be)
// do not hold the shutdown up.
#include "services/common/grpc_server.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::testing {
namespace {

// Register blocks until released (or until its call is cancelled); Heartbeat answers at once.
class GateRegistry final : public v1::Registry::Service {
 public:
  grpc::Status Register(grpc::ServerContext* ctx, const v1::RegisterRequest*,
                        v1::RegisterResponse*) override {
    entered.Notify();
    while (!release.WaitForNotificationWithTimeout(absl::Milliseconds(5))) {
      if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse* resp) override {
    resp->set_known(true);
    return grpc::Status::OK;
  }
  absl::Notification entered, release;
};

std::unique_ptr<services::GrpcServer> StartServer(grpc::Service* service) {
  services::GrpcServerOptions so;
  so.services = {service};
  absl::StatusOr<std::unique_ptr<services::GrpcServer>> s = services::GrpcServer::Start(so);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(GrpcServerShutdownTest, IdleClientInAnotherProcessDoesNotHoldItUp) {
  GateRegistry registry;
  std::unique_ptr<services::GrpcServer> server = StartServer(&registry);
  ASSERT_NE(server, nullptr);
  const std::string ready =
      (std::filesystem::temp_directory_path() / ("tandem-idle-" + std::to_string(getpid())))
          .string();
  std::filesystem::remove(ready);
  const std::string bin = std::string(TANDEM_BIN_DIR) + "/grpc_idle_client";
  const pid_t child = fork();
  if (child == 0) {
    execl(bin.c_str(), bin.c_str(), server->address().c_str(), ready.c_str(), nullptr);
    _exit(127);
  }
  ASSERT_GT(child, 0);
  bool connected = false;
  for (const absl::Time end = absl::Now() + absl::Seconds(20); absl::Now() < end;) {
    if (std::filesystem::exists(ready)) {
      connected = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(connected) << "the idle client did not connect";
  EXPECT_EQ(server->calls_in_flight(), 0);
  // gRPC on its own would wait here until the client's next backup poll (5 s) noticed the
  // GOAWAY, up to the whole grace.
  const absl::Time t0 = absl::Now();
  server->Shutdown(absl::Seconds(20));
  const absl::Duration took = absl::Now() - t0;
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  std::filesystem::remove(ready);
  EXPECT_LT(took, absl::Seconds(2));
}

TEST(GrpcServerShutdownTest, RunningCallGetsItsGraceAndNoMore) {
  for (const bool finishes : {true, false}) {
    SCOPED_TRACE(finishes ? "the call finishes inside the grace" : "the call outlives it");
    GateRegistry registry;
    std::unique_ptr<services::GrpcServer> server = StartServer(&registry);
    ASSERT_NE(server, nullptr);
    auto stub = v1::Registry::NewStub(
        grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
    grpc::Status st;
    std::thread caller([&] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      v1::RegisterResponse resp;
      st = stub->Register(&ctx, v1::RegisterRequest(), &resp);
    });
    registry.entered.WaitForNotification();
    EXPECT_EQ(server->calls_in_flight(), 1);
    std::thread releaser;
    if (finishes) {
      releaser = std::thread([&] {
        absl::SleepFor(absl::Milliseconds(300));
        registry.release.Notify();
      });
    }
    const absl::Time t0 = absl::Now();
    server->Shutdown(finishes ? absl::Seconds(20) : absl::Milliseconds(400));
    const absl::Duration took = absl::Now() - t0;
    caller.join();
    if (releaser.joinable()) releaser.join();
    if (finishes) {
      EXPECT_TRUE(st.ok()) << st.error_message();
      EXPECT_GE(took, absl::Milliseconds(250));
      EXPECT_LT(took, absl::Seconds(3));
    } else {
      EXPECT_FALSE(st.ok());
      EXPECT_GE(took, absl::Milliseconds(350));
      EXPECT_LT(took, absl::Seconds(3));
    }
    EXPECT_EQ(server->calls_in_flight(), 0);
  }
}

}  // namespace
}  // namespace tandem::testing
