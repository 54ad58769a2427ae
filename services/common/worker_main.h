// What the tandem-prefill and tandem-decode main()s share: the flags both workers take, the
// process setup that must happen before any thread starts, and the serving life cycle (gRPC
// server, port file, registration with the router, Prometheus /metrics on --metrics-port, drain
// on SIGTERM/SIGINT).
//
// Each main adds its own flags next to these, builds its worker from the parsed WorkerFlags,
// then hands its gRPC service to ServeWorker. Flag names, defaults and behaviour are the ones
// the two binaries always had; the few help texts and defaults that differ between them come
// in WorkerFlagSpec.
//
// Threading: PrepareWorkerProcess must run on the main thread before any other thread exists
// (signal mask and CPU affinity are inherited). ServeWorker blocks the calling thread until a
// termination signal arrives. Ownership: ServeWorker borrows the service, which must outlive it.
// Errors: PrepareWorkerProcess returns the failing flag's error; ServeWorker prints what failed
// (prefixed with the binary's name) and returns the process exit code.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/transfer/transfer.h"
#include "engine/runtime/engine.h"
#include "engine/spec/proposer.h"
#include "services/common/expert_group.h"
#include "services/common/metrics.h"
#include "services/common/nccl_join.h"
#include "services/common/tls.h"
#include "services/common/trace_flags.h"
#include "tandem/v1/worker.pb.h"

namespace CLI {
class App;
}
namespace grpc {
class Service;
}

