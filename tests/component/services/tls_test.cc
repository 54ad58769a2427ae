// TLS and mTLS on tandem's gRPC servers and clients (services/common/tls.h): a throw-away PKI
// made with openssl at test time, a GrpcServer hosting a small Inference service, and clients
// with the right CA, another CA, no certificate, a certificate of another CA, or no TLS at all.
// Also the flag checks (missing files, a cert without its key) and the process-wide settings
// GrpcServer and CreateClientChannel take by default.
#include "services/common/tls.h"

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "services/common/grpc_server.h"
#include "tandem/v1/inference.grpc.pb.h"
#include "tests/fakes/test_pki.h"

namespace tandem::services {
namespace {

namespace fs = std::filesystem;

class EchoModels final : public v1::Inference::Service {
 public:
  grpc::Status ListModels(grpc::ServerContext*, const v1::ListModelsRequest*,
                          v1::ListModelsResponse* resp) override {
    resp->add_models()->set_id("m");
    return grpc::Status::OK;
  }
};

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string dir =
        (fs::temp_directory_path() / absl::StrCat("tandem-pki-", getpid())).string();
    auto pki = testing::MakeTestPki(dir);
    if (pki.ok()) {
      pki_ = new testing::TestPki(*pki);
    } else {
      skip_reason_ = new std::string(pki.status().ToString());
    }
  }
  static void TearDownTestSuite() {
    if (pki_ != nullptr) fs::remove_all(pki_->dir);
    delete pki_;
    pki_ = nullptr;
  }
  void SetUp() override {
    if (pki_ == nullptr) GTEST_SKIP() << *skip_reason_;
  }

  TlsOptions ServerTls(bool mtls) const {
    TlsOptions t;
    t.cert_file = pki_->server_cert;
    t.key_file = pki_->server_key;
    if (mtls) {
      t.ca_file = pki_->ca;
      t.require_client_cert = true;
    }
    return t;
  }

  void Serve(const TlsOptions& tls) {
    auto creds = MakeServerCredentials(tls);
    ASSERT_TRUE(creds.ok()) << creds.status();
    GrpcServerOptions o;
    o.services = {&svc_};
    o.credentials = *creds;
    auto s = GrpcServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }

  // ListModels through a channel with `creds`: the call's status.
  grpc::Status Call(const std::shared_ptr<grpc::Channel>& ch) {
    auto stub = v1::Inference::NewStub(ch);
    grpc::ClientContext cc;
    cc.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ListModelsRequest rq;
    v1::ListModelsResponse resp;
    grpc::Status st = stub->ListModels(&cc, rq, &resp);
    if (st.ok()) EXPECT_EQ(resp.models_size(), 1);
    return st;
  }
  grpc::Status CallWith(const TlsOptions& client) {
    auto ch = CreateClientChannel(server_->address(), client);
    EXPECT_TRUE(ch.ok()) << ch.status();
    if (!ch.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, "no channel");
    return Call(*ch);
  }
  grpc::Status CallPlaintext() {
    return Call(grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }

  static testing::TestPki* pki_;
  static std::string* skip_reason_;
  EchoModels svc_;
  std::unique_ptr<GrpcServer> server_;
};

testing::TestPki* TlsTest::pki_ = nullptr;
std::string* TlsTest::skip_reason_ = nullptr;

TEST_F(TlsTest, TlsServerAcceptsClientTrustingItsCa) {
  Serve(ServerTls(/*mtls=*/false));
  TlsOptions c;
  c.ca_file = pki_->ca;
  EXPECT_TRUE(CallWith(c).ok());
}

TEST_F(TlsTest, TlsServerRefusesPlaintextAndClientsTrustingAnotherCa) {
  Serve(ServerTls(/*mtls=*/false));
  EXPECT_EQ(CallPlaintext().error_code(), grpc::StatusCode::UNAVAILABLE);
  TlsOptions c;
  c.ca_file = pki_->other_ca;
  EXPECT_EQ(CallWith(c).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, ServerNameOverrideChecksTheCertificateForThatName) {
  Serve(ServerTls(/*mtls=*/false));
  TlsOptions c;
  c.ca_file = pki_->ca;
  c.server_name = "localhost";  // in the certificate
  EXPECT_TRUE(CallWith(c).ok());
  c.server_name = "router.example";  // not in it
  EXPECT_EQ(CallWith(c).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, MutualTlsAcceptsOnlyClientsWithACertificateOfItsCa) {
  Serve(ServerTls(/*mtls=*/true));
  TlsOptions good;
  good.ca_file = pki_->ca;
  good.cert_file = pki_->client_cert;
  good.key_file = pki_->client_key;
  EXPECT_TRUE(CallWith(good).ok());

  EXPECT_NE(CallPlaintext().error_code(), grpc::StatusCode::OK);
  TlsOptions no_cert;
  no_cert.ca_file = pki_->ca;
  EXPECT_EQ(CallWith(no_cert).error_code(), grpc::StatusCode::UNAVAILABLE);
  TlsOptions rogue = good;  // trusts the server, but its certificate is of another CA
  rogue.cert_file = pki_->rogue_cert;
  rogue.key_file = pki_->rogue_key;
  EXPECT_EQ(CallWith(rogue).error_code(), grpc::StatusCode::UNAVAILABLE);
  TlsOptions wrong_ca = good;  // presents a good certificate but distrusts the server
  wrong_ca.ca_file = pki_->other_ca;
  EXPECT_EQ(CallWith(wrong_ca).error_code(), grpc::StatusCode::UNAVAILABLE);
  // The server is still serving the good client afterwards.
  EXPECT_TRUE(CallWith(good).ok());
}

TEST_F(TlsTest, ProcessSettingsApplyToServersAndChannelsByDefault) {
  TlsOptions t = ServerTls(/*mtls=*/true);
  t.cert_file = pki_->server_cert;  // the server's certificate allows client auth too
  ASSERT_TRUE(SetProcessTls(t).ok());
  GrpcServerOptions o;
  o.services = {&svc_};
  auto s = GrpcServer::Start(o);
  ASSERT_TRUE(s.ok()) << s.status();
  server_ = std::move(*s);
  EXPECT_TRUE(Call(CreateClientChannel(server_->address())).ok());
  EXPECT_NE(CallPlaintext().error_code(), grpc::StatusCode::OK);
  ASSERT_TRUE(SetProcessTls(TlsOptions{}).ok());  // back to plaintext for later tests
  EXPECT_FALSE(ProcessTls().client_tls());
}

TEST_F(TlsTest, BadFlagsAreErrorsNamingTheFlag) {
  TlsOptions t;
  t.cert_file = pki_->server_cert;
  absl::Status st = SetProcessTls(t);  // no key
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("--tls-key"), std::string::npos) << st;

  t.key_file = pki_->dir + "/missing.key";
  st = MakeServerCredentials(t).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(st.message().find("--tls-key"), std::string::npos) << st;
  EXPECT_NE(st.message().find("missing.key"), std::string::npos) << st;

  t = ServerTls(false);
  t.require_client_cert = true;  // no CA to check clients against
  st = MakeServerCredentials(t).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("--tls-ca"), std::string::npos) << st;

  t = ServerTls(false);
  t.cert_file = pki_->dir + "/ext.cnf";  // exists, is not PEM
  st = MakeServerCredentials(t).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("--tls-cert"), std::string::npos) << st;

  EXPECT_EQ(
      TlsFlagArgs(ServerTls(true)),
      (std::vector<std::string>{"--tls-cert", pki_->server_cert, "--tls-key", pki_->server_key,
                                "--tls-ca", pki_->ca, "--tls-require-client-cert"}));
}

}  // namespace
}  // namespace tandem::services
