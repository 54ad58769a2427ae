// HttpServer: the router's OpenAI-compatible HTTP front door (cpp-httplib).
//
// Endpoints: POST /v1/completions and /v1/chat/completions (JSON or, with stream: true,
// server-sent events ending in `data: [DONE]`), GET /v1/models and /v1/models/{id}, GET /health
// (200, or 503 once draining), POST /tokenize and /detokenize (vLLM's shapes), and
// GET /metrics when a metrics source is given (404 otherwise). Errors are OpenAI-shaped JSON
// (http_openai.h). The request and response translation lives in http_openai.h.
//
// One code path: a completion is not served here but sent, as a tandem.v1 Generate call, to
// the router's own gRPC endpoint over loopback. Validation, admission (429 when full),
// worker choice, retries, the default deadline (504) and cancellation are therefore exactly
// those of gRPC clients. When the HTTP client disconnects (a failed write, or a hang-up seen by
// http_connection.h's watcher, even before the first token) the Generate call is cancelled,
// which cancels the request on its workers.
//
// A streaming response waits for the first token before it sends its status line, so requests
// refused before any token (400, 429, 503, 504) get a real HTTP status; errors after that
// arrive as an SSE `data: {"error": ...}` event followed by [DONE].
//
// Threading: cpp-httplib runs each connection on a thread of its own (a pool that grows on
// demand up to max_threads; a streaming response holds its thread until it ends). All public
// methods are thread-safe. Ownership: the model holder must outlive the server; until it knows
// the model, every endpoint but /metrics answers 503.
// Errors: Start returns UNAVAILABLE when it cannot bind.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "services/router/auth.h"
#include "services/router/chat_template.h"
#include "services/router/http_connection.h"
#include "services/router/http_openai.h"
#include "services/router/model_holder.h"
#include "services/router/router_model.h"
#include "tandem/v1/inference.grpc.pb.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace tandem::router {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;                               // 0: any free port (see HttpServer::port())
  std::string router_address;                 // the router's own gRPC endpoint, host:port
  int max_threads = 1024;                     // connections served at once; more wait for a thread
  bool verbose = false;                       // a log line per request
  std::function<std::string()> metrics_text;  // GET /metrics body (Prometheus text) when set
  // When set, every endpoint but /health and /metrics needs `Authorization: Bearer KEY` (401
  // otherwise); completions forward the header to the router's Generate, which also applies
  // the tenant's rate limit (429 with Retry-After). Borrowed.
  Authenticator* auth = nullptr;
  size_t max_body_bytes = 16u << 20;  // larger request bodies get 413
};

class HttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& o,
                                                           const ModelHolder* models);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }
  // /health answers 503 from now on; completions still go to the router, which refuses them
  // with UNAVAILABLE (503) once it drains too.
  void StartDraining() { draining_ = true; }
  // Stops accepting, cancels the Generate calls still running and returns once every handler
  // has returned. Idempotent.
  void Stop();

  uint64_t requests() const { return requests_.load(); }
  // Generate calls cancelled because their HTTP client went away.
  uint64_t client_disconnects() const { return disconnects_.load(); }
  int watched_connections() const { return watcher_.watched(); }

 private:
  struct Choice;
  struct Call;
  HttpServer() = default;
  void Register();
  void HandleGenerate(ApiKind kind, const httplib::Request& req, httplib::Response& res);
  void StartChoice(Call& c, int32_t index, const httplib::Request& req);
  void Track(Call* c);
  void Untrack(Call* c);

  HttpServerOptions o_;
  const ModelHolder* models_ = nullptr;  // 503 until it knows the model
  int64_t started_ = 0;
  int port_ = 0;
  std::unique_ptr<httplib::Server> server_;
  std::thread listener_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Inference::Stub> stub_;
  DisconnectWatcher watcher_;
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> disconnects_{0};
  absl::Mutex calls_mu_;
  absl::flat_hash_set<Call*> calls_ ABSL_GUARDED_BY(calls_mu_);
  bool stopping_ ABSL_GUARDED_BY(calls_mu_) = false;
  std::once_flag stop_once_;
};

}  // namespace tandem::router
