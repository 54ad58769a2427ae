// The registry client against a real in-process Registry server: it registers, heartbeats with
// stats before its lease runs out, registers again when forgotten, rejoins a registry that
// comes up late, says draining at once, and deregisters on Stop.
#include "services/common/registration.h"

#include <thread>

#include "gtest/gtest.h"
#include "services/common/grpc_server.h"
#include "tests/component/services/fake_registry.h"

namespace tandem::services {
namespace {

using ::tandem::testing::FakeRegistry;

std::unique_ptr<GrpcServer> Serve(FakeRegistry* r, int port = 0) {
  GrpcServerOptions o;
  o.port = port;
  o.services = {r};
  auto s = GrpcServer::Start(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

RegistrationOptions Options(const std::string& registry) {
  RegistrationOptions o;
  o.registry_address = registry;
  o.registration.set_worker_id("decode-7");
  o.registration.set_role(v1::WORKER_ROLE_DECODE);
  o.registration.set_address("127.0.0.1:5555");
  o.registration.set_model("tiny");
  o.registration.set_kv_blocks_total(64);
  o.stats = [] {
    v1::WorkerStats s;
    s.set_running(3);
    s.set_kv_blocks_free(41);
    return s;
  };
  o.retry_min = absl::Milliseconds(20);
  o.retry_max = absl::Milliseconds(200);
  return o;
}

TEST(RegistrationTest, RegistersThenHeartbeatsWithStatsWithinTheLease) {
  FakeRegistry registry(/*lease_ms=*/300);
  auto server = Serve(&registry);
  auto client = std::move(*RegistrationClient::Start(Options(server->address())));
  ASSERT_TRUE(registry.WaitFor([&] { return registry.Count("heartbeat") >= 5; }));
  client->Stop();
  const std::vector<FakeRegistry::Call> calls = registry.calls();
  ASSERT_GE(calls.size(), 6u);
  EXPECT_EQ(calls[0].kind, "register");
  EXPECT_EQ(calls[0].registration.worker_id(), "decode-7");
  EXPECT_EQ(calls[0].registration.role(), v1::WORKER_ROLE_DECODE);
  EXPECT_EQ(calls[0].registration.address(), "127.0.0.1:5555");
  EXPECT_EQ(calls[0].registration.kv_blocks_total(), 64);
  EXPECT_EQ(registry.Count("register"), 1);
  for (size_t i = 1; i < calls.size(); ++i) {
    if (calls[i].kind != "heartbeat") continue;
    EXPECT_EQ(calls[i].heartbeat.worker_id(), "decode-7");
    EXPECT_EQ(calls[i].heartbeat.stats().running(), 3);
    EXPECT_EQ(calls[i].heartbeat.stats().kv_blocks_free(), 41);
    EXPECT_FALSE(calls[i].heartbeat.draining());
    // Every heartbeat comes well before the 300 ms lease since the previous contact ran out.
    EXPECT_LT(calls[i].at - calls[i - 1].at, absl::Milliseconds(250)) << "call " << i;
  }
  EXPECT_EQ(calls.back().kind, "deregister");
  EXPECT_EQ(calls.back().heartbeat.worker_id(), "decode-7");
  EXPECT_EQ(client->registrations(), 1);
  EXPECT_FALSE(client->registered());
}

TEST(RegistrationTest, RegistersAgainWhenTheRegistryForgetsIt) {
  FakeRegistry registry(/*lease_ms=*/150);
  auto server = Serve(&registry);
  auto client = std::move(*RegistrationClient::Start(Options(server->address())));
  ASSERT_TRUE(registry.WaitFor([&] { return registry.Count("heartbeat") >= 1; }));
  registry.Forget();
  ASSERT_TRUE(registry.WaitFor([&] { return registry.Count("register") == 2; }));
  EXPECT_TRUE(registry.WaitFor([&] { return client->registrations() == 2; }));
  EXPECT_TRUE(client->registered());
}

TEST(RegistrationTest, SaysDrainingAtOnce) {
  FakeRegistry registry(/*lease_ms=*/30000);  // regular heartbeats every 10 s
  auto server = Serve(&registry);
  auto client = std::move(*RegistrationClient::Start(Options(server->address())));
  ASSERT_TRUE(registry.WaitFor([&] { return client->registered(); }));
  const absl::Time t0 = absl::Now();
  client->SetDraining(true);
  ASSERT_TRUE(registry.WaitFor([&] { return registry.Count("heartbeat") >= 1; }));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  EXPECT_TRUE(registry.calls().back().heartbeat.draining());
}

TEST(RegistrationTest, JoinsARegistryThatStartsLater) {
  FakeRegistry registry(/*lease_ms=*/300);
  int port;
  {
    auto probe = Serve(&registry);  // learn a free port, then free it
    port = probe->port();
  }
  auto client = std::move(*RegistrationClient::Start(Options("127.0.0.1:" + std::to_string(port))));
  absl::SleepFor(absl::Milliseconds(150));
  EXPECT_FALSE(client->registered());
  auto server = Serve(&registry, port);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(registry.WaitFor([&] { return client->registered(); }, absl::Seconds(10)));
  client.reset();  // the destructor deregisters
  EXPECT_EQ(registry.calls().back().kind, "deregister");
}

TEST(RegistrationTest, RejectsIncompleteOptions) {
  RegistrationOptions o = Options("");
  EXPECT_EQ(RegistrationClient::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options("127.0.0.1:1");
  o.registration.clear_worker_id();
  EXPECT_EQ(RegistrationClient::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::services
