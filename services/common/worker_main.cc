#include "services/common/worker_main.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/transfer/fault_injection.h"
#include "common/util/status_util.h"
#include "services/common/grpc_server.h"
#include "services/common/model_card.h"
#include "services/common/process_util.h"
#include "services/common/registration.h"
#include "services/common/registry_set.h"
#include "services/common/transport_factory.h"
#include "tandem/kernels/kv_quant.h"

namespace tandem::services {
namespace {

// How long a draining worker still accepts calls after deregistering: covers a call the router
// chose it for just before (one network hop), without holding up an idle worker's exit.
constexpr absl::Duration kDrainSettle = absl::Milliseconds(200);

}  // namespace

void AddWorkerFlags(CLI::App& app, WorkerFlags* f, const WorkerFlagSpec& spec) {
  f->max_seqs = spec.default_max_seqs;
  app.add_option("--model", f->model_path, "GGUF model file")->required();
  app.add_option("--host", f->host, "address to listen on (0.0.0.0: every interface)");
  app.add_option("--port", f->port, "port to listen on; 0 picks a free one (printed, --port-file)");
  app.add_option("--port-file", f->port_file, "write the bound port here once serving");
  AddTraceFlags(&app, &f->trace);
  app.add_option("--advertise-host", f->advertise_host,
                 "host the router should dial (default: --host; 127.0.0.1 for a wildcard)");
  app.add_option("--worker-id", f->worker_id,
                 absl::StrCat("id in the registry (default ", spec.role, "-HOST-PID)"));
  app.add_option("--router", f->router,
                 "routers to register with: HOST:PORT[,HOST:PORT...]; each HOST is resolved to "
                 "every address it has (DNS, /etc/hosts) and the worker registers with each");
  app.add_option("--router-resolve-ms", f->router_resolve_ms,
                 "re-resolve the --router names this often (ms): new routers are joined, "
                 "vanished ones dropped")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", f->threads, "compute threads")->check(CLI::PositiveNumber);
  app.add_option("--kv-blocks", f->kv_blocks, spec.kv_blocks_help)->check(CLI::NonNegativeNumber);
  app.add_option("--block-size", f->block_size, spec.block_size_help)->check(CLI::PositiveNumber);
  app.add_option("--kv-type,--kv-dtype", f->kv_type, spec.kv_type_help)
      ->check(CLI::IsMember({"f32", "f16", "int8", "fp8"}));
  app.add_option("--device", f->device,
                 "cpu, or cuda: weights and KV pool on the GPU; the pool is then registered with "
                 "a transport that holds device memory: cuda_ipc on one node, nccl across "
                 "nodes (docs/gpu.md)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--ctx-size", f->ctx_size, "positions per sequence (0: min(model, 4096))")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-seqs", f->max_seqs, spec.max_seqs_help)->check(CLI::PositiveNumber);
  app.add_option("--max-batch-tokens", f->max_batch_tokens, spec.max_batch_tokens_help)
      ->check(CLI::PositiveNumber);
  app.add_option("--speculative", f->speculative,
                 "speculative decoding: off, ngram (prompt lookup), self:TYPE (the model "
                 "converted to TYPE) or draft:PATH; decode proposes with the draft, and prefill and "
                 "decode workers must agree");
  app.add_option("--spec-tokens", f->spec_tokens, "most draft tokens verified per step (1-16)");
  app.add_option("--draft-kv", f->draft_kv,
                 "with a draft model, where its prompt K/V are computed: prefill (beside the "
                 "target's, sent in the same transfer) or decode (on the first proposal)")
      ->check(CLI::IsMember({"prefill", "decode"}));
  app.add_option("--peak-read-gbs", f->peak_read_gbs,
                 "peak read bandwidth in GB/s that model bandwidth utilisation is measured "
                 "against (0: measured at start)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--peak-gflops", f->peak_gflops,
                 "peak GFLOP/s that model FLOPs utilisation is measured against (0: measured at "
                 "start)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--spec-max-batch", f->spec_max_batch,
                 "no speculation in a step with more decoding sequences than this")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--transport", f->transport, spec.transport_help)
      ->check(CLI::IsMember(spec.transports));
  app.add_option("--ucx-tls", f->ucx_tls, "UCX transports: shm, tcp, all or a UCX_TLS list");
  app.add_option("--grace-ms", f->grace_ms, spec.grace_help)->check(CLI::NonNegativeNumber);
  app.add_option("--cpus", f->cpus, "pin the process to these CPUs, e.g. 0-3,6");
  app.add_option("--metrics-port", f->metrics_port,
                 "serve Prometheus metrics on http://HOST:PORT/metrics (0: off)")
      ->check(CLI::Range(0, 65535));
  AddTlsFlags(app, &f->tls);
  app.add_option("--ep-size", f->ep_size,
                 "expert parallelism: this worker is one of a group of N processes that split "
                 "an MoE model's experts (rank 0 serves requests; the others hold experts only)")
      ->check(CLI::PositiveNumber);
  app.add_option("--ep-rank", f->ep_rank, "this process's rank in its group (0: the leader)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--ep-leader", f->ep_leader,
                 "an expert rank's leader: HOST:PORT of rank 0's gRPC server");
  app.add_option("--expert-placement", f->expert_placement,
                 "which rank holds which experts: a `tandem place-experts` file (default: "
                 "contiguous); every rank of a group takes the same one");
  app.add_option("--ep-timeout-ms", f->ep_timeout_ms,
                 "deadline of every exchange between the ranks of a group")
      ->check(CLI::PositiveNumber);
  app.add_option("--stall-ms", f->stall_ms,
                 "liveness watchdog: an engine loop on one turn of work (a step) for longer than "
                 "this is wedged; the worker then says NOT_SERVING (also on the \"liveness\" "
                 "health service) and deregisters; 0: off")
      ->check(CLI::NonNegativeNumber);
}

absl::Status PrepareWorkerProcess(const WorkerFlagSpec& spec, WorkerFlags* f) {
  // Before any thread exists, so every thread inherits the mask and the affinity.
  BlockTerminationSignals();
  if (!f->cpus.empty()) {
    absl::StatusOr<std::vector<int>> list = ParseCpuList(f->cpus);
    if (!list.ok()) return list.status();
    if (absl::Status st = PinToCpus(*list); !st.ok()) return st;
  }
  if (f->worker_id.empty()) f->worker_id = DefaultWorkerId(spec.role);
  if (!f->router.empty()) {
    if (absl::StatusOr<std::vector<RouterEndpoint>> r = ParseRouterList(f->router); !r.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--router: ", r.status().message()));
    }
  }
  if (f->ep_rank >= f->ep_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ep-rank ", f->ep_rank, " is not below --ep-size ", f->ep_size));
  }
  if (f->ep_rank > 0 && f->ep_leader.empty()) {
    return absl::InvalidArgumentError("--ep-rank >= 1 needs --ep-leader (rank 0's HOST:PORT)");
  }
  if (f->ep_size > 1 && f->device != "cpu") {
    return absl::InvalidArgumentError("expert parallelism runs on the CPU engine only");
  }
  // Before any server or channel exists: they take the process's TLS settings.
  if (absl::Status st = SetProcessTls(f->tls); !st.ok()) return st;
  return absl::OkStatus();
}

absl::Status CheckWorkerDevice(const WorkerFlags& f) {
  return engine::CheckDeviceAvailable(
      engine::DeviceFromName(f.device).value_or(engine::Device::kCpu));
}

absl::StatusOr<engine::SpeculativeOptions> SpeculativeFromFlags(const WorkerFlags& f) {
  absl::StatusOr<engine::SpeculativeOptions> o = engine::ParseSpeculative(f.speculative, f.spec_tokens);
  if (o.ok()) o->max_batch = f.spec_max_batch;
  return o;
}

engine::DevicePeaks WorkerPeaksFromFlags(const WorkerFlags& f, bool* measure) {
  *measure = f.device == "cpu" && (f.peak_read_gbs <= 0 || f.peak_gflops <= 0);
  return {f.peak_read_gbs, f.peak_gflops};
}

absl::StatusOr<engine::ExpertPlacement> PlacementFromFlags(const WorkerFlags& f) {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<gguf::GgufFile> file,
                          gguf::GgufFile::Open(f.model_path));
  TANDEM_ASSIGN_OR_RETURN(const engine::ModelConfig c, engine::ModelConfig::FromGguf(*file));
  if (c.n_expert == 0) {
    return absl::InvalidArgumentError("--ep-size > 1 needs an MoE model (this one has no experts)");
  }
  if (!f.expert_placement.empty()) {
    return engine::ExpertPlacement::ReadFile(f.expert_placement, c.n_layer, c.n_expert, f.ep_size);
  }
  return engine::ExpertPlacement::Contiguous(c.n_layer, c.n_expert, f.ep_size);
}

