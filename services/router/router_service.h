// The router's two gRPC services.
//
// InferenceService (tandem.v1.Inference, public): validates and tokenises a request, admits it
// (bounded in-flight and queue, see admission.h), chooses workers (worker_registry.h) and drives
// the disaggregated handoff:
//   1. DecodeWorker.Reserve on the chosen decode worker -> KV destination (blocks + region);
//   2. PrefillWorker.Prefill on the chosen prefill worker, which writes the prompt's KV straight
//      into that destination over the KV transport and returns the first token and checksums;
//   3. DecodeWorker.Decode (server stream), every message relayed to the client as it comes.
// With only colocated (BOTH) workers, or either pool empty, step 3 alone goes to a colocated
// worker with prefill_locally set. Reserve and prefill failures that another worker might not
// have (UNAVAILABLE, RESOURCE_EXHAUSTED) move on to the next worker; when every pool is full the
// request waits (bounded by its deadline and retry_budget) rather than failing. A prefill that
// fails in a way another worker might not (it died mid-transfer, say) releases its reservation
// (the decode worker quarantines the blocks against late writes) and the handoff starts again
// on fresh blocks; only a prefill that provably never started (the connection was refused)
// keeps the reservation for the next prefill worker.
//
// Migration: once tokens have been relayed, a decode stream that breaks (the worker died, its
// stream was cut, it cancelled the request itself, or it failed internally; never a client
// cancel or a refused request) is moved: the router re-runs the handoff on another worker
// with prompt := original prompt + every token already relayed and max_tokens reduced by
// their number, and keeps relaying, so the client sees each token exactly once, in order, with
// usage and finish reason over the whole request. After a migration the router produces the
// text itself (a StreamingDecoder and StopChecker replayed over the tokens already sent), so a
// UTF-8 character or a stop string that straddles the break is neither dropped nor repeated,
// and stop strings are the router's to detect (they are not sent to the new worker). Greedy
// requests continue with exactly the tokens an unbroken run gives; seeded sampling continues
// with a fresh random stream (the workers take no draw offset), so it stays a valid sample
// but is not the unbroken run's. At most RouterOptions::max_migrations per request, each
// counted in tandem_migrations_total. A moving stream that finds no worker to take it (none
// registered, or only those it failed on) keeps trying for up to a worker lease, in which
// dropped workers register again, instead of failing; a fresh request fails with UNAVAILABLE.
//
// Deadlines and cancellation: every outgoing call is created from the incoming ServerContext,
// so gRPC propagates the client's deadline and cancellation to it; each also gets an explicit
// deadline (the request's, or a shorter control timeout for Reserve). When the client goes away
// the router also calls Cancel on the workers involved, so their blocks are freed at once.
//
// RegistryService (tandem.v1.Registry, internal): Register / Heartbeat / Deregister of workers
// and ListWorkers for tools and tests.
//
// Threading: Generate is a task per request, resumed on gRPC's callback threads; the other
// methods run on its sync-server threads; all share only thread-safe objects. Ownership: the services borrow everything; RouterServer owns it.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/util/task.h"
#include "engine/sampling/sampler.h"
#include "services/router/admission.h"
#include "services/router/auth.h"
#include "services/router/autoscale.h"
#include "services/router/http_openai.h"
#include "services/router/router_metrics.h"
#include "common/trace/trace.h"
#include "services/router/prefix_index.h"
#include "services/router/model_holder.h"
#include "services/router/router_model.h"
#include "services/router/slo.h"
#include "services/router/worker_channels.h"
#include "services/router/worker_registry.h"
#include "tandem/v1/inference.grpc.pb.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::router {

