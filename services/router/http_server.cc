#include "services/router/http_server.h"

#include <algorithm>
#include <deque>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "httplib.h"
#include "services/common/grpc_server.h"
#include "services/common/grpc_status.h"
#include "services/common/tls.h"
#include "services/router/log.h"

namespace tandem::router {
namespace {

constexpr char kJson[] = "application/json";

// httplib's own pool has a fixed size chosen at start (8 threads here), and a streaming
// response holds its thread for the whole generation: 8 concurrent streams would stall every
// other client, health checks included. This pool starts empty and grows on demand.
class ElasticTaskQueue final : public httplib::TaskQueue {
 public:
  explicit ElasticTaskQueue(size_t max_threads) : max_threads_(max_threads) {}
  ~ElasticTaskQueue() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    absl::MutexLock lock(&mu_);
    jobs_.push_back(std::move(fn));
    // Idle threads not yet woken still count as idle: compare them with the jobs waiting.
    if (jobs_.size() > idle_ && threads_.size() < max_threads_) {
      threads_.emplace_back([this] { Work(); });
    } else {
      cv_.Signal();
    }
  }

  void shutdown() override {
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      threads.swap(threads_);
      cv_.SignalAll();
    }
    for (std::thread& t : threads) t.join();
  }

 private:
  void Work() ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.Lock();
    while (true) {
      idle_++;
      while (!stop_ && jobs_.empty()) cv_.Wait(&mu_);
      idle_--;
      if (jobs_.empty()) break;  // stopping, and every queued job has been taken
      std::function<void()> fn = std::move(jobs_.front());
      jobs_.pop_front();
      mu_.Unlock();
      fn();
      mu_.Lock();
    }
    mu_.Unlock();
  }

  const size_t max_threads_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  size_t idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

void SendJson(httplib::Response& res, int status, const nlohmann::ordered_json& j) {
  res.status = status;
  res.set_content(DumpJson(j), kJson);
}

void SendError(httplib::Response& res, const HttpError& e) {
  SendJson(res, e.status, ErrorJson(e));
}

// 503 before the router knows its model (model_holder.h).
void SendNotYetKnown(httplib::Response& res) {
  HttpError e;
  e.status = 503;
  e.type = "service_unavailable_error";
  e.message = std::string(ModelHolder::NotYetKnown().message());
  SendError(res, e);
}

// A refusal of the router's Generate as an HTTP error; a 429 carries Retry-After (the rate
// limiter's wait from the call's trailing metadata, else 1 s: admission frees up quickly).
void SendGenerateError(httplib::Response& res, const grpc::ClientContext& ctx,
                       const grpc::Status& gs, ApiKind kind) {
  SendError(res, ErrorFromStatus(services::FromGrpcStatus(gs), kind));
  if (gs.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
    std::string after = "1";
    const auto& md = ctx.GetServerTrailingMetadata();
    if (auto it = md.find("retry-after"); it != md.end()) {
      after.assign(it->second.data(), it->second.size());
    }
    res.set_header("Retry-After", after);
  }
  if (gs.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    res.set_header("WWW-Authenticate", "Bearer");
  }
}

}  // namespace

// One choice's Generate call.
struct HttpServer::Choice {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
  bool finished = false;  // reader->Finish() has been called
  grpc::Status status;
  Accumulated acc;
  bool done = false;  // its final message was read
  std::optional<SseEncoder> sse;

  const grpc::Status& Finish() {
    if (!finished) {
      finished = true;
      status = reader->Finish();
    }
    return status;
  }
  ~Choice() {
    if (reader != nullptr && !finished) {
      // The client left mid-stream (or the server stops): end the Generate call, which
      // cancels the request on its workers, and reap it.
      ctx.TryCancel();
      v1::GenerateResponse m;
      while (reader->Read(&m)) {
      }
      Finish();
    }
  }
};

