#include "services/router/router_service.h"

#include <algorithm>
#include <cmath>
#include <coroutine>
#include <optional>
#include <random>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/util/status_util.h"
#include "engine/kv/block_pool.h"
#include "engine/sampling/json_schema.h"
#include "engine/tokenizer/tokenizer.h"
#include "services/common/grpc_await.h"
#include "services/common/grpc_status.h"
#include "services/common/sampling_convert.h"
#include "services/router/log.h"
#include "services/router/request_validation.h"
#include "xxhash.h"

namespace tandem::router {

uint64_t SessionWeight(std::string_view session_id, std::string_view worker_id) {
  const uint64_t seed = XXH3_64bits(session_id.data(), session_id.size());
  return XXH3_64bits_withSeed(worker_id.data(), worker_id.size(), seed) >> 11;
}

namespace {

absl::Status Prefixed(const absl::Status& st, const std::string& prefix) {
  if (st.ok()) return st;
  return absl::Status(st.code(), absl::StrCat(prefix, st.message()));
}

absl::Status CancelledByClient() {
  return absl::CancelledError("the client cancelled the request (or its deadline passed)");
}

// An outgoing call tied to the incoming one: gRPC propagates the client's cancellation and
// deadline to it, and `deadline` (never later than the request's) bounds it explicitly.
std::unique_ptr<grpc::ClientContext> Child(const grpc::CallbackServerContext& parent,
                                           absl::Time deadline) {
  std::unique_ptr<grpc::ClientContext> cc = grpc::ClientContext::FromCallbackServerContext(parent);
  cc->set_deadline(services::ToChronoDeadline(deadline));
  return cc;
}

const char* FinishName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    case v1::FINISH_REASON_ERROR:
      return "error";
    default:
      return "none";
  }
}

// Whether a decode stream that broke with `code` is worth moving to another worker: the worker
// died, was cut off, shut down or failed inside. A refused request (INVALID_ARGUMENT,
// NOT_FOUND, ...) would be refused again.
bool MigratableCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kAborted:
    // CANCELLED by the worker, DEADLINE_EXCEEDED of a hop: the caller checks the client's side
    // and the request's deadline.
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kDataLoss:
      return true;
    default:
      return false;
  }
}

// A Prefill that failed before the worker could have written anything: the connection was
// refused, or the worker turned the request away. Its decode reservation is still clean.
bool PrefillNeverStarted(const grpc::Status& gs) {
  if (gs.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) return true;
  return gs.error_code() == grpc::StatusCode::UNAVAILABLE &&
         absl::StrContains(absl::AsciiStrToLower(gs.error_message()), "failed to connect");
}

// Waits for an admission slot without a thread (Admission::AcquireAsync). A slot freed by
// another request hands itself over inside that request's call, so the waiter continues on a
// gRPC thread of its own (an alarm set to now, as services::Hop does) rather than there.
class AdmissionWait {
 public:
  AdmissionWait(Admission* a, Admission::Request r) : a_(a), r_(std::move(r)) {}
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> h) {
    std::optional<absl::StatusOr<Slot>> now =
        a_->AcquireAsync(std::move(r_), [this, h](absl::StatusOr<Slot> s) {
          result_.emplace(std::move(s));
          hop_.Set(std::chrono::system_clock::now(), [h](bool) { h.resume(); });
        });
    if (!now.has_value()) return true;  // suspended: the callback owns `this` from here
    result_.emplace(std::move(*now));
    return false;
  }
  absl::StatusOr<Slot> await_resume() { return std::move(*result_); }

 private:
  Admission* a_;
  Admission::Request r_;
  std::optional<absl::StatusOr<Slot>> result_;
  grpc::Alarm hop_;
};

}  // namespace

// The client's side of one Generate: its messages are written one at a time, each awaited, so
// a slow client holds back the relay (and through it the worker's stream) instead of growing a
// buffer here. Deletes itself once gRPC is done with the call.
class InferenceService::GenerateReactor final
    : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  explicit GenerateReactor(std::atomic<int>* active) : active_(active) {}

  class WriteAwaiter {
   public:
    WriteAwaiter(GenerateReactor* r, const v1::GenerateResponse* msg) : r_(r), msg_(msg) {}
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) {
      r_->write_waiter_ = h;
      if (r_->tools_.tool_choice != ToolChoice::kNone) {
        // A Chat call with tools: the finished message carries the calls of the whole text.
        r_->text_ += msg_->text();
        if (msg_->finished()) {
          r_->last_ = *msg_;
          for (const ToolCall& c : ParseToolCalls(r_->tools_, r_->text_).calls) {
            v1::ToolCall* t = r_->last_.add_tool_calls();
            t->set_id(c.id);
            t->set_name(c.name);
            t->set_arguments(c.arguments);
          }
          msg_ = &r_->last_;
        }
      }
      r_->StartWrite(msg_);  // nothing here touches the reactor after this
    }
    bool await_resume() const noexcept { return r_->write_ok_; }

   private:
    GenerateReactor* r_;
    const v1::GenerateResponse* msg_;
  };
  // False once the client is gone. `msg` must live until the write is done.
  WriteAwaiter Write(const v1::GenerateResponse& msg) { return WriteAwaiter(this, &msg); }

  void OnWriteDone(bool ok) override {
    write_ok_ = ok;
    std::exchange(write_waiter_, {}).resume();
  }
  void OnDone() override {
    (*active_)--;
    delete this;
  }
  // A Chat call's request, rendered (Generate's is gRPC's own), and its tools.
  v1::GenerateRequest& owned_request() { return owned_; }
  OpenAiRequest& tools() { return tools_; }

 private:
  std::atomic<int>* active_;
  std::coroutine_handle<> write_waiter_;
  bool write_ok_ = false;
  v1::GenerateRequest owned_;
  OpenAiRequest tools_;
  std::string text_;          // with tools: the text written so far
  v1::GenerateResponse last_;  // with tools: the finished message, with the calls
};

// The text of a request after a migration, produced by the router exactly as the decode
// worker's scheduler produces it (engine/runtime/scheduler.cc Emit and Finish): a streaming
// decoder for UTF-8 and SentencePiece spaces, then the stop checker, which holds back text
// that may begin a stop string. Replaying the tokens already sent through it rebuilds the
// state the broken worker had, held-back bytes included.
class InferenceService::RouterText {
 public:
  RouterText(const engine::Tokenizer& tok, const std::vector<int32_t>& prompt,
             const engine::SamplingParams& sp)
      : tok_(tok),
        stop_(sp),
        // As the scheduler decides it: a completion after real prompt text keeps its leading
        // space; after a bare BOS it starts fresh.
        decoder_(tok, /*special=*/false, std::any_of(prompt.begin(), prompt.end(), [&](int32_t t) {
                   return t != tok.bos_id();
                 })) {}

  // One generated token; returns the text it completes (with the held text when it ends the
  // request).
  std::string Push(int32_t token) {
    const bool eog = tok_.IsEog(token);
    const std::string piece = eog ? std::string() : decoder_.Push(token);
    std::string text = stop_.Push(token, piece, eog);
    if (stop_.reason() != engine::FinishReason::kNone) text += stop_.Flush();
    return text;
  }
  // The request ended without a token (and without an error): what was still held.
  std::string End() { return stop_.Flush() + decoder_.Flush(); }
  // kNone while the request runs; kStop or kLength once a token ended it.
  engine::FinishReason reason() const { return stop_.reason(); }