struct RouterOptions {
  std::string model_path;  // empty: learn the model from the first worker (model_holder.h)
  std::string model_id;    // empty: the model file's stem
  int32_t ctx_size = 0;  // 0: min(trained context, 4096), as the workers default to
  std::string host = "0.0.0.0";
  int port = 0;  // 0: any free port (see RouterServer::port())
  absl::Duration worker_lease = absl::Seconds(3);
  absl::Duration reserve_lease = absl::Seconds(30);    // asked of decode workers per Reserve
  absl::Duration default_timeout = absl::Minutes(10);  // for requests without a deadline
  absl::Duration control_timeout = absl::Seconds(5);   // Reserve and Cancel calls
  absl::Duration retry_budget = absl::Seconds(30);     // waiting for room in full pools
  int max_inflight = 256;
  int max_queue = 1024;
  // SLO admission (slo.h): while every prefilling worker's predicted backlog is longer than
  // this, requests wait in the router's priority queue instead of the worker's FIFO one. Zero: requests go to the workers as soon as they hold a slot.
  absl::Duration max_prefill_backlog = absl::ZeroDuration();
  int kv_block_size = 16;  // the workers' block size, for load accounting only
  Policy policy = Policy::kLeastLoad;
  bool verbose = false;  // a log line per request
  // API keys, tenants and rate limits (auth.h); null: no keys needed, every request is tenant
  // "". Shared with the HTTP front door.
  std::shared_ptr<Authenticator> auth;
  int max_message_bytes = 16 << 20;  // gRPC messages larger are refused (RESOURCE_EXHAUSTED)
  // Prometheus /metrics on its own port, like the workers' --metrics-port (0: none; the HTTP
  // front door serves /metrics too). SLO targets and capacities of the replica recommendation.
  int metrics_port = 0;
  AutoscaleOptions autoscale;
  // The tenant requests are served as when there is no authenticator (with one, the tenant of
  // the caller's key); its salt (auth.h TenantSalt) namespaces prefix caching, so tenants never
  // share KV blocks. "" is the unsalted namespace.
  std::string tenant;
  PrefixIndexOptions prefix_index;  // used by Policy::kKvAware
  // Times one request's broken decode stream may be moved to another worker (0: never).
  int max_migrations = 3;
  // Prefill or KV-transfer failures (worker down, transfer failed or timed out) one request may
  // retry on other prefill workers, with a short backoff, before it fails; every failure
  // releases or reuses the decode reservation, never leaks it. 0: fail on the first.
  int prefill_retries = 3;
  // Spans of every request (common/trace/trace.h); null: no trace. Not owned: outlives the
  // server.
  trace::Tracer* tracer = nullptr;
};

// INVALID_ARGUMENT naming the first bad field.
absl::Status ValidateRouterOptions(const RouterOptions& o);

// The longest GenerateRequest.session_id accepted.
inline constexpr size_t kMaxSessionIdBytes = 256;

// A session's rendezvous weight on a worker (53 bits, exact as a double): the session goes to
// the eligible worker of highest weight. Stateless, so every router replica agrees.
uint64_t SessionWeight(std::string_view session_id, std::string_view worker_id);

// A request after validation: what the workers are sent.
struct PreparedRequest {
  std::vector<int32_t> prompt;
  engine::SamplingParams engine_sampling;
  v1::SamplingParams sampling;  // as received (workers apply the same defaults)
  int64_t kv_blocks = 0;        // blocks the request will hold on its decode worker
  Priority priority = Priority::kStandard;
  absl::Duration ttft_target = absl::ZeroDuration();  // zero: none
  absl::Duration tpot_target = absl::ZeroDuration();
  // The conversation this turn belongs to (GenerateRequest.session_id); empty: none.
  std::string session_id;
};