absl::StatusOr<WorkerModel> LoadWorkerModel(const WorkerFlags& f,
                                            transfer::KvTransport* transport) {
  WorkerModel wm;
  if (f.ep_size <= 1) {
    absl::StatusOr<std::unique_ptr<engine::Model>> m = engine::Model::Load(f.model_path);
    if (!m.ok()) return m.status();
    wm.model = std::move(*m);
    return wm;
  }
  if (transport == nullptr) {
    return absl::InvalidArgumentError("--ep-size > 1 needs a KV transport (ucx)");
  }
  absl::StatusOr<engine::ExpertPlacement> placement = PlacementFromFlags(f);
  if (!placement.ok()) return placement.status();
  engine::ModelLoadOptions lo;
  lo.holds_expert = [p = *placement](int32_t l, int32_t e) { return p.Holds(0, l, e); };
  absl::StatusOr<std::unique_ptr<engine::Model>> m = engine::Model::Load(f.model_path, lo);
  if (!m.ok()) return m.status();
  wm.model = std::move(*m);
  ExpertGroupOptions go;
  go.transport = transport;
  go.placement = std::move(*placement);
  go.model = wm.model.get();
  go.model_name = std::filesystem::path(f.model_path).filename().string();
  go.capacity_rows = int64_t{f.max_batch_tokens} * wm.model->config().n_expert_used;
  go.timeout = absl::Milliseconds(f.ep_timeout_ms);
  go.worker_id = f.worker_id;
  absl::StatusOr<std::unique_ptr<ExpertGroup>> g = ExpertGroup::Create(std::move(go));
  if (!g.ok()) return g.status();
  wm.group = std::move(*g);
  return wm;
}