 private:
  const engine::Tokenizer& tok_;
  engine::StopChecker stop_;
  engine::StreamingDecoder decoder_;
};

absl::Status ValidateRouterOptions(const RouterOptions& o) {
  if (o.port < 0 || o.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("port must be in [0, 65535], got ", o.port));
  }
  if (o.ctx_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ctx_size must be >= 0, got ", o.ctx_size));
  }
  if (o.worker_lease < absl::Milliseconds(100)) {
    return absl::InvalidArgumentError("lease_ms must be >= 100");
  }
  if (o.reserve_lease < absl::Milliseconds(100)) {
    return absl::InvalidArgumentError("reserve_lease_ms must be >= 100");
  }
  if (o.default_timeout <= absl::ZeroDuration() || o.control_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeouts must be positive");
  }
  if (o.max_inflight < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_inflight must be >= 1, got ", o.max_inflight));
  }
  if (o.max_prefill_backlog < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("max_prefill_backlog_ms must be >= 0");
  }
  if (o.max_queue < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_queue must be >= 0, got ", o.max_queue));
  }
  if (o.kv_block_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_block_size must be >= 1, got ", o.kv_block_size));
  }
  if (o.max_migrations < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_migrations must be >= 0, got ", o.max_migrations));
  }
  if (o.prefill_retries < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_retries must be >= 0, got ", o.prefill_retries));
  }
  return absl::OkStatus();
}

struct InferenceService::Call {
  grpc::CallbackServerContext* ctx = nullptr;
  GenerateReactor* writer = nullptr;
  std::string id;
  int64_t track = 0;  // the request's trace track (trace::RequestTrack); 0 without a tracer
  PreparedRequest req;
  absl::Time arrival, admitted, deadline;
  bool relayed_any = false;  // once true, only a migration may run the request again
  std::string prefill_worker, decode_worker, transport;
  double prefill_compute_s = 0, kv_transfer_s = 0;
  uint64_t salt = 0;  // the tenant's KV salt (auth.h TenantSalt): namespaces prefix caching
  int32_t completion_tokens = 0;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  absl::Time first_token_at = absl::InfinitePast();
  absl::Time last_token_at = absl::InfinitePast();
  v1::TtftBreakdown ttft;  // as sent with the first token; repeated on the final message
  double onboard_s = 0;    // the prefill worker's prefix onboarding time, and where from
  std::string onboard_tier;
  int32_t onboarded_tokens = 0;
  // The last handoff: prompt KV bytes prefill sent, and prompt tokens decode already held.
  uint64_t kv_transfer_bytes = 0;
  int32_t decode_held_tokens = 0;
  // Migration state. sent_tokens/sent_text: everything relayed to the client so far.
  std::vector<int32_t> sent_tokens;
  std::string sent_text;
  bool attempt_relayed = false;  // the current attempt (first run or a migration) relayed
  int migrations = 0;
  // Failed prefills / KV transfers so far, against RouterOptions::prefill_retries; once past
  // it the request fails and nothing retries it.
  int prefill_failures = 0;
  bool retries_exhausted = false;
  std::string decode_address;              // of c.decode_worker
  TtftPrediction predicted;  // at arrival (slo.h)
  bool in_transit = false;   // admitted, prefill not yet started (InferenceService::Arrived)
  absl::flat_hash_set<std::string> avoid;  // workers that failed this request: not picked again
  absl::flat_hash_map<std::string, std::string> avoided_why;  // worker -> how it failed

  void Avoid(const std::string& worker, const absl::Status& why) {
    avoid.insert(worker);
    avoided_why[worker] = why.ToString();
  }
  // "No worker of the pool is left", with what took the workers that failed this request out
  // of it: the cause, not only its consequence, reaches the client.
  absl::Status NoneLeft(const char* pool) const {
    std::string msg = absl::StrCat("no ", pool, " worker available");
    if (!avoided_why.empty()) {
      std::vector<std::string> parts;
      for (const auto& [w, why] : avoided_why) parts.push_back(absl::StrCat(w, ": ", why));
      std::sort(parts.begin(), parts.end());
      absl::StrAppend(&msg, " (passed over after failing this request: ",
                      absl::StrJoin(parts, "; "), ")");
    }
    return absl::UnavailableError(msg);
  }
  std::unique_ptr<RouterText> text;        // set by the first migration: the router's text

  bool Cancelled() const { return ctx->IsCancelled(); }
  // What the current attempt sends the workers: the request as received or, after a
  // migration, its prompt extended by the tokens already sent and max_tokens reduced by their
  // number. Stop strings are then the router's to find (RouterText), across the break too.
  std::vector<int32_t> WorkPrompt() const {
    std::vector<int32_t> p = req.prompt;
    p.insert(p.end(), sent_tokens.begin(), sent_tokens.end());
    return p;
  }
  v1::SamplingParams WorkSampling() const {
    v1::SamplingParams s = req.sampling;
    if (migrations > 0) {
      s.set_max_tokens(req.engine_sampling.max_tokens - static_cast<int32_t>(sent_tokens.size()));
      s.clear_stop();
      // The tokens sent so far were generated under the format: the next worker's matcher
      // starts after them (they end its prompt).
      if (s.response_format().format_case() != v1::ResponseFormat::FORMAT_NOT_SET) {
        s.mutable_response_format()->set_generated(s.response_format().generated() +
                                                   static_cast<int32_t>(sent_tokens.size()));
      }
    }
    return s;
  }
  int32_t WorkMaxTokens() const {
    return req.engine_sampling.max_tokens - static_cast<int32_t>(sent_tokens.size());
  }
  // Whether a failed hop should move on to another worker: the worker is down, full or slow,
  // and the request itself still has time.
  bool RetryOnAnother(const absl::Status& st) const {
    if (Cancelled() || absl::Now() >= deadline) return false;
    return st.code() == absl::StatusCode::kUnavailable ||
           st.code() == absl::StatusCode::kResourceExhausted ||
           st.code() == absl::StatusCode::kDeadlineExceeded;
  }
};

InferenceService::InferenceService(const ModelHolder* models, WorkerRegistry* registry,
                                   Admission* admission, WorkerChannels* channels,
                                   const RouterOptions& o, RouterMetrics* metrics)
    : models_(models),
      registry_(registry),
      admission_(admission),
      channels_(channels),
      metrics_(metrics),
      o_(o),
      id_salt_(std::random_device{}()),
      tenant_salt_(TenantSalt("", o.tenant)),
      prefix_index_(o.prefix_index) {
  if (o_.max_prefill_backlog > absl::ZeroDuration()) {
    admission_->SetGate([this](int in_transit) { return GateOpen(in_transit); });
  }
}

