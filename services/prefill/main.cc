// tandem-prefill: the prefill worker process. Flags are read only here and in the shared worker
// flags of services/common/worker_main.h.
//
// Serves tandem.v1.PrefillWorker: computes prompts' KV with chunked prefill and writes it over
// the KV transport into the decode worker's reserved blocks, layer by layer.
// Prefix onboarding: the worker keeps computed blocks in a prefix cache (off with
// --no-prefix-cache) and, with --kvstore HOST:PORT, onboards cached prefixes from tandem-kvstore
// over the same KV transport and publishes new blocks to it (--kvstore-lookup-ms and
// --kvstore-read-ms bound the calls on a request's path; --publish-queue-blocks bounds the
// asynchronous publishing). The kvstore must run with the same --transport.
// Shutdown on SIGTERM/SIGINT: deregister from the router, stop accepting calls, let in-flight
// prefills finish for up to --grace-ms, cancel the rest, exit 0.
#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "services/common/transport_metrics.h"
#include "services/common/worker_main.h"
#include "services/prefill/prefill_service.h"
#if TANDEM_PREFILL_TEST_HOOKS
#include "tests/fault/prefill_test_hooks.h"
#endif

namespace tandem {
namespace {

constexpr char kBinary[] = "tandem-prefill";

int Main(int argc, char** argv) {
  CLI::App app{
      "tandem prefill worker: chunked prefill whose KV goes straight into a decode "
      "worker's reserved blocks over the KV transport (tandem.v1.PrefillWorker)"};
  services::WorkerFlagSpec spec;
  spec.role = "prefill";
  spec.default_max_seqs = 4;
  spec.transports = {"ucx", "cuda_ipc", "nccl", "inproc"};
  spec.transport_help =
      "KV transport to decode: ucx, cuda_ipc (GPU pool, decode on the same node), nccl (GPU "
      "pool, decode on any node), or inproc (same process only)";
  spec.kv_blocks_help = "local KV blocks (0: max-seqs full contexts)";
  spec.block_size_help = "tokens per KV block (must match decode)";
  spec.kv_type_help = "KV cache element type (must match decode)";
  spec.max_seqs_help = "sizes the local KV pool when --kv-blocks is 0";
  spec.max_batch_tokens_help = "tokens per engine step (longer prompts are prefilled in chunks)";
  spec.grace_help = "on SIGTERM, how long in-flight prefills may finish";
  services::WorkerFlags flags;
  services::AddWorkerFlags(app, &flags, spec);
  int max_transfer_ms = 120000, step_delay_ms = 0;
  bool no_prefix_cache = false;
  std::string kvstore;
  int kvstore_lookup_ms = 200, kvstore_read_ms = 5000, publish_queue_blocks = 512;
  app.add_flag("--no-prefix-cache", no_prefix_cache, "compute every prompt in full");
  app.add_option("--kvstore", kvstore, "tandem-kvstore HOST:PORT to onboard from and publish to");
  std::string kvstore_transport;
  app.add_option("--kvstore-transport", kvstore_transport,
                 "KV transport to the kvstore, which serves host memory: ucx or inproc "
                 "(default: --transport; ucx with --ucx-tls when --transport is cuda_ipc or "
                 "nccl)")
      ->check(CLI::IsMember({"ucx", "inproc"}));
  app.add_option("--kvstore-lookup-ms", kvstore_lookup_ms, "deadline of a kvstore Lookup")
      ->check(CLI::PositiveNumber);
  app.add_option("--kvstore-read-ms", kvstore_read_ms, "deadline of a kvstore Read")
      ->check(CLI::PositiveNumber);
  app.add_option("--publish-queue-blocks", publish_queue_blocks,
                 "blocks waiting to be published before new ones are dropped")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-transfer-ms", max_transfer_ms,
                 "bound on a KV transfer when the Prefill call has no deadline")
      ->check(CLI::PositiveNumber);
#if TANDEM_PREFILL_TEST_HOOKS
  testing::AddPrefillTestHooks(app, &step_delay_ms, &flags.test_fault_flip_bit_every);
#endif
  CLI11_PARSE(app, argc, argv);

