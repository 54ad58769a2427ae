// tandem-decode: the decode worker process. The only file that reads flags.
//
// Roles: --role decode (default) serves reservations for remote prefill (disaggregated mode)
// and also local-prefill requests. --role both registers as WORKER_ROLE_BOTH: the colocated
// worker. We chose to make the colocated worker this same binary rather than one process
// serving both gRPC services: a colocated request is a DecodeRequest with prefill_locally,
// prefilled by this worker's own scheduler in chunks batched with its running decodes, which is
// what colocated serving means (one engine, one batch). A separate PrefillWorker service here
// would need a second engine and KV pool competing for the same cores.
//
// Shutdown on SIGTERM/SIGINT: deregister from the router, stop accepting calls, let in-flight
// streams finish for up to --grace-ms, cancel the rest, exit 0.
#include <cstdio>
#include <filesystem>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "services/common/grpc_server.h"
#include "services/common/process_util.h"
#include "services/common/registration.h"
#include "services/common/transport_factory.h"
#include "services/decode/decode_service.h"

namespace tandem {
namespace {

int Fail(const std::string& what, const absl::Status& st) {
  std::fprintf(stderr, "tandem-decode: %s: %s\n", what.c_str(), st.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  CLI::App app{
      "tandem decode worker: holds the KV pool remote prefills write into, "
      "continuous-batches decoding, streams tokens over gRPC (tandem.v1.DecodeWorker)"};
  std::string model_path, host = "127.0.0.1", advertise_host, worker_id, router;
  std::string transport = "ucx", ucx_tls = "shm", cpus, port_file, role = "decode";
  std::string kv_type = "f32";
  int port = 0, threads = 1, kv_blocks = 0, ctx_size = 0, max_seqs = 8, block_size = 16;
  int max_batch_tokens = 512, grace_ms = 10000;
  uint32_t lease_ms = 10000, max_lease_ms = 600000;
  app.add_option("--model", model_path, "GGUF model file")->required();
  app.add_option("--host", host, "address to listen on (0.0.0.0: every interface)");
  app.add_option("--port", port, "port to listen on; 0 picks a free one (printed, --port-file)");
  app.add_option("--port-file", port_file, "write the bound port here once serving");
  app.add_option("--advertise-host", advertise_host,
                 "host the router should dial (default: --host; 127.0.0.1 for a wildcard)");
  app.add_option("--worker-id", worker_id, "id in the registry (default decode-HOST-PID)");
  app.add_option("--router", router, "registry (router) host:port to register with");
  app.add_option("--role", role, "decode, or both: the colocated worker")
      ->check(CLI::IsMember({"decode", "both"}));
  app.add_option("--threads", threads, "compute threads")->check(CLI::PositiveNumber);
  app.add_option("--kv-blocks", kv_blocks, "KV pool blocks (0: max-seqs full contexts)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--block-size", block_size, "tokens per KV block")->check(CLI::PositiveNumber);
  app.add_option("--kv-type", kv_type, "KV cache element type")
      ->check(CLI::IsMember({"f32", "f16"}));
  app.add_option("--ctx-size", ctx_size, "positions per sequence (0: min(model, 4096))")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-seqs", max_seqs, "sequences decoding at once")->check(CLI::PositiveNumber);
  app.add_option("--max-batch-tokens", max_batch_tokens, "tokens per engine step")
      ->check(CLI::PositiveNumber);
  app.add_option("--transport", transport, "KV transport: ucx, inproc (same process only), none")
      ->check(CLI::IsMember({"ucx", "inproc", "none"}));
  app.add_option("--ucx-tls", ucx_tls, "UCX transports: shm, tcp, all or a UCX_TLS list");
  app.add_option("--lease-ms", lease_ms, "reservation lease when a Reserve names none")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-lease-ms", max_lease_ms, "longest reservation lease granted")
      ->check(CLI::PositiveNumber);
  app.add_option("--grace-ms", grace_ms, "on SIGTERM, how long in-flight streams may finish")
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
  if (worker_id.empty()) worker_id = services::DefaultWorkerId("decode");

  absl::StatusOr<std::unique_ptr<engine::Model>> model = engine::Model::Load(model_path);
  if (!model.ok()) return Fail(absl::StrCat("loading ", model_path), model.status());

  std::unique_ptr<transfer::KvTransport> kv_transport;
  if (transport != "none") {
    services::TransportChoice tc;
    tc.kind = transport;
    tc.name = worker_id;
    tc.ucx_tls = ucx_tls;
    absl::StatusOr<std::unique_ptr<transfer::KvTransport>> t = services::CreateTransport(tc);
    if (!t.ok()) return Fail("--transport", t.status());
    kv_transport = std::move(*t);
  }

  decode::DecodeWorkerOptions wo;
  wo.model = std::shared_ptr<const engine::Model>(std::move(*model));
  wo.engine.threads = threads;
  wo.engine.ctx_size = ctx_size;
  wo.engine.max_seqs = max_seqs;
  wo.engine.kv_blocks = kv_blocks;
  wo.engine.block_size = block_size;
  wo.engine.max_batch_tokens = max_batch_tokens;
  wo.engine.kv_type = kv_type == "f16" ? kernels::DType::kF16 : kernels::DType::kF32;
  wo.worker_id = worker_id;
  wo.transport = kv_transport.get();
  wo.default_lease = absl::Milliseconds(lease_ms);
  wo.max_lease = absl::Milliseconds(std::max(lease_ms, max_lease_ms));
  absl::StatusOr<std::unique_ptr<decode::DecodeWorker>> worker = decode::DecodeWorker::Create(wo);
  if (!worker.ok()) return Fail("starting the decode worker", worker.status());

  decode::DecodeService service(worker->get());
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
  std::printf("tandem-decode: worker %s (%s) serving on %s: model %s, %d KV blocks, transport %s\n",
              worker_id.c_str(), role.c_str(), (*server)->address().c_str(),
              std::filesystem::path(model_path).filename().c_str(), (*worker)->kv_blocks_total(),
              kv_transport ? kv_transport->capabilities().name.c_str() : "none");
  std::fflush(stdout);

  std::unique_ptr<services::RegistrationClient> registration;
  if (!router.empty()) {
    services::RegistrationOptions ro;
    ro.registry_address = router;
    ro.registration.set_worker_id(worker_id);
    ro.registration.set_role(role == "both" ? v1::WORKER_ROLE_BOTH : v1::WORKER_ROLE_DECODE);
    ro.registration.set_address(advertised);
    // The router matches models by file stem ("stories260K.gguf" serves "stories260K").
    ro.registration.set_model(std::filesystem::path(model_path).filename().string());
    ro.registration.set_kv_blocks_total((*worker)->kv_blocks_total());
    decode::DecodeWorker* w = worker->get();
    ro.stats = [w] { return w->Stats(); };
    absl::StatusOr<std::unique_ptr<services::RegistrationClient>> r =
        services::RegistrationClient::Start(ro);
    if (!r.ok()) return Fail("--router", r.status());
    registration = std::move(*r);
  }

  const int sig = services::WaitForTerminationSignal();
  std::fprintf(stderr, "tandem-decode: signal %d: draining (grace %d ms)\n", sig, grace_ms);
  if (registration) registration->Stop();  // the router stops sending new work first
  (*server)->Shutdown(absl::Milliseconds(grace_ms));
  server->reset();
  worker->reset();
  return 0;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) { return tandem::Main(argc, argv); }