absl::Status InferenceService::Prepare(const v1::GenerateRequest& req,
                                       const TenantDefaults& defaults,
                                       PreparedRequest* out) const {
  if (model() == nullptr) return ModelHolder::NotYetKnown();
  // The rules live in request_validation.h, shared with the fuzz targets.
  TANDEM_RETURN_IF_ERROR(ValidateGenerateRequest(req, *model(), RequestLimits{}, &out->prompt,
                                                 &out->engine_sampling));
  const int64_t need = static_cast<int64_t>(out->prompt.size()) + out->engine_sampling.max_tokens;
  out->sampling = services::SamplingToProto(out->engine_sampling);
  out->kv_blocks = (need + o_.kv_block_size - 1) / o_.kv_block_size;
  // The tenant's defaults fill what the request leaves unset (checked when the keys were read).
  v1::Priority priority = req.priority();
  if (priority == v1::PRIORITY_UNSPECIFIED && !defaults.priority.empty()) {
    priority = *services::PriorityFromName(defaults.priority);
  }
  switch (priority) {
    case v1::PRIORITY_UNSPECIFIED:
    case v1::PRIORITY_STANDARD:
      out->priority = Priority::kStandard;
      break;
    case v1::PRIORITY_INTERACTIVE:
      out->priority = Priority::kInteractive;
      break;
    case v1::PRIORITY_BATCH:
      out->priority = Priority::kBatch;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "priority: unknown value ", static_cast<int>(req.priority()),
          " (PRIORITY_INTERACTIVE, PRIORITY_STANDARD or PRIORITY_BATCH)"));
  }
  out->ttft_target = absl::Milliseconds(req.ttft_target_ms() > 0 ? req.ttft_target_ms()
                                                                 : defaults.ttft_target_ms);
  out->tpot_target = absl::Milliseconds(req.tpot_target_ms() > 0 ? req.tpot_target_ms()
                                                                 : defaults.tpot_target_ms);
  if (req.session_id().size() > kMaxSessionIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("session_id has ", req.session_id().size(),
                                                   " bytes; at most ", kMaxSessionIdBytes));
  }
  out->session_id = req.session_id();
  return absl::OkStatus();
}

Pool InferenceService::PrefillPool() const {
  return registry_->Plan() == PlanKind::kColocated ? Pool::kColocated : Pool::kPrefill;
}

bool InferenceService::GateOpen(int in_transit) const {
  const double bound_s = absl::ToDoubleSeconds(o_.max_prefill_backlog);
  const std::vector<WorkerRegistry::Load> loads = registry_->Loads(PrefillPool());
  // No worker at all: let the request through to fail (or wait) in routing, as without a gate.
  if (loads.empty()) return true;
  int under = 0;
  for (const WorkerRegistry::Load& l : loads) {
    under += BacklogSeconds(l) < bound_s ? 1 : 0;  // unfitted: 0 s, so under
  }
  // Every worker over the bound: closed until one's backlog drains (it always does: a
  // backlog ends when its prefill returns).
  return in_transit < under;
}

void InferenceService::Arrived(Call& c) {
  if (!c.in_transit) return;
  c.in_transit = false;
  admission_->Arrived();
}

TtftPrediction InferenceService::PredictTtft(Priority priority, int64_t tokens) const {
  return router::PredictTtft(registry_->Loads(PrefillPool()), admission_->tokens_ahead(priority),
                             admission_->waiting_ahead(priority), tokens,
                             slo_[static_cast<int>(priority)].correction_s());
}

std::string InferenceService::NewRequestId() {
  return absl::StrFormat("rt-%08x-%d", static_cast<uint32_t>(id_salt_), next_id_.fetch_add(1));
}

bool InferenceService::ClaimId(const std::string& id) {
  absl::MutexLock lock(&ids_mu_);
  return active_ids_.insert(id).second;
}

void InferenceService::ReleaseId(const std::string& id) {
  absl::MutexLock lock(&ids_mu_);
  active_ids_.erase(id);
}

grpc::ServerWriteReactor<v1::GenerateResponse>* InferenceService::Generate(
    grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req) {
  active_++;  // until the reactor's OnDone
  auto* r = new GenerateReactor(&active_);
  // Runs here until its first wait; gRPC holds what the reactor does before it is returned.
  Spawn(Drive(r, ctx, req));
  return r;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* InferenceService::Chat(
    grpc::CallbackServerContext* ctx, const v1::ChatRequest* req) {
  active_++;  // until the reactor's OnDone
  auto* r = new GenerateReactor(&active_);
  absl::StatusOr<v1::GenerateRequest> g = RenderChat(*req, &r->tools());
  if (!g.ok()) {
    failed_++;
    r->Finish(services::ToGrpcStatus(g.status()));
    return r;
  }
  r->owned_request() = std::move(*g);
  Spawn(Drive(r, ctx, &r->owned_request()));
  return r;
}

namespace {

// A Chat request's tools and tool_choice as the chat API's JSON takes them.
absl::StatusOr<nlohmann::ordered_json> ToolsJson(const v1::ChatRequest& req) {
  using json = nlohmann::ordered_json;
  json tools = json::array();
  for (int i = 0; i < req.tools_size(); ++i) {
    const v1::Tool& t = req.tools(i);
    json fn = {{"name", t.name()}};
    if (!t.description().empty()) fn["description"] = t.description();
    if (!t.parameters().empty()) {
      const std::string p = absl::StrCat("tools[", i, "].parameters");
      if (t.parameters().size() > engine::kMaxSchemaBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat(p, " is ", t.parameters().size(), " bytes; at most ",
                         engine::kMaxSchemaBytes));
      }
      if (NestingOf(t.parameters()) > kMaxJsonNesting) {
        return absl::InvalidArgumentError(
            absl::StrCat(p, " nests deeper than ", kMaxJsonNesting, " levels"));
      }
      json params = json::parse(t.parameters(), nullptr, /*allow_exceptions=*/false);
      if (params.is_discarded()) {
        return absl::InvalidArgumentError(absl::StrCat(p, " is not valid JSON"));
      }
      fn["parameters"] = std::move(params);
    }
    tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
  }
  json body = {{"tools", std::move(tools)}};
  const std::string& c = req.tool_choice();
  if (c == "auto" || c == "none" || c == "required") {
    body["tool_choice"] = c;
  } else if (!c.empty()) {
    body["tool_choice"] = {{"type", "function"}, {"function", {{"name", c}}}};
  }
  return body;
}

}  // namespace

absl::StatusOr<v1::GenerateRequest> InferenceService::RenderChat(const v1::ChatRequest& req,
                                                                 OpenAiRequest* tools) const {
  if (model() == nullptr || models_->chat() == nullptr) return ModelHolder::NotYetKnown();
  if (req.messages().empty()) return absl::InvalidArgumentError("messages must not be empty");
  if (static_cast<size_t>(req.messages_size()) > kMaxChatMessages) {
    return absl::InvalidArgumentError(absl::StrCat(
        "messages holds ", req.messages_size(), " messages; at most ", kMaxChatMessages));
  }
  std::vector<ChatMessage> messages;
  for (const v1::ChatMessage& m : req.messages()) {
    ChatMessage c{m.role(), m.content(), {}, m.tool_call_id()};
    for (const v1::ToolCall& t : m.tool_calls()) {
      c.tool_calls.push_back({t.id(), t.name(), t.arguments()});
    }
    messages.push_back(std::move(c));
  }
  v1::GenerateRequest g;
  *g.mutable_sampling() = req.sampling();
  std::vector<std::string> specs;
  if (req.tools_size() > 0 || !req.tool_choice().empty()) {
    absl::StatusOr<nlohmann::ordered_json> body = ToolsJson(req);
    if (!body.ok()) return body.status();
    tools->kind = ApiKind::kChat;
    if (std::optional<HttpError> e =
            ParseChatTools(*body, tools, &specs, g.mutable_sampling())) {
      return absl::InvalidArgumentError(e->message);
    }
  }
  absl::StatusOr<std::string> text = models_->chat()->Render(
      messages, !req.has_add_generation_prompt() || req.add_generation_prompt(), specs);
  if (!text.ok()) return text.status();
  g.set_request_id(req.request_id());
  g.set_model(req.model());
  g.set_text(*text);
  for (const std::string& s : models_->chat()->extra_stop_strings()) {
    g.mutable_sampling()->add_stop(s);
  }
  if (!req.sampling().has_max_tokens()) {
    // As the HTTP API: what the context leaves (at least 1, so an over-long prompt gets the
    // context error).
    const int64_t n = static_cast<int64_t>(
        model()->tokenizer().Encode(*text, /*add_special=*/true, /*parse_special=*/true).size());
    g.mutable_sampling()->set_max_tokens(
        static_cast<int32_t>(std::max<int64_t>(1, model()->ctx_size() - n)));
  }
  g.set_priority(req.priority());
  g.set_ttft_target_ms(req.ttft_target_ms());
  g.set_tpot_target_ms(req.tpot_target_ms());
  g.set_session_id(req.session_id());
  return g;
}