  if (absl::Status st = services::PrepareWorkerProcess(spec, &flags); !st.ok()) {
    return services::FailWorker(kBinary, "process setup", st);
  }
  if (absl::Status st = services::CheckWorkerDevice(flags); !st.ok()) {
    return services::FailWorker(kBinary, absl::StrCat("--device ", flags.device), st);
  }
  if (flags.ep_rank > 0) return services::RunExpertRank(flags, kBinary);
  absl::StatusOr<std::unique_ptr<transfer::KvTransport>> kv_transport =
      services::TransportFromFlags(flags);
  if (!kv_transport.ok())
    return services::FailWorker(kBinary, "--transport", kv_transport.status());
  // The kvstore's transport, when it differs from decode's (a GPU pool's cuda_ipc cannot reach
  // the store's host memory).
  if (kvstore_transport.empty() && (flags.transport == "cuda_ipc" || flags.transport == "nccl")) {
    kvstore_transport = "ucx";
  }
  std::unique_ptr<transfer::KvTransport> store_transport;
  if (!kvstore.empty() && !kvstore_transport.empty() && kvstore_transport != flags.transport) {
    services::WorkerFlags sf = flags;
    sf.transport = kvstore_transport;
    sf.test_fault_flip_bit_every = 0;
    absl::StatusOr<std::unique_ptr<transfer::KvTransport>> t = services::TransportFromFlags(sf);
    if (!t.ok()) return services::FailWorker(kBinary, "--kvstore-transport", t.status());
    store_transport = std::move(*t);
  }

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
  // Recorded always (a few atomics per request); served only with --metrics-port.
  services::Metrics metrics;
  prefill::PrefillWorkerOptions wo;
  wo.metrics = &metrics.Serving(services::ModelNameFromPath(flags.model_path), "prefill");
  wo.util_metrics = &metrics.Utilization(services::ModelNameFromPath(flags.model_path), "prefill");
  wo.peaks = services::WorkerPeaksFromFlags(flags, &wo.measure_peaks);
  wo.tracer = tracer->get();
  services::ExportTransportMetrics(&metrics, services::ModelNameFromPath(flags.model_path),
                                   "prefill", kv_transport->get());
  wo.model = std::shared_ptr<const engine::Model>(std::move(model->model));
  wo.engine = services::EngineOptionsFromFlags(flags);
  wo.engine.expert_peers = model->group.get();
  wo.worker_id = flags.worker_id;
  wo.transport = kv_transport->get();
  wo.kvstore_transport = store_transport.get();
  wo.max_transfer_time = absl::Milliseconds(max_transfer_ms);
  wo.prefix_cache = !no_prefix_cache;
  absl::StatusOr<engine::SpeculativeOptions> spec_options = services::SpeculativeFromFlags(flags);
  if (!spec_options.ok()) {
    return services::FailWorker(kBinary, "--speculative", spec_options.status());
  }
  wo.speculative = *spec_options;
  wo.draft_kv = flags.draft_kv == "prefill";
  wo.kvstore.address = kvstore;
  wo.kvstore.lookup_timeout = absl::Milliseconds(kvstore_lookup_ms);
  wo.kvstore.read_timeout = absl::Milliseconds(kvstore_read_ms);
  wo.kvstore.publish_queue_blocks = publish_queue_blocks;
  if (step_delay_ms > 0) {
    wo.before_step = [d = absl::Milliseconds(step_delay_ms)] { absl::SleepFor(d); };
  }
  absl::StatusOr<std::unique_ptr<prefill::PrefillWorker>> worker =
      prefill::PrefillWorker::Create(wo);
  if (!worker.ok()) {
    return services::FailWorker(kBinary, "starting the prefill worker", worker.status());
  }

  prefill::PrefillService service(worker->get());
  services::ServeOptions so;
  so.binary = kBinary;
  so.service = &service;
  so.role = v1::WORKER_ROLE_PREFILL;
  so.kv_blocks_total = (*worker)->kv_blocks_total();
  so.transport_name = (*kv_transport)->capabilities().name;
  prefill::PrefillWorker* w = worker->get();
  so.stats = [w] { return w->Stats(); };
  so.engine_busy_for = [w] { return w->EngineBusyFor(); };
  so.metrics = &metrics;
  services::ServeExpertGroup(model->group.get(), &so);
  const int rc = services::ServeWorker(flags, so);
  worker->reset();
  store_transport.reset();
  return rc;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) { return tandem::Main(argc, argv); }