namespace tandem::services {

struct WorkerFlags {
  std::string model_path;
  std::string host = "127.0.0.1";
  int port = 0;
  std::string port_file;
  std::string advertise_host;
  std::string worker_id;
  std::string router;  // HOST:PORT[,HOST:PORT...] (registry_set.h)
  int router_resolve_ms = 2000;
  int threads = 1;
  int kv_blocks = 0;
  int block_size = 16;
  std::string kv_type = "f32";
  std::string device = "cpu";  // cpu or cuda (engine and KV pool on the GPU)
  int ctx_size = 0;
  int max_seqs = 8;
  int max_batch_tokens = 512;
  // Speculative decoding (engine/spec/proposer.h): prefill and decode must agree (the reserve
  // handshake checks), decode runs it.
  std::string speculative = "off";
  int spec_tokens = 4;
  int spec_max_batch = 8;
  // With a draft model: "prefill" sends its prompt K/V with the target's, "decode" computes
  // them on the decode worker (and prefill does not load the draft).
  std::string draft_kv = "prefill";
  // The peaks MBU and MFU are measured against (services/common/step_report.h); 0: measured at
  // start on the CPU.
  double peak_read_gbs = 0;
  double peak_gflops = 0;
  std::string transport = "ucx";
  std::string ucx_tls = "shm";
  int grace_ms = 10000;
  std::string cpus;
  int metrics_port = 0;  // 0: no /metrics endpoint
  TlsOptions tls;        // --tls-*: every gRPC server and client of the process (tls.h)
  TraceFlags trace;      // --trace, --trace-max-mb (trace_flags.h)
  // Set only by the test twin tandem-prefill-test-hooks (tests/fault/prefill_test_hooks.h):
  // corrupt one bit of every Nth KV write this worker sends
  // (common/transfer/fault_injection.h). 0: off.
  int test_fault_flip_bit_every = 0;
  // Expert parallelism (expert_group.h): this worker is rank ep_rank of a group of ep_size
  // processes. Rank 0 is the worker the router sees; ranks >= 1 hold only experts and join
  // rank 0 at ep_leader (HOST:PORT, its gRPC address).
  int ep_size = 1;
  int ep_rank = 0;
  std::string ep_leader;
  std::string expert_placement;  // a `tandem place-experts` file; empty: contiguous
  int ep_timeout_ms = 10000;     // every exchange between the ranks
  // The liveness watchdog (ServeWorker): an engine loop on one turn of work for longer than
  // this is wedged; 0: off.
  int stall_ms = 30000;
};

// How one binary words and bounds the shared flags.
struct WorkerFlagSpec {
  std::string role;  // "decode" or "prefill": the default worker id's prefix
  int default_max_seqs = 8;
  std::vector<std::string> transports = {"ucx", "inproc"};  // --transport choices
  std::string transport_help;
  std::string kv_blocks_help;
  std::string block_size_help = "tokens per KV block";
  std::string kv_type_help = "KV cache element type";
  std::string max_seqs_help;
  std::string max_batch_tokens_help = "tokens per engine step";
  std::string grace_help;
};

// Registers the shared flags on `app`, writing into `flags` when it parses.
void AddWorkerFlags(CLI::App& app, WorkerFlags* flags, const WorkerFlagSpec& spec);

// After parsing, before any thread starts: blocks SIGTERM/SIGINT for WaitForTerminationSignal,
// pins to --cpus, and fills in the default worker id ("<role>-HOST-PID").
absl::Status PrepareWorkerProcess(const WorkerFlagSpec& spec, WorkerFlags* flags);

// Whether --device can be served here, before the model is loaded: FAILED_PRECONDITION
// "device cuda: no CUDA device is visible ..." (or "... built without CUDA") for --device cuda
// on a machine or build without a GPU.
absl::Status CheckWorkerDevice(const WorkerFlags& flags);

// The placement --ep-size and --expert-placement describe for the --model file's shape (read
// from its header, before the weights are loaded).
absl::StatusOr<engine::ExpertPlacement> PlacementFromFlags(const WorkerFlags& flags);

// The worker's model, and with --ep-size > 1 its expert group: the model then holds only rank
// 0's experts, and the group (borrowing `transport`) computes the rest on the other ranks; give
// it to the engine (EngineOptions::expert_peers) and serve it (ServeOptions::extra_services,
// ready). INVALID_ARGUMENT for EP flags that do not fit (a dense model, no transport, ...).
struct WorkerModel {
  std::unique_ptr<engine::Model> model;
  std::unique_ptr<ExpertGroup> group;
};
absl::StatusOr<WorkerModel> LoadWorkerModel(const WorkerFlags& flags,
                                            transfer::KvTransport* transport);

// The engine options the shared flags describe.
engine::EngineOptions EngineOptionsFromFlags(const WorkerFlags& flags);
// --speculative, --spec-tokens and --spec-max-batch; INVALID_ARGUMENT as engine::ParseSpeculative
// says. A draft model is loaded later, by the decode worker (DecodeWorker::Create).
absl::StatusOr<engine::SpeculativeOptions> SpeculativeFromFlags(const WorkerFlags& flags);
// --peak-read-gbs and --peak-gflops as given; with measure set, the worker measures those left
// at 0 in the background (StepReporter::MeasurePeaksInBackground). A GPU worker's peaks are only
// what the flags give.
engine::DevicePeaks WorkerPeaksFromFlags(const WorkerFlags& flags, bool* measure);

// The KV transport --transport and --ucx-tls name; null for "none". For nccl the worker's
// descriptors name its advertised --host/--port (a decode worker needs a fixed --port), and
// `join_handler` (when given) gets what its JoinKvGroup RPC must call.
absl::StatusOr<std::unique_ptr<transfer::KvTransport>> TransportFromFlags(
    const WorkerFlags& flags, KvJoinHandler* join_handler = nullptr);

struct ServeOptions {
  std::string binary;      // "tandem-decode": prefixes every line printed
  std::string role_label;  // printed after the worker id when not empty, e.g. "decode"
  grpc::Service* service = nullptr;
  v1::WorkerRole role = v1::WORKER_ROLE_UNSPECIFIED;
  int32_t kv_blocks_total = 0;
  std::string transport_name;  // printed
  std::function<v1::WorkerStats()> stats;
  // Served on --host:--metrics-port when that is not 0; borrowed, must outlive ServeWorker.
  Metrics* metrics = nullptr;
  // Work accepted that no call has claimed yet (decode: reservations awaiting their Decode).
  // While it is above 0 a draining worker keeps accepting calls, so the Decode of a reservation
  // the router made just before the worker deregistered is served, not refused. Empty: none.
  // Called on the signal-waiting thread; must be thread-safe.
  std::function<int()> pending_work;
  // More services on the same server (an expert group's). Borrowed.
  std::vector<grpc::Service*> extra_services;
  // Whether the worker can serve now (an expert group: every rank is in). Empty: always. While
  // false the worker is not registered with the routers and its health is NOT_SERVING; it
  // registers when this turns true, and deregisters when it turns false again. Polled every
  // 50 ms on the signal-waiting thread; must be thread-safe.
  std::function<bool()> ready;
  // Runs when the drain begins, before the server stops (ends an expert group's Join streams).
  std::function<void()> on_drain;
  // How long the engine loop has been on its current turn of work (the worker's
  // EngineBusyFor); empty: no watchdog. Polled with `ready`; must be thread-safe.
  std::function<absl::Duration()> engine_busy_for;
};

// The health service the watchdog reports on (besides the server's own ""): the liveness probe's.
inline constexpr char kLivenessService[] = "liveness";

// Serves `o.service` and the model's card (model_card.h: a router without the model file learns the
// model from it) on --host/--port (with health and reflection); with --metrics-port also serves
// o.metrics on http://--host:PORT/metrics, from before the port file is written until after the
// drain. Writes --port-file once serving, prints the serving line, registers with every router
// --router names (re-resolved every --router-resolve-ms), then waits for SIGTERM/SIGINT. Then it
// drains, all within --grace-ms: deregisters (the router stops choosing it), keeps accepting calls
// briefly for those the router chose it for before that and while o.pending_work() > 0, then stops
// accepting, lets in-flight calls finish, cancels what is left at the deadline and returns 0.
// Returns 1 after printing "<binary>: <what>: <error>" when the model card, the server, the metrics
// endpoint, the port file or the registration cannot start. With o.ready, registration follows it.
// Liveness watchdog (with o.engine_busy_for and --stall-ms > 0): while the engine loop has been on
// one turn for longer than --stall-ms, both "" and kLivenessService say NOT_SERVING and the worker
// is deregistered, so the router stops choosing it and a liveness probe on kLivenessService has
// the pod restarted; should the turn end after all, it serves and registers again.
int ServeWorker(const WorkerFlags& flags, const ServeOptions& o);

// Serves an expert group (when there is one) through `so`: its Join service, readiness and
// drain.
void ServeExpertGroup(ExpertGroup* group, ServeOptions* so);

// Prints "<binary>: <what>: <status>" to stderr and returns 1, the exit code.
int FailWorker(const std::string& binary, const std::string& what, const absl::Status& st);

}  // namespace tandem::services
