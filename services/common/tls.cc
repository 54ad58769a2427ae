#include "services/common/tls.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/create_channel.h"

namespace tandem::services {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string what = absl::StrCat(flag, " ", path, ": ", std::strerror(err));
    if (err == EACCES) return absl::PermissionDeniedError(what);
    return absl::NotFoundError(what);
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string pem = ss.str();
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": not a PEM file"));
  }
  return pem;
}

struct Process {
  absl::Mutex mu;
  TlsOptions tls ABSL_GUARDED_BY(mu);
  std::shared_ptr<grpc::ServerCredentials> server ABSL_GUARDED_BY(mu);
  std::shared_ptr<grpc::ChannelCredentials> channel ABSL_GUARDED_BY(mu);
};

Process& P() {
  static Process* p = new Process();
  return *p;
}

}  // namespace

void AddTlsFlags(CLI::App& app, TlsOptions* tls) {
  app.add_option("--tls-cert", tls->cert_file,
                 "PEM certificate chain: serve gRPC over TLS (and present it to TLS peers)");
  app.add_option("--tls-key", tls->key_file, "PEM private key of --tls-cert");
  app.add_option("--tls-ca", tls->ca_file,
                 "PEM CA bundle that peers' certificates must chain to (clients: default the "
                 "system roots)");
  app.add_flag("--tls-require-client-cert", tls->require_client_cert,
               "mTLS: refuse clients without a certificate signed by --tls-ca");
  app.add_option("--tls-server-name", tls->server_name,
                 "name the servers' certificates must carry (default: the host dialled)");
}

absl::Status ValidateTlsOptions(const TlsOptions& t) {
  if (t.cert_file.empty() != t.key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key must be given together");
  }
  if (t.require_client_cert && t.ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-require-client-cert needs --tls-ca (the CA client certificates must chain to)");
  }
  if (t.require_client_cert && t.cert_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-require-client-cert needs --tls-cert and --tls-key (the server's own identity)");
  }
  if (!t.server_name.empty() && !t.client_tls()) {
    return absl::InvalidArgumentError("--tls-server-name needs --tls-ca or --tls-cert");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& t) {
  if (absl::Status st = ValidateTlsOptions(t); !st.ok()) return st;
  if (!t.server_tls()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions o;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  absl::StatusOr<std::string> cert = ReadPem("--tls-cert", t.cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem("--tls-key", t.key_file);
  if (!key.ok()) return key.status();
  pair.cert_chain = std::move(*cert);
  pair.private_key = std::move(*key);
  o.pem_key_cert_pairs.push_back(std::move(pair));
  if (!t.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("--tls-ca", t.ca_file);
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = std::move(*ca);
  }
  // With a CA but no requirement, a client certificate is checked when one is offered.
  o.client_certificate_request =
      t.require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
      : t.ca_file.empty()   ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                            : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  return grpc::SslServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& t) {
  if (absl::Status st = ValidateTlsOptions(t); !st.ok()) return st;
  if (!t.client_tls()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions o;
  if (!t.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("--tls-ca", t.ca_file);
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = std::move(*ca);
  }
  if (!t.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPem("--tls-cert", t.cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem("--tls-key", t.key_file);
    if (!key.ok()) return key.status();
    o.pem_cert_chain = std::move(*cert);
    o.pem_private_key = std::move(*key);
  }
  return grpc::SslCredentials(o);
}

absl::Status SetProcessTls(const TlsOptions& t) {
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server = MakeServerCredentials(t);
  if (!server.ok()) return server.status();
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> channel = MakeChannelCredentials(t);
  if (!channel.ok()) return channel.status();
  Process& p = P();
  absl::MutexLock lock(&p.mu);
  p.tls = t;
  p.server = std::move(*server);
  p.channel = std::move(*channel);
  return absl::OkStatus();
}

TlsOptions ProcessTls() {
  Process& p = P();
  absl::MutexLock lock(&p.mu);
  return p.tls;
}

std::shared_ptr<grpc::ServerCredentials> ProcessServerCredentials() {
  Process& p = P();
  absl::MutexLock lock(&p.mu);
  return p.server != nullptr ? p.server : grpc::InsecureServerCredentials();
}

std::shared_ptr<grpc::ChannelCredentials> ProcessChannelCredentials() {
  Process& p = P();
  absl::MutexLock lock(&p.mu);
  return p.channel != nullptr ? p.channel : grpc::InsecureChannelCredentials();
}

void SetClientKeepalive(grpc::ChannelArguments& args) {
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, absl::ToInt64Milliseconds(kKeepaliveTime));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, absl::ToInt64Milliseconds(kKeepaliveTimeout));
  // Pings only while calls are open, and as many as needed while a stream only receives (gRPC
  // otherwise stops after two pings without sending data).
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}

// Every channel CreateClientChannel makes: keepalive (tls.h), and name resolution asked for
// again at most once a second when connections fail (gRPC's default is 30 s). A Service's pod
// that comes back on a new IP (the kvstore's StatefulSet pod, a router) is then found about a
// second after its name resolves again, even when the first retry came while the name
// resolved to nothing (the pod gone, its successor not yet ready).
namespace {
void SetClientConnectionArgs(grpc::ChannelArguments& args) {
  SetClientKeepalive(args);
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 1000);
}
}  // namespace

std::shared_ptr<grpc::Channel> CreateClientChannel(const std::string& target,
                                                   grpc::ChannelArguments args) {
  SetClientConnectionArgs(args);
  std::string name;
  {
    Process& p = P();
    absl::MutexLock lock(&p.mu);
    name = p.tls.server_name;
  }
  if (!name.empty()) args.SetSslTargetNameOverride(name);
  return grpc::CreateCustomChannel(target, ProcessChannelCredentials(), args);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateClientChannel(const std::string& target,
                                                                   const TlsOptions& tls,
                                                                   grpc::ChannelArguments args) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = MakeChannelCredentials(tls);
  if (!creds.ok()) return creds.status();
  SetClientConnectionArgs(args);
  if (!tls.server_name.empty()) args.SetSslTargetNameOverride(tls.server_name);
  return grpc::CreateCustomChannel(target, *creds, args);
}

grpc::ChannelArguments RouterChannelArgs() {
  grpc::ChannelArguments args;
  args.SetServiceConfigJSON(R"({"loadBalancingConfig": [{"round_robin": {}}]})");
  return args;
}

std::vector<std::string> TlsFlagArgs(const TlsOptions& t) {
  std::vector<std::string> a;
  if (!t.cert_file.empty()) a.insert(a.end(), {"--tls-cert", t.cert_file});
  if (!t.key_file.empty()) a.insert(a.end(), {"--tls-key", t.key_file});
  if (!t.ca_file.empty()) a.insert(a.end(), {"--tls-ca", t.ca_file});
  if (t.require_client_cert) a.push_back("--tls-require-client-cert");
  if (!t.server_name.empty()) a.insert(a.end(), {"--tls-server-name", t.server_name});
  return a;
}

}  // namespace tandem::services