engine::EngineOptions EngineOptionsFromFlags(const WorkerFlags& f) {
  engine::EngineOptions eo;
  eo.threads = f.threads;
  eo.ctx_size = f.ctx_size;
  eo.max_seqs = f.max_seqs;
  eo.kv_blocks = f.kv_blocks;
  eo.block_size = f.block_size;
  eo.max_batch_tokens = f.max_batch_tokens;
  // The flag's check admits only names KvTypeFromName knows.
  eo.kv_type = kernels::KvTypeFromName(f.kv_type).value_or(kernels::DType::kF32);
  eo.device = engine::DeviceFromName(f.device).value_or(engine::Device::kCpu);
  return eo;
}

absl::StatusOr<std::unique_ptr<transfer::KvTransport>> TransportFromFlags(
    const WorkerFlags& f, KvJoinHandler* join_handler) {
  if (f.transport == "none") return std::unique_ptr<transfer::KvTransport>();
  TransportChoice tc;
  tc.kind = f.transport;
  tc.name = f.worker_id;
  tc.ucx_tls = f.ucx_tls;
  if (f.transport == "nccl") {
    // NCCL sends and receives device memory only: a host pool would fail at the first write.
    if (f.device != "cuda") {
      return absl::FailedPreconditionError(
          "--transport nccl moves KV between GPU pools: it needs --device cuda");
    }
    if (f.port != 0) {
      tc.control_address = JoinHostPort(
          f.advertise_host.empty() ? AdvertisedHost(f.host) : f.advertise_host, f.port);
    }
    tc.nccl_join = GrpcNcclJoin();
  }
  absl::StatusOr<std::unique_ptr<transfer::KvTransport>> t = CreateTransport(tc, join_handler);
  if (!t.ok() || f.test_fault_flip_bit_every <= 0) return t;
  std::fprintf(stderr,
               "%s: TEST FAULT INJECTION: one bit of every %d-th KV write is corrupted\n",
               f.worker_id.c_str(), f.test_fault_flip_bit_every);
  transfer::FaultInjectionOptions fo;
  fo.flip_bit_every_n_writes = static_cast<uint64_t>(f.test_fault_flip_bit_every);
  return transfer::MaybeInjectFaults(std::move(*t), fo);
}

