// The real binaries with --tls-* and --api-keys: a tandem-router requiring client certificates
// and API keys, and a colocated tandem-decode that registers with it over mTLS and is driven by
// it over mTLS. A client with a certificate and a key generates; without the key it is
// UNAUTHENTICATED; in plaintext it cannot connect. A missing certificate file stops the router
// at start with a message naming the flag.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "services/common/tls.h"
#include "tandem/v1/inference.grpc.pb.h"
#include "tests/fakes/child_process.h"
#include "tests/fakes/test_pki.h"
#include "tests/fakes/tiny_model.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using testing::ChildProcess;

class SecureBinariesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("tandem-secure-", getpid());
    fs::create_directories(dir_);
    auto pki = testing::MakeTestPki(Path("pki"));
    if (!pki.ok()) GTEST_SKIP() << pki.status();
    pki_ = *pki;
    ASSERT_TRUE(testing::WriteTinyModel(testing::TinyModelOptions(), Path("tiny.gguf")).ok());
    std::ofstream(Path("keys")) << "# test keys\nk-alice alice\n";
    std::ofstream(Path("secret")) << "s3cret";
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }


  // The flags every process of the cluster gets: its certificate (valid for both ends) and mTLS.
  std::vector<std::string> Tls() const {
    return {"--tls-cert", pki_.server_cert,           "--tls-key", pki_.server_key, "--tls-ca",
            pki_.ca,      "--tls-require-client-cert"};
  }

  grpc::Status Generate(const std::shared_ptr<grpc::Channel>& ch, const std::string& key,
                        int* tokens) {
    auto stub = v1::Inference::NewStub(ch);
    grpc::ClientContext cc;
    cc.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (!key.empty()) cc.AddMetadata("authorization", "Bearer " + key);
    v1::GenerateRequest req;
    req.set_text("hello");
    req.mutable_sampling()->set_max_tokens(3);
    req.mutable_sampling()->set_temperature(0);
    auto reader = stub->Generate(&cc, req);
    v1::GenerateResponse m;
    *tokens = 0;
    while (reader->Read(&m)) *tokens += m.token_ids_size();
    return reader->Finish();
  }

  fs::path dir_;
  testing::TestPki pki_;
};

TEST_F(SecureBinariesTest, ClusterOverMutualTlsWithApiKeys) {
  std::vector<std::string> rargs = {"--model",
                                    Path("tiny.gguf"),
                                    "--host",
                                    "127.0.0.1",
                                    "--port",
                                    "0",
                                    "--port-file",
                                    Path("router.port"),
                                    "--api-keys",
                                    Path("keys"),
                                    "--tenant-secret-file",
                                    Path("secret")};
  for (const std::string& a : Tls()) rargs.push_back(a);
  ChildProcess router("tandem-router", rargs, Path("router.log"));
  const int rport = WaitForPortFile(Path("router.port"), &router);
  ASSERT_GT(rport, 0) << router.Log();
  const std::string raddr = absl::StrCat("127.0.0.1:", rport);

  std::vector<std::string> wargs = {"--model",     Path("tiny.gguf"),
                                    "--port",      "0",
                                    "--port-file", Path("w.port"),
                                    "--threads",   "1",
                                    "--ctx-size",  "256",
                                    "--max-seqs",  "2",
                                    "--role",      "both",
                                    "--transport", "none",
                                    "--worker-id", "w0",
                                    "--router",    raddr};
  for (const std::string& a : Tls()) wargs.push_back(a);
  ChildProcess worker("tandem-decode", wargs, Path("w.log"));
  ASSERT_GT(WaitForPortFile(Path("w.port"), &worker), 0) << worker.Log();

  services::TlsOptions client;
  client.ca_file = pki_.ca;
  client.cert_file = pki_.client_cert;
  client.key_file = pki_.client_key;
  auto ch = services::CreateClientChannel(raddr, client);
  ASSERT_TRUE(ch.ok()) << ch.status();
  // The worker registers over mTLS; the router then drives it over mTLS.
  int tokens = 0;
  grpc::Status st;
  for (absl::Time end = absl::Now() + absl::Seconds(30); absl::Now() < end;) {
    st = Generate(*ch, "k-alice", &tokens);
    if (st.ok()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(st.ok()) << st.error_message() << "\nrouter:\n"
                       << router.Log() << "\nworker:\n"
                       << worker.Log();
  EXPECT_EQ(tokens, 3);

  EXPECT_EQ(Generate(*ch, "", &tokens).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Generate(*ch, "k-bob", &tokens).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  auto plain = grpc::CreateChannel(raddr, grpc::InsecureChannelCredentials());
  EXPECT_EQ(Generate(plain, "k-alice", &tokens).error_code(), grpc::StatusCode::UNAVAILABLE);
  services::TlsOptions no_cert;
  no_cert.ca_file = pki_.ca;
  auto ch2 = services::CreateClientChannel(raddr, no_cert);
  ASSERT_TRUE(ch2.ok());
  EXPECT_EQ(Generate(*ch2, "k-alice", &tokens).error_code(), grpc::StatusCode::UNAVAILABLE);

  EXPECT_EQ(worker.Stop(), 0) << worker.Log();
  EXPECT_EQ(router.Stop(), 0) << router.Log();
}

TEST_F(SecureBinariesTest, MissingCertificateFileStopsTheRouterNamingTheFlag) {
  ChildProcess router("tandem-router",
                      {"--model", Path("tiny.gguf"), "--port", "0", "--tls-cert", Path("nope.pem"),
                       "--tls-key", pki_.server_key},
                      Path("router.log"));
  const int rc = router.Wait(absl::Seconds(30));
  EXPECT_NE(rc, 0);
  EXPECT_NE(rc, -1);
  EXPECT_NE(router.Log().find("--tls-cert"), std::string::npos) << router.Log();
  EXPECT_NE(router.Log().find("nope.pem"), std::string::npos) << router.Log();
}

}  // namespace
}  // namespace tandem