Task<void> InferenceService::Drive(GenerateReactor* r, grpc::CallbackServerContext* ctx,
                                   const v1::GenerateRequest* req) {
  const absl::Status st = co_await Serve(r, ctx, *req);
  // The request's last step: gRPC may delete the reactor from here on.
  r->Finish(services::ToGrpcStatus(st));
}

Task<absl::Status> InferenceService::Serve(GenerateReactor* r, grpc::CallbackServerContext* ctx,
                                           const v1::GenerateRequest& request) {
  const v1::GenerateRequest* req = &request;
  if (draining_) co_return absl::UnavailableError("the router is shutting down");
  uint64_t salt = tenant_salt_;
  TenantDefaults defaults;
  if (o_.auth != nullptr) {  // API key and the tenant's rate limit (auth.h)
    absl::StatusOr<std::string> tenant = o_.auth->AuthorizeCall(ctx);
    if (!tenant.ok()) {
      failed_++;
      co_return tenant.status();
    }
    salt = o_.auth->SaltFor(*tenant);
    defaults = o_.auth->DefaultsFor(*tenant);
  }
  Call c;
  c.salt = salt;
  c.ctx = ctx;
  c.writer = r;
  c.arrival = absl::Now();
  c.deadline =
      std::min(services::FromChronoDeadline(ctx->deadline()), c.arrival + o_.default_timeout);
  if (absl::Status st = Prepare(*req, defaults, &c.req); !st.ok()) {
    failed_++;
    co_return st;
  }
  c.id = req->request_id().empty() ? NewRequestId() : req->request_id();
  if (!ClaimId(c.id)) {
    failed_++;
    co_return absl::AlreadyExistsError(absl::StrCat("request_id '", c.id, "' is already in flight"));
  }
  // The request's spans go on a track of its own: its task hops between gRPC's threads, which
  // other requests' tasks share.
  if (o_.tracer != nullptr) {
    c.track = trace::RequestTrack(c.id);
    o_.tracer->NameThread(absl::StrCat("request ", c.id), c.track);
  }
  trace::Span span(o_.tracer, "Generate", "rpc", c.id, c.track);
  absl::Status result;
  // SLO admission (slo.h): a request that would miss its TTFT target is refused now, while the
  // client can still go elsewhere or come back, rather than after it has waited to miss.
  c.predicted = PredictTtft(c.req.priority, static_cast<int64_t>(c.req.prompt.size()));
  const double target_s = absl::ToDoubleSeconds(c.req.ttft_target);
  if (c.predicted.known) span.Arg("predicted_ttft_ms", c.predicted.seconds * 1e3);
  if (target_s > 0 && c.predicted.known && c.predicted.seconds > target_s) {
    slo_rejected_++;
    if (metrics_ != nullptr) metrics_->RecordSloRejected(PriorityName(c.req.priority));
    // Come back when the backlog ahead should have drained by the shortfall.
    const int retry_s = std::max(1, static_cast<int>(std::ceil(c.predicted.seconds - target_s)));
    ctx->AddTrailingMetadata("retry-after", std::to_string(retry_s));
    result = absl::ResourceExhaustedError(absl::StrFormat(
        "predicted time to first token %.0f ms is past the request's target %.0f ms (%.0f ms of "
        "prefill work ahead of it, %.0f ms its own)",
        c.predicted.seconds * 1e3, target_s * 1e3, c.predicted.backlog_s * 1e3,
        c.predicted.own_s * 1e3));
  } else {
    const int64_t queued_from = trace::Tracer::NowMicros();
    // Once admitted, a request still has ahead of it up to the backlog bound on the worker, its
    // own prefill and the correction. Queued past arrival + target - that, it can no longer make
    // its target: it leaves then, as it would have been refused had the router known (urgent
    // arrivals overtake it).
    const double after_admission_s =
        c.predicted.own_s + absl::ToDoubleSeconds(o_.max_prefill_backlog) +
        std::max(0.0, c.predicted.seconds - c.predicted.backlog_s - c.predicted.own_s);
    const absl::Time give_up = target_s > 0 && c.predicted.known
                                   ? c.arrival + absl::Seconds(target_s - after_admission_s)
                                   : absl::InfiniteFuture();
    Admission::Request wait;
    wait.deadline = c.deadline;
    wait.cancelled = [ctx] { return ctx->IsCancelled(); };
    wait.priority = c.req.priority;
    wait.tokens = static_cast<int64_t>(c.req.prompt.size());
    wait.give_up = give_up;
    absl::StatusOr<Slot> slot = co_await AdmissionWait(admission_, std::move(wait));
    if (o_.tracer != nullptr) {
      o_.tracer->Complete("admission", "router", queued_from, trace::Tracer::NowMicros(),
                          {{"request_id", c.id}, {"priority", PriorityName(c.req.priority)}},
                          c.track);
    }
    if (!slot.ok()) {
      result = slot.status();
      if (absl::IsResourceExhausted(result) && absl::Now() >= give_up) {
        slo_rejected_++;
        if (metrics_ != nullptr) metrics_->RecordSloRejected(PriorityName(c.req.priority));
      }
      // Full: say when to come back, as the rate limiter does (the HTTP front door turns it into
      // a Retry-After header). A queue slot turns over within about a request's time.
      if (absl::IsResourceExhausted(result)) ctx->AddTrailingMetadata("retry-after", "1");
    } else {
      c.admitted = absl::Now();
      if (metrics_ != nullptr) metrics_->RecordAdmitted(c.admitted - c.arrival);
      c.in_transit = true;
      result = co_await Route(c);
      Arrived(c);
    }
  }
  ReleaseId(c.id);
  (result.ok() ? ok_ : failed_)++;
  if (metrics_ != nullptr) {
    const char* reason = result.ok() ? FinishReasonLabel(c.finish)
                         : (ctx->IsCancelled() || result.code() == absl::StatusCode::kCancelled)
                             ? "cancelled"
                             : "error";
    metrics_->RecordEnd(absl::Now() - c.arrival, reason, static_cast<int>(c.req.prompt.size()),
                        c.completion_tokens);
  }
  if (span.on()) {
    span.Arg("prompt_tokens", c.req.prompt.size());
    span.Arg("completion_tokens", c.completion_tokens);
    span.Arg("prefill_worker", c.prefill_worker);
    span.Arg("decode_worker", c.decode_worker);
    span.Arg("migrations", c.migrations);
    span.Arg("status", result.ToString());
  }
  if (o_.verbose || !result.ok()) {
    Logf("%s prompt=%zu completion=%d prefill=%s decode=%s finish=%s migrations=%d %.1f ms: %s",
         c.id.c_str(), c.req.prompt.size(), c.completion_tokens, c.prefill_worker.c_str(),
         c.decode_worker.c_str(), FinishName(c.finish), c.migrations,
         absl::ToDoubleMilliseconds(absl::Now() - c.arrival), result.ToString().c_str());
  }
  co_return result;
}