void ServeExpertGroup(ExpertGroup* group, ServeOptions* so) {
  if (group == nullptr) return;
  so->extra_services.push_back(group);
  so->ready = [group] { return group->complete(); };
  so->on_drain = [group] { group->Shutdown(); };
}

int FailWorker(const std::string& binary, const std::string& what, const absl::Status& st) {
  std::fprintf(stderr, "%s: %s: %s\n", binary.c_str(), what.c_str(), st.ToString().c_str());
  return 1;
}

int ServeWorker(const WorkerFlags& f, const ServeOptions& o) {
  // The router may run without the model file and learn the model from this card.
  absl::StatusOr<v1::ModelCard> card = BuildModelCard(f.model_path, f.ctx_size);
  if (!card.ok()) return FailWorker(o.binary, "building the model card", card.status());
  ModelCardService card_service(*card);
  GrpcServerOptions so;
  so.host = f.host;
  so.port = f.port;
  so.services = {o.service, &card_service};
  so.services.insert(so.services.end(), o.extra_services.begin(), o.extra_services.end());
  absl::StatusOr<std::unique_ptr<GrpcServer>> server = GrpcServer::Start(so);
  if (!server.ok()) return FailWorker(o.binary, "starting the gRPC server", server.status());
  const int bound = (*server)->port();
  // Before the port file and registration: whoever waits for either can scrape at once.
  std::unique_ptr<MetricsServer> metrics_server;
  if (f.metrics_port > 0 && o.metrics != nullptr) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> ms =
        MetricsServer::Start(f.host, f.metrics_port, o.metrics);
    if (!ms.ok()) return FailWorker(o.binary, "--metrics-port", ms.status());
    metrics_server = std::move(*ms);
  }
  if (!f.port_file.empty()) {
    if (absl::Status st = WriteFileAtomically(f.port_file, absl::StrCat(bound, "\n")); !st.ok()) {
      return FailWorker(o.binary, "--port-file", st);
    }
  }
  const std::string advertised =
      JoinHostPort(f.advertise_host.empty() ? AdvertisedHost(f.host) : f.advertise_host, bound);
  // The router matches models by file stem ("stories260K.gguf" serves "stories260K").
  const std::string model_file = std::filesystem::path(f.model_path).filename().string();
  const std::string label = o.role_label.empty() ? "" : absl::StrCat(" (", o.role_label, ")");
  std::printf("%s: worker %s%s serving on %s: model %s, %d KV blocks, transport %s\n",
              o.binary.c_str(), f.worker_id.c_str(), label.c_str(), (*server)->address().c_str(),
              model_file.c_str(), o.kv_blocks_total, o.transport_name.c_str());
  if (metrics_server) {
    std::printf("%s: metrics on %s\n", o.binary.c_str(), metrics_server->url().c_str());
  }
  std::fflush(stdout);

  std::optional<RegistrySetOptions> registry_options;
  if (!f.router.empty()) {
    absl::StatusOr<std::vector<RouterEndpoint>> routers = ParseRouterList(f.router);
    if (!routers.ok()) return FailWorker(o.binary, "--router", routers.status());
    RegistrySetOptions rs;
    rs.routers = std::move(*routers);
    rs.resolve_interval = absl::Milliseconds(f.router_resolve_ms);
    RegistrationOptions& ro = rs.registration;
    ro.registration.set_worker_id(f.worker_id);
    ro.registration.set_role(o.role);
    ro.registration.set_address(advertised);
    ro.registration.set_model(model_file);
    ro.registration.set_kv_blocks_total(o.kv_blocks_total);
    ro.registration.set_max_seqs(f.max_seqs);
    ro.registration.set_max_batch_tokens(f.max_batch_tokens);
    ro.registration.set_kv_block_size(f.block_size);
    ro.registration.set_ctx_size(f.ctx_size);
    ro.registration.set_model_card_hash(card_service.card().card_hash());
    ro.stats = o.stats;
    registry_options = std::move(rs);
  }
  std::unique_ptr<RegistrySet> registration;
  // Serving: ready (an expert group whole) and live (no wedged engine loop).
  bool live = true;
  auto is_live = [&] {
    if (!o.engine_busy_for || f.stall_ms <= 0) return true;
    return o.engine_busy_for() <= absl::Milliseconds(f.stall_ms);
  };
  bool ready = !o.ready || o.ready();
  (*server)->SetServing(kLivenessService, true);
  auto follow_readiness = [&]() -> absl::Status {
    (*server)->SetServing(ready);
    if (ready && registry_options && !registration) {
      absl::StatusOr<std::unique_ptr<RegistrySet>> r = RegistrySet::Start(*registry_options);
      if (!r.ok()) return r.status();
      registration = std::move(*r);
    } else if (!ready && registration) {
      registration->Stop();  // deregisters: no router chooses a worker that cannot serve
      registration.reset();
    }
    return absl::OkStatus();
  };
  if (absl::Status st = follow_readiness(); !st.ok()) return FailWorker(o.binary, "--router", st);

  int sig = 0;
  if (!o.ready && (!o.engine_busy_for || f.stall_ms <= 0)) {
    sig = WaitForTerminationSignal();
  } else {
    while ((sig = WaitForTerminationSignalFor(50)) == 0) {
      const bool now_live = is_live();
      if (now_live != live) {
        live = now_live;
        (*server)->SetServing(kLivenessService, live);
        if (live) {
          std::fprintf(stderr, "%s: worker %s: the engine loop moves again\n", o.binary.c_str(),
                       f.worker_id.c_str());
        } else {
          std::fprintf(stderr,
                       "%s: worker %s: the engine loop has been on one turn for over %d ms "
                       "(wedged): NOT_SERVING\n",
                       o.binary.c_str(), f.worker_id.c_str(), f.stall_ms);
        }
      }
      const bool now_ready = live && (!o.ready || o.ready());
      if (now_ready == ready) continue;
      ready = now_ready;
      std::fprintf(stderr, "%s: worker %s is %s\n", o.binary.c_str(), f.worker_id.c_str(),
                   ready ? "ready: registering" : "not ready: deregistering");
      if (absl::Status st = follow_readiness(); !st.ok()) {
        std::fprintf(stderr, "%s: --router: %s\n", o.binary.c_str(), st.ToString().c_str());
      }
    }
  }
  const absl::Time signalled = absl::Now();
  const absl::Time deadline = signalled + absl::Milliseconds(f.grace_ms);
  std::fprintf(stderr, "%s: signal %d: draining (grace %d ms)\n", o.binary.c_str(), sig,
               f.grace_ms);
  if (registration) {
    registration->Stop();  // deregisters: every router stops choosing this worker first
    // A call the router chose this worker for just before may still be on its way; refusing it
    // would cost the request a retry elsewhere (a redone prefill).
    absl::SleepFor(std::min(kDrainSettle, deadline - absl::Now()));
  }
  int pending = 0;
  while (o.pending_work && (pending = o.pending_work()) > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  if (o.on_drain) o.on_drain();
  (*server)->Shutdown(std::max(absl::ZeroDuration(), deadline - absl::Now()));
  metrics_server.reset();  // after the drain, so its last counts can still be scraped
  const std::string unclaimed =
      pending > 0 ? absl::StrCat(" (", pending, " pending unclaimed at the deadline)") : "";
  std::fprintf(stderr, "%s: drained in %.0f ms%s\n", o.binary.c_str(),
               absl::ToDoubleMilliseconds(absl::Now() - signalled), unclaimed.c_str());
  return 0;
}

}  // namespace tandem::services