// One completion in flight, with its n choices. Owned by a shared_ptr that the streaming
// content provider holds, so it lives until httplib is done with the response.
struct HttpServer::Call {
  HttpServer* server = nullptr;
  OpenAiRequest req;
  // req.n of them, made before any starts, so that a disconnect or Stop cancels every one
  // (a context cancelled before its call starts cancels the call as it starts).
  std::vector<std::unique_ptr<Choice>> choices;
  uint64_t watch = 0;
  bool opened = false;
  std::optional<v1::GenerateResponse> pending;  // choice 0's first message, read early
  size_t next = 0;  // streaming: the choice read next, round robin
  absl::Time start = absl::Now();

  void CancelAll() {
    for (auto& c : choices) c->ctx.TryCancel();
  }
  std::vector<Accumulated> Results() const {
    std::vector<Accumulated> out;
    for (const auto& c : choices) out.push_back(c->acc);
    return out;
  }
  ~Call() {
    server->Untrack(this);
    server->watcher_.Unwatch(watch);
    choices.clear();  // ends the calls still running
    if (server->o_.verbose) {
      int64_t tokens = 0;
      for (const Accumulated& a : Results()) tokens += a.completion_tokens;
      Logf("http %s %s: %d choice(s), %lld completion tokens, %.1f ms", req.id.c_str(),
           req.stream ? "stream" : "json", req.n, static_cast<long long>(tokens),
           absl::ToDoubleMilliseconds(absl::Now() - start));
    }
  }
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& o,
                                                              const ModelHolder* models) {
  if (o.port < 0 || o.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("http port must be in [0, 65535], got ", o.port));
  }
  if (o.router_address.empty()) return absl::InvalidArgumentError("router_address is required");
  auto s = std::unique_ptr<HttpServer>(new HttpServer());
  s->o_ = o;
  if (models == nullptr) return absl::InvalidArgumentError("the HTTP front door needs a model");
  s->models_ = models;
  s->started_ = absl::ToUnixSeconds(absl::Now());
  s->channel_ = services::CreateClientChannel(o.router_address);  // TLS as the router serves
  s->stub_ = v1::Inference::NewStub(s->channel_);
  s->server_ = std::make_unique<httplib::Server>();
  const size_t max_threads = static_cast<size_t>(std::max(4, o.max_threads));
  s->server_->new_task_queue = [max_threads] { return new ElasticTaskQueue(max_threads); };
  s->server_->set_payload_max_length(o.max_body_bytes);  // beyond: 413
  s->server_->set_read_timeout(30, 0);
  s->server_->set_write_timeout(30, 0);
  s->server_->set_tcp_nodelay(true);
  s->Register();
  if (o.port == 0) {
    s->port_ = s->server_->bind_to_any_port(o.host);
  } else {
    s->port_ = s->server_->bind_to_port(o.host, o.port) ? o.port : -1;
  }
  if (s->port_ <= 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen for HTTP on ", services::JoinHostPort(o.host, o.port)));
  }
  httplib::Server* raw = s->server_.get();
  s->listener_ = std::thread([raw] { raw->listen_after_bind(); });
  // stop() is a no-op until the listener runs; wait, so that a prompt Stop is never lost.
  // (Connections made meanwhile wait in the bound socket's backlog.)
  for (int i = 0; i < 5000 && !raw->is_running(); ++i) absl::SleepFor(absl::Milliseconds(1));
  Logf("OpenAI-compatible HTTP on %s (chat template: %s)",
       services::JoinHostPort(o.host, s->port_).c_str(),
       models->chat() != nullptr ? models->chat()->description().c_str()
                                 : "the first worker's, once it registers");
  return s;
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
  std::call_once(stop_once_, [this] {
    {
      absl::MutexLock lock(&calls_mu_);
      stopping_ = true;
      for (Call* c : calls_) c->CancelAll();
    }
    // Let the cancelled streams write their error event and [DONE] before the server stops
    // writing altogether.
    for (absl::Time until = absl::Now() + absl::Seconds(2); absl::Now() < until;) {
      {
        absl::MutexLock lock(&calls_mu_);
        if (calls_.empty()) break;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    if (server_ != nullptr) server_->stop();
    if (listener_.joinable()) listener_.join();
  });
}

void HttpServer::Track(Call* c) {
  absl::MutexLock lock(&calls_mu_);
  calls_.insert(c);
  if (stopping_) c->CancelAll();
}

void HttpServer::Untrack(Call* c) {
  absl::MutexLock lock(&calls_mu_);
  calls_.erase(c);
}

void HttpServer::Register() {
  httplib::Server& s = *server_;
  if (o_.auth != nullptr) {
    // API keys before any handler: every endpoint but the probes and the scrape needs one.
    s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (req.path == "/health" || req.path == "/metrics") {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      absl::StatusOr<std::string> tenant =
          o_.auth->Authenticate(req.get_header_value("Authorization"));
      if (tenant.ok()) return httplib::Server::HandlerResponse::Unhandled;
      HttpError e;
      e.status = 401;
      e.message = std::string(tenant.status().message());
      e.code = "invalid_api_key";
      SendError(res, e);
      res.set_header("WWW-Authenticate", "Bearer");
      return httplib::Server::HandlerResponse::Handled;
    });
  }
  s.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    HandleGenerate(ApiKind::kCompletion, req, res);
  });
  s.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    HandleGenerate(ApiKind::kChat, req, res);
  });
  s.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    const RouterModel* model = models_->model();
    if (model == nullptr) return SendNotYetKnown(res);
    SendJson(res, 200, ModelsJson(*model, started_));
  });
  s.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1];
    const RouterModel* model = models_->model();
    if (model == nullptr) return SendNotYetKnown(res);
    if (!model->Matches(id)) {
      HttpError e;
      e.status = 404;
      e.message = absl::StrCat("model '", id, "' is not served here");
      e.param = "model";
      e.code = "model_not_found";
      return SendError(res, e);
    }
    SendJson(res, 200, ModelJson(*model, started_));
  });
  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    res.status = draining_ || models_->model() == nullptr ? 503 : 200;
  });
  s.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    nlohmann::ordered_json out;
    const RouterModel* model = models_->model();
    if (model == nullptr) return SendNotYetKnown(res);
    if (auto e = Tokenize(req.body, *model, *models_->chat(), &out)) return SendError(res, *e);
    SendJson(res, 200, out);
  });
  s.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    nlohmann::ordered_json out;
    const RouterModel* model = models_->model();
    if (model == nullptr) return SendNotYetKnown(res);
    if (auto e = Detokenize(req.body, *model, &out)) return SendError(res, *e);
    SendJson(res, 200, out);
  });
  if (o_.metrics_text) {
    s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(o_.metrics_text(), "text/plain; version=0.0.4");
    });
  }
  // Every error without a body of its own (unknown path, bad method) gets an OpenAI-shaped one.
  s.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req,
                                                              httplib::Response& res) {
    if (!res.body.empty() || req.method == "HEAD") {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    HttpError e;
    e.status = res.status;
    e.message = res.status == 404 ? absl::StrCat("no such endpoint: ", req.method, " ", req.path)
                                  : absl::StrCat("HTTP ", res.status);
    if (res.status == 404) e.code = "not_found";
    if (res.status >= 500) e.type = "server_error";
    if (res.status == 503) e.type = "service_unavailable_error";
    SendError(res, e);
    return httplib::Server::HandlerResponse::Handled;
  }));
  s.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        HttpError e;
        e.status = 500;
        e.type = "server_error";
        e.message = "internal error";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& ex) {
          e.message = absl::StrCat("internal error: ", ex.what());
        } catch (...) {
        }
        SendError(res, e);
      });
  if (o_.verbose) {
    s.set_logger([](const httplib::Request& req, const httplib::Response& res) {
      Logf("http %s %s -> %d", req.method.c_str(), req.path.c_str(), res.status);
    });
  }
}

