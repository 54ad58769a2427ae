// A name listed on several /etc/hosts lines (the pod harness's stand-in for a headless Service)
// resolves to every address: for the workers' registration (getaddrinfo, registry_set.h) and
// for the clients' channels (gRPC 1.51's default resolver with round_robin, tls.h
// RouterChannelArgs), whose calls then reach every address.
//
// The checks need their own /etc/hosts, so the outer test re-runs this binary's Child tests in
// a private mount namespace (`unshare -m`, root only; skipped otherwise) with a hosts file that
// lists kName three times. Run directly, the Child tests skip: the name does not resolve.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "services/common/grpc_server.h"
#include "services/common/registry_set.h"
#include "services/common/tls.h"
#include "tests/component/services/fake_registry.h"

namespace tandem::services {
namespace {

using ::tandem::testing::FakeRegistry;

constexpr char kName[] = "tandem-multi-address-test";
const std::vector<std::string> kIps = {"127.0.0.2", "127.0.0.3", "127.0.0.4"};

bool NameListed() {
  std::ifstream f("/etc/hosts");
  std::string line;
  while (std::getline(f, line)) {
    if (line.find(kName) != std::string::npos) return true;
  }
  return false;
}

TEST(MultiAddressChild, GetaddrinfoReturnsEveryHostsLine) {
  if (!NameListed()) GTEST_SKIP() << "runs inside MultiAddressTest's mount namespace";
  absl::StatusOr<std::vector<std::string>> got = ResolveRouterEndpoint({kName, 7000});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::set<std::string>(got->begin(), got->end()),
            (std::set<std::string>{"127.0.0.2:7000", "127.0.0.3:7000", "127.0.0.4:7000"}));
}

TEST(MultiAddressChild, RoundRobinChannelsReachEveryAddress) {
  if (!NameListed()) GTEST_SKIP() << "runs inside MultiAddressTest's mount namespace";
  // One Registry server per address, all on the same port.
  std::vector<std::unique_ptr<FakeRegistry>> registries;
  std::vector<std::unique_ptr<GrpcServer>> servers;
  int port = 0;
  for (const std::string& ip : kIps) {
    registries.push_back(std::make_unique<FakeRegistry>(1000));
    GrpcServerOptions o;
    o.host = ip;
    o.port = port;
    o.services = {registries.back().get()};
    auto s = GrpcServer::Start(o);
    ASSERT_TRUE(s.ok()) << ip << ": " << s.status();
    port = (*s)->port();
    servers.push_back(std::move(*s));
  }
  auto stub = v1::Registry::NewStub(
      CreateClientChannel(absl::StrCat(kName, ":", port), RouterChannelArgs()));
  for (int i = 0; i < 30; ++i) {
    grpc::ClientContext cc;
    cc.set_wait_for_ready(true);
    cc.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::RegisterRequest req;
    req.set_worker_id(absl::StrCat("w", i));
    v1::RegisterResponse resp;
    ASSERT_TRUE(stub->Register(&cc, req, &resp).ok());
  }
  // round_robin: every server gets calls once all subchannels are READY.
  for (size_t i = 0; i < kIps.size(); ++i) {
    EXPECT_GT(registries[i]->Count("register"), 0) << kIps[i];
  }
}

TEST(MultiAddressTest, InAMountNamespaceWithSeveralHostsLines) {
  if (geteuid() != 0 || std::system("unshare -m true >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "needs root and unshare -m for a private /etc/hosts";
  }
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("tandem-multi-", getpid());
  fs::create_directories(dir);
  const fs::path hosts = dir / "hosts";
  {
    std::ifstream in("/etc/hosts");
    std::ofstream out(hosts);
    out << in.rdbuf() << "\n";
    for (const std::string& ip : kIps) out << ip << " " << kName << "\n";
  }
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const fs::path log = dir / "child.log";
  const std::string cmd = absl::StrCat(
      "timeout 60 unshare -m sh -c 'mount --bind ", hosts.string(), " /etc/hosts && exec ", self,
      " --gtest_filter=MultiAddressChild.*' >", log.string(), " 2>&1");
  const int rc = std::system(cmd.c_str());
  std::ifstream f(log);
  const std::string out((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  fs::remove_all(dir);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("[  PASSED  ] 2 tests"), std::string::npos) << out;
  EXPECT_EQ(out.find("SKIPPED"), std::string::npos) << out;
}

}  // namespace
}  // namespace tandem::services
