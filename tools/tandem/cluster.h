// `tandem cluster up|down|status|add|remove`: a local cluster of real processes on loopback.
//
// `up` starts R tandem-router (the deployed shape: any router serves, any one may die), a tandem-
// kvstore (unless --kvstore 0; no device tier, a host tier, the workers' KV transport), then N
// tandem-prefill (with --kvstore), M tandem-decode and K colocated (tandem-decode --role both)
// workers, found next to the tandem binary; every worker gets every router in --router. Router 0
// takes --router-port and --http-port; router i > 0 a free gRPC port and, when --http-port Q is
// set, HTTP port Q + i. Each process logs to RUN_DIR/<name>.log and has RUN_DIR/<name>.pid;
// RUN_DIR/cluster.json describes the cluster (model, router address, every process with its pid,
// port, CPUs and command line, and the settings `add` reuses). Workers listen on port 0 and report
// their port through RUN_DIR/<name>.port. `up` returns once every router answers grpc.health.v1
// SERVING and every worker has registered with every router (polled through Registry.ListWorkers);
// on failure or timeout it stops everything it started and names the logs, quoting the end of the
// guilty one. With pinning, each process is bound (sched_setaffinity before exec) to CPUs handed
// out round-robin from this process's allowed set: 1 per router and for the kvstore, `threads` per
// worker.
//
// `down` sends SIGTERM to the workers (they deregister, then drain), then to the routers and the
// kvstore, waits up to a grace period, SIGKILLs what is left and removes the pid and port files. A
// pid is only signalled while /proc shows it running the binary recorded for it, so a recycled pid
// is never hit. `add` starts one more worker with the cluster's settings and waits for its
// registration; `remove` stops one worker the same way `down` does.
//
// Threading: single-threaded command-line code. Errors: absl::Status with messages naming the file,
// process or log to look at.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/common/tls.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::tools {

struct ClusterUpOptions {
  std::string model;
  int prefill = 1;
  int decode = 1;
  int colocated = 0;
  // Expert parallelism (MoE models): each decode and colocated worker is a group of `ep`
  // processes, each prefill worker one of `prefill_ep`; rank 0 is the worker ("decode-0"), the
  // others hold experts only ("decode-0-ep1", ...). 1: no groups.
  int ep = 1;
  int prefill_ep = 1;
  std::string dir;
  int routers = 1;      // router processes; every worker registers with all of them
  int router_port = 0;  // the first router's gRPC port (0: a free port); the others: free ports
  int http_port = 0;    // the first router's HTTP port (0: none); router i gets http_port + i
  bool kvstore = true;  // start a tandem-kvstore (prefill workers get --kvstore)
  int kvstore_host_mb = 64;  // its host-tier capacity (no device tier, no SSD tier)
  int threads = 1;      // compute threads per worker
  bool pin = false;
  std::string transport = "ucx";  // KV transport of prefill and decode workers: ucx, inproc
  std::string ucx_tls = "shm";
  std::string policy = "least-load";
  int lease_ms = 0;                      // router's worker lease; 0: its default
  int ctx_size = 0;                      // 0: the engine's default, for router and workers alike
  int kv_blocks = 0;                     // decode KV pool; 0: the worker's default
  int max_seqs = 0;                      // decode batch size; 0: the worker's default
  std::vector<std::string> router_args;  // extra flags, passed verbatim
  std::vector<std::string> worker_args;
  // --speculative and --spec-tokens of every prefill, decode and colocated worker (they must
  // agree); "off" leaves the flags out.
  std::string speculative = "off";
  int spec_tokens = 4;
  // --tls-* for every process of the cluster (and this tool's own health checks): appended to
  // router_args and worker_args.
  services::TlsOptions tls;
  // Every process (and any added later) writes a Chrome/Perfetto trace, <trace_dir>/<name>.json
  // (`tandem trace merge` joins them); empty: no traces.
  std::string trace_dir;
  std::string bin_dir;  // empty: the folder of the running tandem binary
  absl::Duration ready_timeout = absl::Seconds(60);
};

absl::Status ClusterUp(const ClusterUpOptions& o);
absl::Status ClusterDown(const std::string& dir, absl::Duration grace = absl::Seconds(15));
absl::Status ClusterStatus(const std::string& dir, bool json);

struct ClusterAddOptions {
  std::string dir;
  std::string role;  // prefill, decode or colocated
  std::string name;  // empty: <role>-<next index>
  absl::Duration ready_timeout = absl::Seconds(60);
};
absl::Status ClusterAdd(const ClusterAddOptions& o);
absl::Status ClusterRemove(const std::string& dir, const std::string& name,
                           absl::Duration grace = absl::Seconds(15));

// grpc.health.v1.Health/Check of the whole server (service "") or of a named health service
// (under 128 bytes): true when SERVING. An unreachable server is UNAVAILABLE (or
// DEADLINE_EXCEEDED); a service the server does not know is NOT_FOUND.
absl::StatusOr<bool> CheckHealth(const std::string& address, absl::Duration timeout,
                                 const std::string& service = "");

// Registry.ListWorkers of one router.
absl::StatusOr<std::vector<v1::WorkerInfo>> ListWorkers(const std::string& router,
                                                        absl::Duration timeout);

}  // namespace tandem::tools