Task<absl::Status> InferenceService::Route(Call& c) {
  absl::Time retry_until = std::min(c.deadline, absl::Now() + o_.retry_budget);
  absl::Duration backoff = absl::Milliseconds(10);
  int unavailable_rounds = 0;
  absl::Time regroup_until = absl::InfiniteFuture();  // how long a moving stream waits for workers
  while (true) {
    absl::Status st;
    c.attempt_relayed = false;
    const PlanKind plan = registry_->Plan();
    switch (plan) {
      case PlanKind::kDisaggregated:
        st = co_await RunDisaggregated(c);
        break;
      case PlanKind::kColocated:
        st = co_await RunColocated(c);
        break;
      case PlanKind::kNone:
        st = absl::UnavailableError(absl::StrCat(
            "no worker can serve the request: the router needs a prefill and a decode worker, "
            "or a colocated one (",
            registry_->size(), " registered, counting draining ones)"));
        break;
    }
    if (st.ok()) co_return st;
    if (c.Cancelled()) co_return CancelledByClient();
    if (c.attempt_relayed) {
      // The stream broke after tokens went out: move it, or fail it.
      if (!co_await StartMigration(c, st)) co_return st;
      retry_until = std::min(c.deadline, absl::Now() + o_.retry_budget);
      backoff = absl::Milliseconds(10);
      unavailable_rounds = 0;
      regroup_until = absl::InfiniteFuture();
      continue;
    }
    if (c.retries_exhausted) co_return st;  // the prefill retry policy said fail
    // Full pools are worth waiting for; vanished workers get a couple more tries (the
    // registry drops them within a lease); anything else is final.
    const bool full = st.code() == absl::StatusCode::kResourceExhausted;
    const bool gone = plan != PlanKind::kNone && st.code() == absl::StatusCode::kUnavailable &&
                      ++unavailable_rounds < 3;
    // No worker left to take it (none registered, or only those it already failed on): a fresh
    // request fails now, but a stream that is moving (its client already has tokens) keeps
    // trying for up to a lease, the time in which workers the router dropped register again.
    const bool unavailable = st.code() == absl::StatusCode::kUnavailable;
    if (unavailable && c.migrations > 0 && regroup_until == absl::InfiniteFuture()) {
      regroup_until = absl::Now() + o_.worker_lease;
    }
    const bool regrouping = unavailable && c.migrations > 0 && absl::Now() < regroup_until;
    if (!full && !gone && !regrouping) co_return st;
    if (absl::Now() + backoff >= retry_until) co_return st;
    for (absl::Time until = absl::Now() + backoff; absl::Now() < until;) {
      if (c.Cancelled()) co_return CancelledByClient();
      co_await services::SleepUntil(std::min(until, absl::Now() + absl::Milliseconds(20)));
    }
    backoff = std::min(backoff * 2, absl::Milliseconds(200));
  }
}

Assignment InferenceService::PickForSession(Pool pool, const Call& c,
                                            const absl::flat_hash_set<std::string>& exclude) {
  if (c.req.session_id.empty()) return registry_->Pick(pool, c.req.kv_blocks, exclude);
  // Rendezvous hashing: every router (replicas, restarts) sends a session to the same worker
  // while it serves, and to the same next one when it does not; a worker joining or leaving
  // moves only the sessions it wins or held.
  const std::string& session = c.req.session_id;
  return registry_->PickScored(pool, c.req.kv_blocks, exclude,
                               [&session](const std::string& id, double /*load*/) {
                                 return static_cast<double>(SessionWeight(session, id));
                               });
}

