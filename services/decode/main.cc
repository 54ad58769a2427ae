// tandem-decode: the decode worker process. Flags are read only here and in the shared worker
// flags of services/common/worker_main.h.
//
// Roles: --role decode (default) serves reservations for remote prefill (disaggregated mode)
// and also local-prefill requests. --role both registers as WORKER_ROLE_BOTH: the colocated
// worker. We chose to make the colocated worker this same binary rather than one process
// serving both gRPC services: a colocated request is a DecodeRequest with prefill_locally,
// prefilled by this worker's own scheduler in chunks batched with its running decodes, which is
// what colocated serving means (one engine, one batch). A separate PrefillWorker service here
// would need a second engine and KV pool competing for the same cores.
//
// Shutdown on SIGTERM/SIGINT: deregister from the router, serve the Decode of every reservation
// already made, stop accepting calls, let in-flight streams finish, all within --grace-ms;
// cancel the rest, exit 0.
#include <algorithm>
#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "services/common/transport_metrics.h"
#include "services/common/worker_main.h"
#include "services/decode/decode_service.h"
#if TANDEM_DECODE_TEST_HOOKS
#include "tests/fault/decode_test_hooks.h"
#endif

namespace tandem {
namespace {

constexpr char kBinary[] = "tandem-decode";

int Main(int argc, char** argv) {
  CLI::App app{
      "tandem decode worker: holds the KV pool remote prefills write into, "
      "continuous-batches decoding, streams tokens over gRPC (tandem.v1.DecodeWorker)"};
  services::WorkerFlagSpec spec;
  spec.role = "decode";
  spec.default_max_seqs = 8;
  spec.transports = {"ucx", "cuda_ipc", "nccl", "inproc", "none"};
  spec.transport_help =
      "KV transport: ucx, cuda_ipc (GPU pool, prefill on the same node), nccl (GPU pool, "
      "prefill on any node; needs a fixed --port), inproc (same process only), none";
  spec.kv_blocks_help = "KV pool blocks (0: max-seqs full contexts)";
  spec.max_seqs_help = "sequences decoding at once";
  spec.grace_help = "on SIGTERM, how long in-flight streams may finish";
  services::WorkerFlags flags;
  services::AddWorkerFlags(app, &flags, spec);
  std::string role = "decode";
  uint32_t lease_ms = 10000, max_lease_ms = 600000, quarantine_ms = 5000;
  app.add_option("--role", role, "decode, or both: the colocated worker")
      ->check(CLI::IsMember({"decode", "both"}));
  app.add_option("--lease-ms", lease_ms, "reservation lease when a Reserve names none")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-lease-ms", max_lease_ms, "longest reservation lease granted")
      ->check(CLI::PositiveNumber);
  app.add_option("--quarantine-ms", quarantine_ms,
                 "how long the blocks of an expired or cancelled reservation stay out of the "
                 "pool, so a prefill's late writes cannot land in another request's KV")
      ->check(CLI::NonNegativeNumber);
  bool no_prefix_cache = false;
  app.add_flag("--no-prefix-cache", no_prefix_cache,
               "free finished sequences' blocks at once (the next turn of a conversation then "
               "gets all of its KV sent again)");
#if TANDEM_DECODE_TEST_HOOKS
  int wedge_after_steps = 0;
  testing::AddDecodeTestHooks(app, &wedge_after_steps);
#endif
  CLI11_PARSE(app, argc, argv);

  if (absl::Status st = services::PrepareWorkerProcess(spec, &flags); !st.ok()) {
    return services::FailWorker(kBinary, "process setup", st);
  }
  if (absl::Status st = services::CheckWorkerDevice(flags); !st.ok()) {
    return services::FailWorker(kBinary, absl::StrCat("--device ", flags.device), st);
  }
  if (flags.ep_rank > 0) return services::RunExpertRank(flags, kBinary);
  if (flags.transport == "nccl" && flags.port == 0) {
    return services::FailWorker(
        kBinary, "--transport nccl",
        absl::InvalidArgumentError("needs a fixed --port: the KV descriptors it hands out name "
                                   "this worker's gRPC address, where prefills join"));
  }
  services::KvJoinHandler kv_join;
  absl::StatusOr<std::unique_ptr<transfer::KvTransport>> kv_transport =
      services::TransportFromFlags(flags, &kv_join);
  if (!kv_transport.ok())
    return services::FailWorker(kBinary, "--transport", kv_transport.status());

  // With --ep-size > 1: rank 0's experts, and the group that runs the others.
  absl::StatusOr<services::WorkerModel> model =
      services::LoadWorkerModel(flags, kv_transport->get());
  if (!model.ok()) {
    return services::FailWorker(kBinary, absl::StrCat("loading ", flags.model_path),
                                model.status());
  }

  // Before the worker, so it is closed after the worker has stopped.
  absl::StatusOr<std::unique_ptr<trace::Tracer>> tracer = services::OpenTrace(flags.trace, kBinary);
  if (!tracer.ok()) return services::FailWorker(kBinary, "--trace", tracer.status());
  // Recorded always (a few atomics per token); served only with --metrics-port.
  services::Metrics metrics;
  decode::DecodeWorkerOptions wo;
  wo.metrics = &metrics.Serving(services::ModelNameFromPath(flags.model_path), role);
  wo.util_metrics = &metrics.Utilization(services::ModelNameFromPath(flags.model_path), role);
  wo.peaks = services::WorkerPeaksFromFlags(flags, &wo.measure_peaks);
  wo.tracer = tracer->get();
  services::ExportTransportMetrics(&metrics, services::ModelNameFromPath(flags.model_path), role,
                                   kv_transport->get());
  wo.model = std::shared_ptr<const engine::Model>(std::move(model->model));
  wo.engine = services::EngineOptionsFromFlags(flags);
  wo.engine.expert_peers = model->group.get();
  wo.worker_id = flags.worker_id;
  wo.transport = kv_transport->get();
  wo.default_lease = absl::Milliseconds(lease_ms);
  wo.max_lease = absl::Milliseconds(std::max(lease_ms, max_lease_ms));
  wo.quarantine = absl::Milliseconds(quarantine_ms);
  wo.prefix_cache = !no_prefix_cache;
  absl::StatusOr<engine::SpeculativeOptions> spec_options = services::SpeculativeFromFlags(flags);
  if (!spec_options.ok()) {
    return services::FailWorker(kBinary, "--speculative", spec_options.status());
  }
  wo.speculative = *spec_options;
  wo.draft_kv_from_prefill = flags.draft_kv == "prefill";
#if TANDEM_DECODE_TEST_HOOKS
  if (wedge_after_steps > 0) wo.before_step = testing::WedgeAfterSteps(wedge_after_steps);
#endif
  if (spec_options->method != engine::SpecMethod::kOff) {
    wo.spec_metrics = &metrics.Speculative(
        services::ModelNameFromPath(flags.model_path), role,
        std::string(engine::SpecMethodName(spec_options->method)));
  }
  absl::StatusOr<std::unique_ptr<decode::DecodeWorker>> worker = decode::DecodeWorker::Create(wo);
  if (!worker.ok())
    return services::FailWorker(kBinary, "starting the decode worker", worker.status());

  decode::DecodeService service(worker->get());
  service.set_kv_join_handler(std::move(kv_join));
  services::ServeOptions so;
  so.binary = kBinary;
  so.role_label = role;
  so.service = &service;
  so.role = role == "both" ? v1::WORKER_ROLE_BOTH : v1::WORKER_ROLE_DECODE;
  so.kv_blocks_total = (*worker)->kv_blocks_total();
  so.transport_name = *kv_transport ? (*kv_transport)->capabilities().name : "none";
  decode::DecodeWorker* w = worker->get();
  so.stats = [w] { return w->Stats(); };
  so.engine_busy_for = [w] { return w->EngineBusyFor(); };
  so.metrics = &metrics;
  // On SIGTERM, reservations made just before deregistering still get their Decode.
  so.pending_work = [w] { return w->Stats().reservations(); };
  services::ServeExpertGroup(model->group.get(), &so);
  const int rc = services::ServeWorker(flags, so);
  worker->reset();
  return rc;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) { return tandem::Main(argc, argv); }