void HttpServer::StartChoice(Call& c, int32_t index, const httplib::Request& req) {
  Choice& ch = *c.choices[static_cast<size_t>(index)];
  // The router's Generate authenticates again and applies the tenant's rate limit.
  if (req.has_header("Authorization")) {
    ch.ctx.AddMetadata("authorization", req.get_header_value("Authorization"));
  }
  ch.reader = stub_->Generate(&ch.ctx, ChoiceRequest(c.req, index));
}

void HttpServer::HandleGenerate(ApiKind kind, const httplib::Request& req, httplib::Response& res) {
  requests_++;
  auto c = std::make_shared<Call>();
  c->server = this;
  const RouterModel* model = models_->model();
  if (model == nullptr) return SendNotYetKnown(res);
  if (auto e = ParseOpenAiRequest(kind, req.body, *model, *models_->chat(), &c->req)) {
    return SendError(res, *e);
  }
  if (req.has_header("X-Session-Id")) {
    c->req.generate.set_session_id(req.get_header_value("X-Session-Id"));
  }
  for (int32_t i = 0; i < c->req.n; ++i) c->choices.push_back(std::make_unique<Choice>());
  Track(c.get());
  // No deadline of our own: the router gives requests without one its --timeout-ms, exactly
  // as for gRPC clients.
  c->watch = watcher_.Watch(
      FindConnectionSocket(req.remote_addr, req.remote_port, req.local_addr, req.local_port),
      [this, raw = c.get()] {
        disconnects_++;
        raw->CancelAll();
      });
  // Choice 0 first; the others once its first message is back, when the prompt's KV is in
  // the prefill worker's prefix cache (and published), so they reuse it instead of computing
  // it again side by side.
  StartChoice(*c, 0, req);
  Choice& first = *c->choices[0];
  v1::GenerateResponse m;
  if (!first.reader->Read(&m)) {
    const grpc::Status& gs = first.Finish();
    if (!gs.ok()) return SendGenerateError(res, first.ctx, gs, kind);
    return SendError(
        res, ErrorFromStatus(absl::InternalError("the generation produced nothing"), kind));
  }
  for (int32_t i = 1; i < c->req.n; ++i) StartChoice(*c, i, req);

  if (!c->req.stream) {
    first.acc.Add(m);
    for (auto& ch : c->choices) {
      while (!ch->acc.finished && ch->reader->Read(&m)) ch->acc.Add(m);
      const grpc::Status& gs = ch->Finish();
      if (!gs.ok()) return SendGenerateError(res, ch->ctx, gs, kind);
      if (!ch->acc.finished) {
        return SendError(res, ErrorFromStatus(absl::InternalError(
                                                  "the generation ended without a final message"),
                                              kind));
      }
    }
    return SendJson(res, 200, CompletionJson(c->req, c->Results()));
  }

  // Streaming: the status line waited for the first token, so early refusals keep their code.
  // The choices are read in turn, one message each: they decode side by side, in step.
  c->pending = std::move(m);
  for (int32_t i = 0; i < c->req.n; ++i) c->choices[static_cast<size_t>(i)]->sse.emplace(c->req, i);
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider("text/event-stream", [c, kind](size_t, httplib::DataSink& sink) {
    auto put = [&sink](const std::string& s) {
      return s.empty() || sink.write(s.data(), s.size());
    };
    if (!c->opened) {
      c->opened = true;
      for (auto& ch : c->choices) {
        if (!put(ch->sse->Open())) return false;
      }
    }
    Choice* ch = nullptr;
    for (size_t k = 0; k < c->choices.size() && ch == nullptr; ++k) {
      Choice* x = c->choices[(c->next + k) % c->choices.size()].get();
      if (!x->done) {
        ch = x;
        c->next = (c->next + k + 1) % c->choices.size();
      }
    }
    v1::GenerateResponse m;
    if (ch == c->choices[0].get() && c->pending) {
      m = std::move(*c->pending);
      c->pending.reset();
    } else if (!ch->reader->Read(&m)) {
      const grpc::Status& gs = ch->Finish();
      const absl::Status st =
          gs.ok() ? absl::InternalError("the generation ended without a final message")
                  : services::FromGrpcStatus(gs);
      put(ch->sse->Error(ErrorFromStatus(st, kind)));
      sink.done();
      return true;
    }
    ch->acc.Add(m);
    if (!put(ch->sse->Delta(m))) return false;
    if (m.finished()) {
      while (ch->reader->Read(&m)) {
      }
      ch->Finish();
      ch->done = true;
      if (!put(ch->sse->Finish(ch->acc))) return false;
      if (std::all_of(c->choices.begin(), c->choices.end(), [](const auto& x) { return x->done; })) {
        if (!put(ch->sse->Done(c->Results()))) return false;
        sink.done();
      }
    }
    return true;
  });
}

}  // namespace tandem::router