Task<absl::Status> InferenceService::RunDisaggregated(Call& c) {
  const std::vector<int32_t> prompt = c.WorkPrompt();
  const v1::SamplingParams sampling = c.WorkSampling();
  // KV-aware choice: the prompt's block hashes as the workers compute them (their block size,
  // the tenant's salt), scored against the prefix index.
  std::vector<uint64_t> hashes;
  absl::flat_hash_set<std::string> prefill_tried = c.avoid;
  // Prefill workers whose failure was their destination's (the KV could not reach the decode
  // worker): tried again once no other prefill worker is left.
  absl::flat_hash_set<std::string> blameless;
  absl::Status last;
  Assignment d;
  v1::ReserveResponse reserve;
  v1::PrefillResponse pr;
  // A prefill that may have written part of the KV before failing spoils its reservation (a
  // write of a worker we only believe dead could still land): the reservation is released to
  // the decode worker's quarantine and the handoff starts again on fresh blocks.
  constexpr int kHandoffRounds = 3;
  absl::Status spoiled_by;  // what ended the last round's handoff
  for (int round = 0;; ++round) {
    // 1. Reserve KV on a decode worker.
    absl::flat_hash_set<std::string> tried = c.avoid;
    last = c.NoneLeft("decode");
    while (true) {
      d = PickForSession(Pool::kDecode, c, tried);
      if (!d) co_return last;
      tried.insert(d.worker_id());
      v1::ReserveRequest rq;
      rq.set_request_id(c.id);
      rq.set_prompt_tokens(static_cast<int32_t>(prompt.size()));
      // For the decode worker's prefix cache: what of the prompt it already holds.
      rq.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
      rq.set_salt(c.salt);
      rq.set_max_tokens(c.WorkMaxTokens());
      rq.set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(o_.reserve_lease)));
      rq.set_tpot_target_s(absl::ToDoubleSeconds(c.req.tpot_target));
      auto cc = Child(*c.ctx, std::min(c.deadline, absl::Now() + o_.control_timeout));
      auto stub = v1::DecodeWorker::NewStub(channels_->Get(d.address()));
      reserve.Clear();
      trace::Span call(o_.tracer, "call Reserve", "rpc", c.id, c.track);
      call.Arg("worker", d.worker_id());
      const grpc::Status gs = co_await services::Unary([&](auto done) {
        stub->async()->Reserve(cc.get(), &rq, &reserve, std::move(done));
      });
      call.Arg("code", static_cast<int>(gs.error_code()));
      if (gs.ok()) break;
      const absl::Status st = Prefixed(services::FromGrpcStatus(gs),
                                       absl::StrCat("decode worker ", d.worker_id(), " Reserve: "));
      // A Reserve that timed out or was cut off may still have reserved: undo it.
      if (gs.error_code() != grpc::StatusCode::UNAVAILABLE &&
          gs.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
        co_await CancelOnDecode(d.address(), c.id);
      }
      if (gs.error_code() == grpc::StatusCode::UNAVAILABLE) c.Avoid(d.worker_id(), st);
      if (c.Cancelled()) co_return CancelledByClient();
      if (!c.RetryOnAnother(st)) co_return st;
      last = st;
    }
    c.decode_worker = d.worker_id();
    c.decode_address = d.address();

    // 2. Prefill on a prefill worker, which writes the KV into the reservation.
    // A handoff that starts again keeps what spoiled the last one: when no prefill worker is
    // left to try, that is the cause the client needs, not only its consequence.
    last = c.NoneLeft("prefill");
    if (!spoiled_by.ok()) {
      last = absl::Status(last.code(), absl::StrCat(last.message(), "; the last attempt: ",
                                                    spoiled_by.ToString()));
    }
    if (o_.policy == Policy::kKvAware && hashes.empty()) {
      const int32_t bs = reserve.destination().block_size() > 0 ? reserve.destination().block_size()
                                                                : o_.kv_block_size;
      hashes = engine::ComputeBlockHashes(prompt, bs, c.salt);
    }
    bool spoiled = false;
    while (true) {
      Assignment p = o_.policy == Policy::kKvAware
                         ? registry_->PickScored(Pool::kPrefill, 0, prefill_tried,
                                                 [&](const std::string& id, double load) {
                                                   return prefix_index_.Score({id, load}, hashes);
                                                 })
                         : registry_->Pick(Pool::kPrefill, 0, prefill_tried);
      if (!p && !blameless.empty()) {
        for (const std::string& w : blameless) prefill_tried.erase(w);
        blameless.clear();
        continue;
      }
      if (!p) {
        co_await CancelOnDecode(d.address(), c.id);
        co_return last;
      }
      prefill_tried.insert(p.worker_id());
      v1::PrefillRequest preq;
      preq.set_request_id(c.id);
      preq.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
      *preq.mutable_sampling() = sampling;
      *preq.mutable_destination() = reserve.destination();
      preq.set_salt(c.salt);
      auto cc = Child(*c.ctx, c.deadline);
      auto stub = v1::PrefillWorker::NewStub(channels_->Get(p.address()));
      pr.Clear();
      // The request's flow starts here and runs on through the prefill and decode workers.
      trace::Span call(o_.tracer, "call Prefill", "rpc", c.id, c.track);
      call.Flow('s');
      call.Arg("worker", p.worker_id());
      p.StartBacklog(static_cast<int64_t>(prompt.size()));
      Arrived(c);
      const grpc::Status gs = co_await services::Unary([&](auto done) {
        stub->async()->Prefill(cc.get(), &preq, &pr, std::move(done));
      });
      p.EndBacklog();
      admission_->Kick();  // the backlog shrank: a held request may go
      call.Arg("code", static_cast<int>(gs.error_code()));
      if (gs.ok()) {
        c.prefill_worker = p.worker_id();
        if (o_.policy == Policy::kKvAware) {  // no other policy reads the index
          const std::span<const uint64_t> held(pr.cached_block_hashes().data(),
                                               pr.cached_block_hashes().size());
          prefix_index_.RecordWorker(p.worker_id(), held);
          if (pr.published_blocks() > 0 || pr.kvstore_tokens() > 0) {
            prefix_index_.RecordStore(held);
          }
        }
        break;
      }
      const absl::Status st = Prefixed(services::FromGrpcStatus(gs),
                                       absl::StrCat("prefill worker ", p.worker_id(), ": "));
      // The prefill worker says its KV could not reach the decode worker: that decode worker
      // is passed over (and this reservation given up); the prefill worker is not blamed.
      const auto& trailers = cc->GetServerTrailingMetadata();
      const auto fault = trailers.find(services::kFaultKey);
      const bool destination_fault = fault != trailers.end() &&
                                     std::string_view(fault->second.data(), fault->second.size()) ==
                                         services::kFaultDestination;
      if (destination_fault) {
        c.Avoid(d.worker_id(), st);
        blameless.insert(p.worker_id());
        if (c.Cancelled()) {
          co_await CancelOnDecode(d.address(), c.id);
          co_return CancelledByClient();
        }
        last = st;
        spoiled = true;
        break;
      }
      if (gs.error_code() != grpc::StatusCode::UNAVAILABLE) {
        co_await CancelOnPrefill(p.address(), c.id);
      }
      if (gs.error_code() == grpc::StatusCode::UNAVAILABLE) c.Avoid(p.worker_id(), st);
      if (c.Cancelled()) {
        co_await CancelOnDecode(d.address(), c.id);
        co_return CancelledByClient();
      }
      if (++c.prefill_failures > o_.prefill_retries) c.retries_exhausted = true;
      if (!c.RetryOnAnother(st) || c.retries_exhausted) {
        co_await CancelOnDecode(d.address(), c.id);
        co_return st;
      }
      last = st;
      // Back off before the next worker: what broke one (a restarting node, a saturated link)
      // often touches its neighbours for a moment. Bounded by the deadline and cancellable.
      const absl::Time until =
          std::min(c.deadline, absl::Now() + std::min(absl::Milliseconds(10 << c.prefill_failures),
                                                      absl::Milliseconds(200)));
      while (absl::Now() < until && !c.Cancelled()) {
        co_await services::SleepUntil(std::min(until, absl::Now() + absl::Milliseconds(10)));
      }
      if (!PrefillNeverStarted(gs)) {
        spoiled = true;
        break;
      }
      // Nothing was written: the reservation (it has a lease) serves the next prefill worker.
    }
    if (!spoiled) break;
    spoiled_by = last;
    co_await CancelOnDecode(d.address(), c.id);
    if (o_.verbose) {
      Logf("%s: %s; released the reservation on %s, starting the handoff again", c.id.c_str(),
           last.ToString().c_str(), d.worker_id().c_str());
    }
    if (round + 1 >= kHandoffRounds) co_return last;
  }
  c.prefill_compute_s = pr.compute_seconds();
  c.kv_transfer_s = pr.transfer_seconds();
  c.transport = pr.transport();
  c.onboard_s = pr.onboard_seconds();
  c.onboard_tier = pr.onboard_tier();
  c.onboarded_tokens = pr.onboarded_tokens();
  c.kv_transfer_bytes = pr.bytes_transferred();
  c.decode_held_tokens = reserve.destination().held_blocks() * reserve.destination().block_size();
  if (metrics_ != nullptr) {
    metrics_->RecordPrefill(static_cast<int>(prompt.size()), pr.compute_seconds());
    metrics_->RecordHandoff(!c.req.session_id.empty(), c.decode_held_tokens,
                            pr.bytes_transferred());
  }

  // 3. Decode, relaying the stream.
  v1::DecodeRequest dreq;
  dreq.set_request_id(c.id);
  dreq.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
  *dreq.mutable_sampling() = sampling;
  dreq.set_first_token_id(pr.first_token_id());
  dreq.set_salt(c.salt);
  if (pr.has_first_token_logprobs()) {
    *dreq.mutable_first_token_logprobs() = pr.first_token_logprobs();
  }
  *dreq.mutable_block_checksums() = pr.block_checksums();
  *dreq.mutable_draft_block_checksums() = pr.draft_block_checksums();
  // For the decode worker's kv_transfer_* series.
  dreq.set_kv_transfer_bytes(pr.bytes_transferred());
  dreq.set_kv_transfer_seconds(pr.transfer_seconds());
  const absl::Status st = co_await RelayDecode(c, d, dreq);
  if (!st.ok() && !c.attempt_relayed && !c.Cancelled()) {
    if (st.code() == absl::StatusCode::kUnavailable) c.Avoid(d.worker_id(), st);
    co_await CancelOnDecode(d.address(), c.id);
  }
  co_return st;
}

