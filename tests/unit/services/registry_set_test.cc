// RegistrySet against several real in-process Registry servers on port 0: a worker registers
// with every address its router names resolve to, drops a router that stops resolving, joins
// one that appears within a re-resolve period, keeps its routers through a failed resolution,
// and drains and deregisters from all of them. Plus the --router list parser and the real
// getaddrinfo resolver.
#include "services/common/registry_set.h"

#include <set>

#include "gtest/gtest.h"
#include "services/common/grpc_server.h"
#include "tests/component/services/fake_registry.h"

namespace tandem::services {
namespace {

using ::tandem::testing::FakeRegistry;

struct Router {
  explicit Router(uint32_t lease_ms) : registry(lease_ms) {
    GrpcServerOptions o;
    o.services = {&registry};
    auto s = GrpcServer::Start(o);
    EXPECT_TRUE(s.ok()) << s.status();
    server = std::move(*s);
  }
  FakeRegistry registry;
  std::unique_ptr<GrpcServer> server;
};

// A resolver whose answer the test changes: "routers" -> whatever `targets` holds now.
struct FakeDns {
  absl::Mutex mu;
  std::vector<std::string> targets ABSL_GUARDED_BY(mu);
  bool fail ABSL_GUARDED_BY(mu) = false;
  int calls ABSL_GUARDED_BY(mu) = 0;