// Generate runs on gRPC's callback API: each request is a task (common/util/task.h) that awaits
// its admission slot, its RPCs to the workers and its backoffs, so a request holds no thread
// while it waits, and relays its decode stream one message at a time (at most one message held
// per stream, whatever the speeds of the worker and the client). Tokenize and ListModels, short
// and CPU-bound, stay synchronous.
class InferenceService final
    : public v1::Inference::WithCallbackMethod_Generate<
          v1::Inference::WithCallbackMethod_Chat<v1::Inference::Service>> {
 public:
  // `metrics` (may be null: nothing recorded) must outlive the service.
  // Every call answers UNAVAILABLE while `models` knows no model yet (model_holder.h).
  InferenceService(const ModelHolder* models, WorkerRegistry* registry, Admission* admission,
                   WorkerChannels* channels, const RouterOptions& o,
                   RouterMetrics* metrics = nullptr);

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req) override;
  // Renders the messages with the model's chat template, then serves it as Generate.
  grpc::ServerWriteReactor<v1::GenerateResponse>* Chat(grpc::CallbackServerContext* ctx,
                                                       const v1::ChatRequest* req) override;
  grpc::Status Tokenize(grpc::ServerContext* ctx, const v1::TokenizeRequest* req,
                        v1::TokenizeResponse* resp) override;
  grpc::Status ListModels(grpc::ServerContext* ctx, const v1::ListModelsRequest* req,
                          v1::ListModelsResponse* resp) override;

  // Validation and tokenisation alone (INVALID_ARGUMENT naming the field, NOT_FOUND for
  // another model, UNAVAILABLE before the model is known), with the tenant's defaults where the
  // request leaves priority or targets unset. Public for tests.
  absl::Status Prepare(const v1::GenerateRequest& req, const TenantDefaults& defaults,
                       PreparedRequest* out) const;

  uint64_t requests_ok() const { return ok_.load(); }
  uint64_t requests_failed() const { return failed_.load(); }
  // Decode streams moved to another worker since start (also tandem_migrations_total).
  uint64_t migrations() const { return migrations_.load(); }
  // Shutdown support: once draining, new Generate calls are refused with UNAVAILABLE while
  // those already running continue; active() counts the running ones.
  void StartDraining() { draining_ = true; }
  int active() const { return active_.load(); }
  const PrefixIndex& prefix_index() const { return prefix_index_; }
  // The registered prefill workers, for the prefix index (kv-aware policy; called every sweep).
  void SetPrefillWorkers(std::span<const PrefixWorker> workers) {
    prefix_index_.SetWorkers(workers);
  }
  // Requests refused because their predicted TTFT was past their target (slo.h).
  uint64_t slo_rejected() const { return slo_rejected_.load(); }
  // The TTFT prediction for a request of `tokens` prompt tokens in class `priority`, now.
  TtftPrediction PredictTtft(Priority priority, int64_t tokens) const;

 private:
  struct Call;            // one Generate in progress
  class RouterText;       // a migrated request's text, made by the router
  class GenerateReactor;  // the client's stream
  // A Chat request as the GenerateRequest it stands for; INVALID_ARGUMENT naming the message
  // the template refuses, UNAVAILABLE before the model is known.
  // *tools: the request's tools and tool_choice, which the answer's calls are parsed by.
  absl::StatusOr<v1::GenerateRequest> RenderChat(const v1::ChatRequest& req,
                                                 OpenAiRequest* tools) const;
  Task<void> Drive(GenerateReactor* r, grpc::CallbackServerContext* ctx,
                   const v1::GenerateRequest* req);
  Task<absl::Status> Serve(GenerateReactor* r, grpc::CallbackServerContext* ctx,
                           const v1::GenerateRequest& req);
  Task<absl::Status> Route(Call& c);
  Task<absl::Status> RunDisaggregated(Call& c);
  // A worker of `pool` for c: the session's (SessionWeight) when it has one, else by the
  // policy; never one in `exclude`.
  Assignment PickForSession(Pool pool, const Call& c,
                            const absl::flat_hash_set<std::string>& exclude);
  Task<absl::Status> RunColocated(Call& c);
  // The pool whose workers prefill under the current plan.
  Pool PrefillPool() const;
  // The admission gate with RouterOptions::max_prefill_backlog (slo.h): open while fewer
  // admitted requests are on their way to a worker than there are workers under the bound.
  bool GateOpen(int in_transit) const;
  // The request's prefill started on a worker, or it ended: it no longer counts as on its way.
  void Arrived(Call& c);
  Task<absl::Status> RelayDecode(Call& c, Assignment& d, const v1::DecodeRequest& dreq);
  // After a broken stream: whether the request may move to another worker, and if so the
  // bookkeeping of the move (counted, the old worker avoided, the text taken over).
  Task<bool> StartMigration(Call& c, absl::Status st);
  // Frees what a worker holds for the request; done once the worker answered (or the control
  // timeout passed), so that a new reservation of the same id cannot be overtaken by it.
  Task<void> CancelOnDecode(std::string address, std::string request_id);
  Task<void> CancelOnPrefill(std::string address, std::string request_id);
  std::string NewRequestId();
  bool ClaimId(const std::string& id);
  void ReleaseId(const std::string& id);

  // Known (non-null) in everything Generate, Tokenize and ListModels call after their check.
  const RouterModel* model() const { return models_->model(); }

  const ModelHolder* models_;
  WorkerRegistry* registry_;
  Admission* admission_;
  WorkerChannels* channels_;
  RouterMetrics* metrics_;
  const RouterOptions o_;
  const uint64_t id_salt_;
  const uint64_t tenant_salt_;
  PrefixIndex prefix_index_;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> ok_{0};
  std::atomic<uint64_t> failed_{0};
  std::atomic<uint64_t> migrations_{0};
  std::atomic<uint64_t> slo_rejected_{0};
  std::array<SloTracker, 3> slo_;  // by Priority
  std::atomic<bool> draining_{false};
  std::atomic<int> active_{0};
  absl::Mutex ids_mu_;
  absl::flat_hash_set<std::string> active_ids_ ABSL_GUARDED_BY(ids_mu_);
};

class RegistryService final : public v1::Registry::Service {
 public:
  // `models` (may be null: every worker is admitted by the registry alone) decides first
  // whether a worker's model may join (model_holder.h).
  explicit RegistryService(WorkerRegistry* registry, ModelHolder* models = nullptr)
      : registry_(registry), models_(models) {}

  grpc::Status Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                        v1::RegisterResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override;
  grpc::Status Deregister(grpc::ServerContext* ctx, const v1::DeregisterRequest* req,
                          v1::DeregisterResponse* resp) override;
  grpc::Status ListWorkers(grpc::ServerContext* ctx, const v1::ListWorkersRequest* req,
                           v1::ListWorkersResponse* resp) override;

 private:
  WorkerRegistry* registry_;
  ModelHolder* models_;
};

}  // namespace tandem::router