Task<absl::Status> InferenceService::RunColocated(Call& c) {
  absl::flat_hash_set<std::string> tried = c.avoid;
  absl::Status last = c.NoneLeft("colocated");
  const std::vector<int32_t> prompt = c.WorkPrompt();
  const v1::SamplingParams sampling = c.WorkSampling();
  while (true) {
    Assignment w = PickForSession(Pool::kColocated, c, tried);
    if (!w) co_return last;
    tried.insert(w.worker_id());
    c.prefill_worker = c.decode_worker = w.worker_id();
    c.decode_address = w.address();
    w.StartBacklog(static_cast<int64_t>(prompt.size()));  // until its first token
    Arrived(c);
    v1::DecodeRequest dreq;
    dreq.set_request_id(c.id);
    dreq.set_salt(c.salt);
    dreq.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
    *dreq.mutable_sampling() = sampling;
    dreq.set_prefill_locally(true);
    dreq.set_tpot_target_s(absl::ToDoubleSeconds(c.req.tpot_target));
    const absl::Status st = co_await RelayDecode(c, w, dreq);
    if (st.ok() || c.attempt_relayed || !c.RetryOnAnother(st)) co_return st;
    if (st.code() == absl::StatusCode::kUnavailable) c.Avoid(w.worker_id(), st);
    last = st;
  }
}

