// TLS and mutual TLS for every gRPC connection tandem makes: the servers of the router, the
// workers and the kvstore, and the clients they (and the CLI) create; and those clients'
// keepalive (below).
//
// One TlsOptions, filled from the same flags on every binary (AddTlsFlags):
//   --tls-cert FILE  --tls-key FILE   this process's certificate chain and key (PEM). A server
//                                     needs them; a client presents them when the peer asks
//                                     (mTLS). Given: every server of the process speaks TLS.
//   --tls-ca FILE                     the CA bundle peers are checked against: the server's
//                                     certificate (clients) and client certificates (servers).
//                                     A client without it trusts the system roots.
//   --tls-require-client-cert         servers refuse clients without a certificate signed by
//                                     --tls-ca (mTLS).
//   --tls-server-name NAME            clients check the server's certificate for NAME instead
//                                     of the host they dial (certificates issued for a service
//                                     name, dialled by IP).
// Plaintext stays the default: with none of the flags nothing changes.
//
// A process sets its options once, right after parsing flags (SetProcessTls); the servers built
// by GrpcServer::Start and the channels made by CreateClientChannel then use them, so code that
// opens connections (registration, the router's worker channels, its HTTP front door's loopback
// client) needs no TLS parameter of its own. Files are read when SetProcessTls (or the Make*
// functions) run, so a missing or unreadable file fails at start, naming the flag.
//
// Threading: SetProcessTls before any server or channel is made (it is not synchronised against
// concurrent readers beyond a mutex: later calls affect only later servers and channels); the
// other functions are thread-safe. Errors: INVALID_ARGUMENT for inconsistent flags, NOT_FOUND /
// PERMISSION_DENIED for unreadable files, each naming the flag.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace CLI {
class App;
}
namespace grpc {
class Channel;
}

namespace tandem::services {

struct TlsOptions {
  std::string cert_file;  // PEM certificate chain
  std::string key_file;   // PEM private key
  std::string ca_file;    // PEM CA bundle
  bool require_client_cert = false;
  std::string server_name;  // clients: the name the server's certificate must carry

  // Whether servers use TLS (a certificate is configured).
  bool server_tls() const { return !cert_file.empty(); }
  // Whether clients use TLS (a certificate or a CA is configured).
  bool client_tls() const { return !cert_file.empty() || !ca_file.empty(); }
};

// Registers --tls-cert, --tls-key, --tls-ca, --tls-require-client-cert and --tls-server-name.
void AddTlsFlags(CLI::App& app, TlsOptions* tls);

// Flag consistency: a certificate needs its key and the other way round; requiring client
// certificates needs a CA to check them and a server certificate.
absl::Status ValidateTlsOptions(const TlsOptions& tls);

// Server credentials: insecure when !server_tls(). Reads the files now.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& tls);
// Channel credentials: insecure when !client_tls(). Reads the files now.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& tls);

// The process-wide options (validated, files read now). Default: plaintext.
absl::Status SetProcessTls(const TlsOptions& tls);
TlsOptions ProcessTls();
std::shared_ptr<grpc::ServerCredentials> ProcessServerCredentials();
std::shared_ptr<grpc::ChannelCredentials> ProcessChannelCredentials();

// Keepalive on every tandem connection, both ends: a silent network partition (packets dropped,
// no RST, no FIN) would otherwise leave a stream waiting until TCP gives up, many minutes later.
// While calls are open each side pings every kKeepaliveTime and fails the connection's calls
// (UNAVAILABLE on a client, a cancelled ServerContext on a server) when no ack comes back
// within kKeepaliveTimeout: the router then migrates the streams a decode worker can no longer
// deliver, and the decode worker frees the sequences whose router it cannot reach. Servers accept
// a ping every second, with or without data, so a quiet stream is never answered "too many
// pings" (GOAWAY).
inline constexpr absl::Duration kKeepaliveTime = absl::Seconds(5);
inline constexpr absl::Duration kKeepaliveTimeout = absl::Seconds(5);
// The client side of the above; CreateClientChannel applies it to every channel (GrpcServer
// applies the server side, grpc_server.cc).
void SetClientKeepalive(grpc::ChannelArguments& args);

// A channel to `target` with the process's credentials and the keepalive above; `args` gains
// the server-name override when one is set.
std::shared_ptr<grpc::Channel> CreateClientChannel(const std::string& target,
                                                   grpc::ChannelArguments args = {});
// The same with explicit options (tests, tools that talk to several clusters).
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateClientChannel(
    const std::string& target, const TlsOptions& tls, grpc::ChannelArguments args = {});

// Client arguments for dialling the routers (tandem client, tandem bench): round_robin over
// every address the target resolves to, so a router Service name (several routers) spreads
// calls over all of them and a dead one is skipped while the others are READY. gRPC 1.51's
// default resolver (c-ares) returns every /etc/hosts line of a name and every DNS A/AAAA record.
grpc::ChannelArguments RouterChannelArgs();

// The flags that reproduce `tls` on a child process's command line (tandem cluster up).
std::vector<std::string> TlsFlagArgs(const TlsOptions& tls);

}  // namespace tandem::services
