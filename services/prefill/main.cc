// tandem-prefill: the prefill worker process. The only file that reads flags.
//
// Serves tandem.v1.PrefillWorker: computes prompts' KV with chunked prefill and writes it over
// the KV transport into the decode worker's reserved blocks, layer by layer.
// Shutdown on SIGTERM/SIGINT: deregister from the router, stop accepting calls, let in-flight
// prefills finish for up to --grace-ms, cancel the rest, exit 0.
#include <cstdio>
#include <filesystem>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "services/common/grpc_server.h"
#include "services/common/process_util.h"
#include "services/common/registration.h"
#include "services/common/transport_factory.h"
#include "services/prefill/prefill_service.h"

namespace tandem {
namespace {

int Fail(const std::string& what, const absl::Status& st) {
  std::fprintf(stderr, "tandem-prefill: %s: %s\n", what.c_str(), st.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  CLI::App app{
      "tandem prefill worker: chunked prefill whose KV goes straight into a decode "
      "worker's reserved blocks over the KV transport (tandem.v1.PrefillWorker)"};
  std::string model_path, host = "127.0.0.1", advertise_host, worker_id, router;
  std::string transport = "ucx", ucx_tls = "shm", cpus, port_file, kv_type = "f32";
  int port = 0, threads = 1, kv_blocks = 0, ctx_size = 0, max_seqs = 4, block_size = 16;
  int max_batch_tokens = 512, grace_ms = 10000, max_transfer_ms = 120000;
  app.add_option("--model", model_path, "GGUF model file")->required();
  app.add_option("--host", host, "address to listen on (0.0.0.0: every interface)");
  app.add_option("--port", port, "port to listen on; 0 picks a free one (printed, --port-file)");
  app.add_option("--port-file", port_file, "write the bound port here once serving");
  app.add_option("--advertise-host", advertise_host,
                 "host the router should dial (default: --host; 127.0.0.1 for a wildcard)");
  app.add_option("--worker-id", worker_id, "id in the registry (default prefill-HOST-PID)");
  app.add_option("--router", router, "registry (router) host:port to register with");
  app.add_option("--threads", threads, "compute threads")->check(CLI::PositiveNumber);
  app.add_option("--kv-blocks", kv_blocks, "local KV blocks (0: max-seqs full contexts)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--block-size", block_size, "tokens per KV block (must match decode)")
      ->check(CLI::PositiveNumber);
  app.add_option("--kv-type", kv_type, "KV cache element type (must match decode)")
      ->check(CLI::IsMember({"f32", "f16"}));
  app.add_option("--ctx-size", ctx_size, "positions per sequence (0: min(model, 4096))")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-seqs", max_seqs, "sizes the local KV pool when --kv-blocks is 0")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-batch-tokens", max_batch_tokens,
                 "tokens per engine step (longer prompts are prefilled in chunks)")
      ->check(CLI::PositiveNumber);
  app.add_option("--transport", transport, "KV transport: ucx, or inproc (same process only)")
      ->check(CLI::IsMember({"ucx", "inproc"}));
  app.add_option("--ucx-tls", ucx_tls, "UCX transports: shm, tcp, all or a UCX_TLS list");
  app.add_option("--max-transfer-ms", max_transfer_ms,
                 "bound on a KV transfer when the Prefill call has no deadline")
      ->check(CLI::PositiveNumber);
  app.add_option("--grace-ms", grace_ms, "on SIGTERM, how long in-flight prefills may finish")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--cpus", cpus, "pin the process to these CPUs, e.g. 0-3,6");
  CLI11_PARSE(app, argc, argv);

  // Before any thread exists, so every thread inherits the mask and the affinity.
  services::BlockTerminationSignals();
  if (!cpus.empty()) {
    absl::StatusOr<std::vector<int>> list = services::ParseCpuList(cpus);
    if (!list.ok()) return Fail("--cpus", list.status());
    if (absl::Status st = services::PinToCpus(*list); !st.ok()) return Fail("--cpus", st);
  }
  if (worker_id.empty()) worker_id = services::DefaultWorkerId("prefill");

  absl::StatusOr<std::unique_ptr<engine::Model>> model = engine::Model::Load(model_path);
  if (!model.ok()) return Fail(absl::StrCat("loading ", model_path), model.status());

  services::TransportChoice tc;
  tc.kind = transport;
  tc.name = worker_id;
  tc.ucx_tls = ucx_tls;
  absl::StatusOr<std::unique_ptr<transfer::KvTransport>> kv_transport =
      services::CreateTransport(tc);
  if (!kv_transport.ok()) return Fail("--transport", kv_transport.status());

  prefill::PrefillWorkerOptions wo;
  wo.model = std::shared_ptr<const engine::Model>(std::move(*model));
  wo.engine.threads = threads;
  wo.engine.ctx_size = ctx_size;
  wo.engine.max_seqs = max_seqs;
  wo.engine.kv_blocks = kv_blocks;
  wo.engine.block_size = block_size;
  wo.engine.max_batch_tokens = max_batch_tokens;
  wo.engine.kv_type = kv_type == "f16" ? kernels::DType::kF16 : kernels::DType::kF32;
  wo.worker_id = worker_id;
  wo.transport = kv_transport->get();
  wo.max_transfer_time = absl::Milliseconds(max_transfer_ms);
  absl::StatusOr<std::unique_ptr<prefill::PrefillWorker>> worker =
      prefill::PrefillWorker::Create(wo);
  if (!worker.ok()) return Fail("starting the prefill worker", worker.status());

  prefill::PrefillService service(worker->get());
  services::GrpcServerOptions so;
  so.host = host;
  so.port = port;
  so.services = {&service};
  absl::StatusOr<std::unique_ptr<services::GrpcServer>> server = services::GrpcServer::Start(so);
  if (!server.ok()) return Fail("starting the gRPC server", server.status());
  const int bound = (*server)->port();
  if (!port_file.empty()) {
    if (absl::Status st = services::WriteFileAtomically(port_file, absl::StrCat(bound, "\n"));
        !st.ok()) {
      return Fail("--port-file", st);
    }
  }
  const std::string advertised = services::JoinHostPort(
      advertise_host.empty() ? services::AdvertisedHost(host) : advertise_host, bound);
  std::printf("tandem-prefill: worker %s serving on %s: model %s, %d KV blocks, transport %s\n",
              worker_id.c_str(), (*server)->address().c_str(),
              std::filesystem::path(model_path).filename().c_str(), (*worker)->kv_blocks_total(),
              (*kv_transport)->capabilities().name.c_str());
  std::fflush(stdout);

  std::unique_ptr<services::RegistrationClient> registration;
  if (!router.empty()) {
    services::RegistrationOptions ro;
    ro.registry_address = router;
    ro.registration.set_worker_id(worker_id);
    ro.registration.set_role(v1::WORKER_ROLE_PREFILL);
    ro.registration.set_address(advertised);
    // The router matches models by file stem ("stories260K.gguf" serves "stories260K").
    ro.registration.set_model(std::filesystem::path(model_path).filename().string());
    ro.registration.set_kv_blocks_total((*worker)->kv_blocks_total());
    prefill::PrefillWorker* w = worker->get();
    ro.stats = [w] { return w->Stats(); };
    absl::StatusOr<std::unique_ptr<services::RegistrationClient>> r =
        services::RegistrationClient::Start(ro);
    if (!r.ok()) return Fail("--router", r.status());
    registration = std::move(*r);
  }

  const int sig = services::WaitForTerminationSignal();
  std::fprintf(stderr, "tandem-prefill: signal %d: draining (grace %d ms)\n", sig, grace_ms);
  if (registration) registration->Stop();  // the router stops sending new work first
  (*server)->Shutdown(absl::Milliseconds(grace_ms));
  server->reset();
  worker->reset();
  return 0;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) { return tandem::Main(argc, argv); }