Task<absl::Status> InferenceService::RelayDecode(Call& c, Assignment& d,
                                                 const v1::DecodeRequest& dreq) {
  auto cc = Child(*c.ctx, c.deadline);
  auto stub = v1::DecodeWorker::NewStub(channels_->Get(d.address()));
  trace::Span call(o_.tracer, "call Decode", "rpc", c.id, c.track);
  call.Arg("worker", d.worker_id());
  if (dreq.prefill_locally()) call.Flow('s');  // colocated: no prefill call started the flow
  const absl::Time sent = absl::Now();
  services::StreamReader<v1::GenerateResponse> reader;
  stub->async()->Decode(cc.get(), &dreq, &reader);
  v1::GenerateResponse msg;
  bool finished = false;
  bool client_gone = false;
  bool router_finished = false;  // the router's own stop check ended the request
  bool worker_cancelled = false;
  while (co_await reader.Read(&msg)) {
    // The worker cancelled the request itself (it is shutting down, say), not the client:
    // with a migration left, this is a broken stream, not the request's end.
    if (msg.finished() && msg.finish_reason() == v1::FINISH_REASON_CANCELLED && !c.Cancelled() &&
        c.migrations < o_.max_migrations) {
      worker_cancelled = true;
      break;
    }
    if (c.text != nullptr) {
      // Migrated: the router makes the text over the whole request (see RouterText), and ends
      // the request where its stop check says, even mid-message.
      std::string text;
      int kept = 0;
      for (; kept < msg.token_ids_size() && c.text->reason() == engine::FinishReason::kNone;
           ++kept) {
        text += c.text->Push(msg.token_ids(kept));
      }
      msg.mutable_token_ids()->Truncate(kept);
      if (msg.logprobs_size() > kept) {
        msg.mutable_logprobs()->DeleteSubrange(kept, msg.logprobs_size() - kept);
      }
      if (c.text->reason() != engine::FinishReason::kNone) {
        if (!msg.finished()) router_finished = true;
        msg.set_finished(true);
        msg.set_finish_reason(c.text->reason() == engine::FinishReason::kStop
                                  ? v1::FINISH_REASON_STOP
                                  : v1::FINISH_REASON_LENGTH);
      } else if (msg.finished()) {
        text += c.text->End();  // the worker ended it (without a token, normally)
      }
      msg.set_text(std::move(text));
    }
    msg.set_request_id(c.id);
    if (msg.prefill_worker().empty()) msg.set_prefill_worker(c.prefill_worker);
    if (msg.decode_worker().empty()) msg.set_decode_worker(c.decode_worker);
    if (!c.relayed_any) {
      const absl::Time now = absl::Now();
      c.first_token_at = now;
      d.EndBacklog();  // a colocated worker's prefill is done
      admission_->Kick();
      if (c.predicted.known) {
        slo_[static_cast<int>(c.req.priority)].Observe(
            c.predicted.backlog_s + c.predicted.own_s, absl::ToDoubleSeconds(now - c.arrival));
      }
      msg.mutable_prompt_token_ids()->Add(c.req.prompt.begin(), c.req.prompt.end());
      v1::TtftBreakdown* t = msg.mutable_ttft();
      // The worker knows its own parts best; the router fills in what it alone saw.
      if (t->queue() == 0) t->set_queue(absl::ToDoubleSeconds(c.admitted - c.arrival));
      if (t->prefill_compute() == 0) t->set_prefill_compute(c.prefill_compute_s);
      if (t->kv_transfer() == 0) t->set_kv_transfer(c.kv_transfer_s);
      if (t->first_decode_step() == 0) t->set_first_decode_step(absl::ToDoubleSeconds(now - sent));
      t->set_total(absl::ToDoubleSeconds(now - c.arrival));
      // Per-tier prefix onboarding is always present (zeros until a prefix is onboarded). The
      // prefill worker names the slowest tier its blocks came from; its own cache ("local") is
      // device memory.
      v1::PrefixOnboarding& tiers = *t->mutable_prefix_onboarding_tiers();
      if (c.onboard_s > 0 && tiers.device() + tiers.host() + tiers.ssd() == 0) {
        if (c.onboard_tier == "ssd") {
          tiers.set_ssd(c.onboard_s);
        } else if (c.onboard_tier == "host") {
          tiers.set_host(c.onboard_s);
        } else {
          tiers.set_device(c.onboard_s);
        }
      }
      if (t->prefix_onboarding() == 0) {
        t->set_prefix_onboarding(tiers.device() + tiers.host() + tiers.ssd());
      }
      c.ttft = *t;
      if (metrics_ != nullptr) metrics_->RecordFirstToken(now, now - c.arrival, *t);
      if (msg.token_ids_size() > 0) c.last_token_at = now;
    } else if (msg.token_ids_size() > 0) {
      const absl::Time now = absl::Now();
      if (metrics_ != nullptr && c.last_token_at != absl::InfinitePast()) {
        metrics_->RecordInterToken(now, now - c.last_token_at);
      }
      c.last_token_at = now;
    }
    c.completion_tokens += msg.token_ids_size();
    if (msg.finished()) {
      finished = true;
      *msg.mutable_ttft() = c.ttft;
      c.finish = msg.finish_reason();
      // Over the whole request: a migrated worker counts from its own start, and its prompt
      // holds the tokens sent before the break.
      v1::Usage* u = msg.mutable_usage();
      u->set_prompt_tokens(static_cast<int32_t>(c.req.prompt.size()));
      u->set_completion_tokens(c.completion_tokens);
      if (u->cached_prompt_tokens() == 0) u->set_cached_prompt_tokens(c.onboarded_tokens);
      u->set_kv_transfer_bytes(c.kv_transfer_bytes);
      u->set_decode_held_tokens(c.decode_held_tokens);
    }
    if (!co_await c.writer->Write(msg)) {
      client_gone = true;
      cc->TryCancel();
      break;
    }
    c.relayed_any = true;
    c.attempt_relayed = true;
    c.sent_tokens.insert(c.sent_tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    c.sent_text += msg.text();
    if (router_finished) {
      cc->TryCancel();
      break;
    }
  }
  if (worker_cancelled || router_finished) cc->TryCancel();
  const grpc::Status gs = co_await reader.Finish();
  if (router_finished) {
    co_await CancelOnDecode(d.address(), c.id);
    co_return absl::OkStatus();
  }
  if (client_gone || c.Cancelled()) {
    if (!finished) co_await CancelOnDecode(d.address(), c.id);
    co_return CancelledByClient();
  }
  if (worker_cancelled) {
    co_return absl::UnavailableError(
        absl::StrCat("decode worker ", d.worker_id(), " cancelled the request itself"));
  }
  if (!gs.ok()) {
    co_return Prefixed(services::FromGrpcStatus(gs),
                       absl::StrCat("decode worker ", d.worker_id(), ": "));
  }
  if (!finished) {
    co_return absl::InternalError(
        absl::StrCat("decode worker ", d.worker_id(), " ended the stream without a final message"));
  }
  co_return absl::OkStatus();
}

Task<bool> InferenceService::StartMigration(Call& c, absl::Status st) {
  if (c.migrations >= o_.max_migrations || !MigratableCode(st.code())) co_return false;
  if (c.Cancelled() || absl::Now() >= c.deadline) co_return false;
  const int32_t left = c.WorkMaxTokens();
  if (left < 1) co_return false;  // every token went out; only the final message was lost
  ++c.migrations;
  migrations_++;
  if (metrics_ != nullptr) metrics_->RecordMigration();
  c.Avoid(c.decode_worker, st);
  // A worker that still answers may still hold the sequence: free its blocks now.
  if (st.code() != absl::StatusCode::kUnavailable) {
    co_await CancelOnDecode(c.decode_address, c.id);
  }
  if (c.text == nullptr) {
    c.text = std::make_unique<RouterText>(model()->tokenizer(), c.req.prompt, c.req.engine_sampling);
    std::string replay;
    for (int32_t t : c.sent_tokens) replay += c.text->Push(t);
    if (replay != c.sent_text) {
      // Only if the worker's tokenizer differs from the router's; the router's text goes on.
      Logf("%s: the router's text of the %zu tokens sent differs from the worker's", c.id.c_str(),
           c.sent_tokens.size());
    }
  }
  Logf("%s: decode worker %s broke the stream after %zu tokens (%s); migration %d of at most %d",
       c.id.c_str(), c.decode_worker.c_str(), c.sent_tokens.size(), st.ToString().c_str(),
       c.migrations, o_.max_migrations);
  co_return true;
}

Task<void> InferenceService::CancelOnDecode(std::string address, std::string request_id) {
  grpc::ClientContext cc;  // not a child: the request's own context may be cancelled already
  cc.set_deadline(services::ToChronoDeadline(absl::Now() + o_.control_timeout));
  v1::CancelRequest rq;
  rq.set_request_id(request_id);
  v1::CancelResponse resp;
  auto stub = v1::DecodeWorker::NewStub(channels_->Get(address));
  const grpc::Status gs = co_await services::Unary(
      [&](auto done) { stub->async()->Cancel(&cc, &rq, &resp, std::move(done)); });
  if (!gs.ok() && o_.verbose) {
    Logf("%s: Cancel on decode %s failed: %s", request_id.c_str(), address.c_str(),
         gs.error_message().c_str());
  }
}

Task<void> InferenceService::CancelOnPrefill(std::string address, std::string request_id) {
  grpc::ClientContext cc;
  cc.set_deadline(services::ToChronoDeadline(absl::Now() + o_.control_timeout));
  v1::CancelRequest rq;
  rq.set_request_id(request_id);
  v1::CancelResponse resp;
  auto stub = v1::PrefillWorker::NewStub(channels_->Get(address));
  const grpc::Status gs = co_await services::Unary(
      [&](auto done) { stub->async()->Cancel(&cc, &rq, &resp, std::move(done)); });
  if (!gs.ok() && o_.verbose) {
    Logf("%s: Cancel on prefill %s failed: %s", request_id.c_str(), address.c_str(),
         gs.error_message().c_str());
  }
}

grpc::Status InferenceService::Tokenize(grpc::ServerContext* ctx, const v1::TokenizeRequest* req,
                                        v1::TokenizeResponse* resp) {
  if (o_.auth != nullptr) {
    if (auto tenant = o_.auth->AuthorizeCall(ctx, /*count_rate=*/false); !tenant.ok()) {
      return services::ToGrpcStatus(tenant.status());
    }
  }
  if (model() == nullptr) return services::ToGrpcStatus(ModelHolder::NotYetKnown());
  if (!model()->Matches(req->model())) {
    return services::ToGrpcStatus(absl::NotFoundError(absl::StrCat(
        "model '", req->model(), "' is not served here; this router serves '", model()->id(), "'")));
  }
  const std::vector<int32_t> ids =
      model()->tokenizer().Encode(req->text(), req->add_special(), /*parse_special=*/true);
  resp->mutable_token_ids()->Add(ids.begin(), ids.end());
  return grpc::Status::OK;
}

grpc::Status InferenceService::ListModels(grpc::ServerContext* ctx, const v1::ListModelsRequest*,
                                          v1::ListModelsResponse* resp) {
  if (o_.auth != nullptr) {
    if (auto tenant = o_.auth->AuthorizeCall(ctx, /*count_rate=*/false); !tenant.ok()) {
      return services::ToGrpcStatus(tenant.status());
    }
  }
  if (model() == nullptr) return services::ToGrpcStatus(ModelHolder::NotYetKnown());
  v1::ModelInfo* m = resp->add_models();
  m->set_id(model()->id());
  m->set_architecture(model()->config().arch_name);
  m->set_context_length(model()->ctx_size());
  m->set_vocab_size(model()->vocab_size());
  return grpc::Status::OK;
}

grpc::Status RegistryService::Register(grpc::ServerContext*, const v1::RegisterRequest* req,
                                       v1::RegisterResponse* resp) {
  if (models_ != nullptr) {
    if (absl::Status st = models_->Admit(*req); !st.ok()) {
      Logf("register %s refused: %s", req->worker_id().c_str(), st.ToString().c_str());
      return services::ToGrpcStatus(st);
    }
  }
  if (absl::Status st = registry_->Register(*req); !st.ok()) {
    Logf("register %s refused: %s", req->worker_id().c_str(), st.ToString().c_str());
    return services::ToGrpcStatus(st);
  }
  Logf("registered %s: %s at %s, %d KV blocks", req->worker_id().c_str(),
       v1::WorkerRole_Name(req->role()).c_str(), req->address().c_str(), req->kv_blocks_total());
  resp->set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(registry_->options().lease)));
  return grpc::Status::OK;
}

grpc::Status RegistryService::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                                        v1::HeartbeatResponse* resp) {
  resp->set_known(registry_->Heartbeat(*req));
  return grpc::Status::OK;
}

grpc::Status RegistryService::Deregister(grpc::ServerContext*, const v1::DeregisterRequest* req,
                                         v1::DeregisterResponse*) {
  if (registry_->Deregister(req->worker_id())) {
    Logf("deregistered %s", req->worker_id().c_str());
  }
  return grpc::Status::OK;
}

grpc::Status RegistryService::ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                                          v1::ListWorkersResponse* resp) {
  for (v1::WorkerInfo& w : registry_->List()) *resp->add_workers() = std::move(w);
  return grpc::Status::OK;
}

}  // namespace tandem::router