  void Set(std::vector<std::string> t) {
    absl::MutexLock l(&mu);
    targets = std::move(t);
  }
  void Fail(bool f) {
    absl::MutexLock l(&mu);
    fail = f;
  }
  absl::StatusOr<std::vector<std::string>> Resolve(const RouterEndpoint& e) {
    absl::MutexLock l(&mu);
    ++calls;
    EXPECT_EQ(e.host, "routers");
    EXPECT_EQ(e.port, 7000);
    if (fail) return absl::UnavailableError("dns down");
    return targets;
  }
};

RegistrySetOptions Options(FakeDns* dns) {
  RegistrySetOptions o;
  o.routers = {{"routers", 7000}};
  o.resolve_interval = absl::Milliseconds(50);
  o.resolve = [dns](const RouterEndpoint& e) { return dns->Resolve(e); };
  RegistrationOptions& r = o.registration;
  r.registration.set_worker_id("prefill-3");
  r.registration.set_role(v1::WORKER_ROLE_PREFILL);
  r.registration.set_address("127.0.0.1:5555");
  r.registration.set_model("tiny");
  r.stats = [] {
    v1::WorkerStats s;
    s.set_running(2);
    return s;
  };
  r.retry_min = absl::Milliseconds(20);
  r.retry_max = absl::Milliseconds(200);
  r.rpc_timeout = absl::Milliseconds(500);
  return o;
}

TEST(RegistrySetTest, RegistersAndHeartbeatsWithEveryResolvedRouter) {
  Router a(300), b(300), c(300);
  FakeDns dns;
  dns.Set({a.server->address(), b.server->address(), c.server->address()});
  auto set = std::move(*RegistrySet::Start(Options(&dns)));
  for (Router* r : {&a, &b, &c}) {
    ASSERT_TRUE(r->registry.WaitFor([&] { return r->registry.Count("heartbeat") >= 3; }))
        << r->server->address();
    EXPECT_EQ(r->registry.Count("register"), 1);
    const auto regs = r->registry.registrations();
    EXPECT_EQ(regs[0].worker_id(), "prefill-3");
    EXPECT_EQ(regs[0].role(), v1::WORKER_ROLE_PREFILL);
    EXPECT_EQ(regs[0].address(), "127.0.0.1:5555");
    EXPECT_EQ(r->registry.calls().back().heartbeat.stats().running(), 2);
  }
  EXPECT_EQ(set->registered(), 3);
  EXPECT_EQ(set->addresses().size(), 3u);
  // Re-resolving the same answer starts nothing new.
  const int resolutions = set->resolutions();
  ASSERT_TRUE(a.registry.WaitFor([&] { return set->resolutions() >= resolutions + 3; }));
  for (Router* r : {&a, &b, &c}) EXPECT_EQ(r->registry.Count("register"), 1);
}

TEST(RegistrySetTest, DropsAVanishedRouterAndJoinsANewOneWithinAResolvePeriod) {
  Router a(300), b(300);
  FakeDns dns;
  dns.Set({a.server->address(), b.server->address()});
  auto set = std::move(*RegistrySet::Start(Options(&dns)));
  ASSERT_TRUE(a.registry.WaitFor([&] { return set->registered() == 2; }));

  // b leaves the Service: the worker deregisters from it and stops heartbeating there.
  dns.Set({a.server->address()});
  ASSERT_TRUE(b.registry.WaitFor([&] { return b.registry.Count("deregister") == 1; }));
  EXPECT_EQ(set->addresses(), std::vector<std::string>{a.server->address()});
  const int b_heartbeats = b.registry.Count("heartbeat");
  absl::SleepFor(absl::Milliseconds(300));  // a lease of heartbeats
  EXPECT_EQ(b.registry.Count("heartbeat"), b_heartbeats);
  EXPECT_EQ(a.registry.Count("deregister"), 0);

  // A new router appears: registered with within one resolve period (50 ms; slack for CI).
  Router c(300);
  const absl::Time t0 = absl::Now();
  dns.Set({a.server->address(), c.server->address()});
  ASSERT_TRUE(c.registry.WaitFor([&] { return c.registry.Count("register") == 1; }));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(1));
  EXPECT_EQ(a.registry.Count("register"), 1);  // a was never dropped
}

TEST(RegistrySetTest, AFailedResolutionKeepsTheRoutersItHad) {
  Router a(300);
  FakeDns dns;
  dns.Set({a.server->address()});
  auto set = std::move(*RegistrySet::Start(Options(&dns)));
  ASSERT_TRUE(a.registry.WaitFor([&] { return set->registered() == 1; }));
  dns.Fail(true);
  const int resolutions = set->resolutions();
  ASSERT_TRUE(a.registry.WaitFor([&] { return set->resolutions() >= resolutions + 4; }));
  EXPECT_EQ(a.registry.Count("deregister"), 0);
  EXPECT_EQ(set->registered(), 1);
}

TEST(RegistrySetTest, DrainingAndStopReachEveryRouterIncludingLaterOnes) {
  Router a(30000), b(30000);  // regular heartbeats only every 10 s
  FakeDns dns;
  dns.Set({a.server->address()});
  auto set = std::move(*RegistrySet::Start(Options(&dns)));
  ASSERT_TRUE(a.registry.WaitFor([&] { return set->registered() == 1; }));
  set->SetDraining(true);
  ASSERT_TRUE(a.registry.WaitFor([&] { return a.registry.Count("heartbeat") >= 1; }));
  EXPECT_TRUE(a.registry.calls().back().heartbeat.draining());
  // A router that appears while draining hears "draining" at once too.
  dns.Set({a.server->address(), b.server->address()});
  ASSERT_TRUE(b.registry.WaitFor([&] { return b.registry.Count("heartbeat") >= 1; }));
  EXPECT_TRUE(b.registry.calls().back().heartbeat.draining());
  set->Stop();
  for (Router* r : {&a, &b}) {
    EXPECT_EQ(r->registry.calls().back().kind, "deregister");
    EXPECT_EQ(r->registry.Count("deregister"), 1);
  }
  EXPECT_TRUE(set->addresses().empty());
  set->Stop();  // idempotent
  EXPECT_EQ(a.registry.Count("deregister"), 1);
}

TEST(RegistrySetTest, EachEntryOfTheListIsResolved) {
  Router a(300), b(300);
  RegistrySetOptions o;
  o.routers = *ParseRouterList(a.server->address() + "," + b.server->address());
  o.resolve_interval = absl::Milliseconds(50);
  o.registration.registration.set_worker_id("decode-1");
  o.registration.registration.set_address("127.0.0.1:5556");
  auto set = std::move(*RegistrySet::Start(o));  // the real resolver: IP literals
  for (Router* r : {&a, &b}) {
    ASSERT_TRUE(r->registry.WaitFor([&] { return r->registry.Count("register") == 1; }));
  }
}

TEST(RegistrySetTest, RejectsBadOptions) {
  FakeDns dns;
  RegistrySetOptions o = Options(&dns);
  o.routers.clear();
  EXPECT_EQ(RegistrySet::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(&dns);
  o.registration.registration.clear_worker_id();
  EXPECT_EQ(RegistrySet::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(&dns);
  o.resolve_interval = absl::ZeroDuration();
  EXPECT_EQ(RegistrySet::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseRouterListTest, AcceptsNamesIpsAndBracketedIpv6) {
  auto r = ParseRouterList("router:7000, 10.0.0.2:7001,[::1]:7002");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[0].host, "router");
  EXPECT_EQ((*r)[0].port, 7000);
  EXPECT_EQ((*r)[1].host, "10.0.0.2");
  EXPECT_EQ((*r)[2].host, "::1");
  EXPECT_EQ((*r)[2].port, 7002);
}

TEST(ParseRouterListTest, RejectsMalformedEntries) {
  for (const char* bad : {"", ",", "router", "router:", "router:0", "router:70000", ":7000",
                          "::1:7000", "[::1:7000", "router:x"}) {
    EXPECT_EQ(ParseRouterList(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ResolveRouterEndpointTest, ResolvesLiteralsAndLocalhost) {
  auto v4 = ResolveRouterEndpoint({"127.0.0.1", 7000});
  ASSERT_TRUE(v4.ok()) << v4.status();
  EXPECT_EQ(*v4, std::vector<std::string>{"127.0.0.1:7000"});
  auto v6 = ResolveRouterEndpoint({"::1", 7000});
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(*v6, std::vector<std::string>{"[::1]:7000"});
  auto local = ResolveRouterEndpoint({"localhost", 7000});
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_FALSE(local->empty());
  const std::set<std::string> unique(local->begin(), local->end());
  EXPECT_EQ(unique.size(), local->size());
  EXPECT_FALSE(ResolveRouterEndpoint({"no-such-host.invalid", 7000}).ok());
}

}  // namespace
}  // namespace tandem::services
