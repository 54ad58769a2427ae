// FaultCluster: a tandem cluster of real processes on loopback for the fault-injection suite
// (tests/fault): one or more tandem-router, N tandem-prefill, M tandem-decode and optionally a
// tandem-kvstore, each a ChildProcess (tests/fakes/child_process.h) the test can signal, kill
// and restart by name. The test then talks to the router like any client and reads the
// workers' own Stats over gRPC to check resource counters (running, waiting, reservations, free
// KV blocks, integrity failures) against their idle baseline.
//
// Started directly rather than through `tandem cluster up`, because the faults need what the
// CLI does not offer: a kvstore on a fixed port that can be killed and restarted on the same
// SSD directory, and flags for one role only.
//
// Threading: Generate, Stats and the waits may be called from several threads at once; Start,
// Kill, Restart and the destructor from the test's main thread only.
// Ownership: owns its processes and its run directory (removed unless the test failed; then
// every process's log is printed instead).
// Errors: Start returns a Status naming the process that did not come up; calls to the router
// return the gRPC status in Completion; no helper aborts.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "tandem/v1/inference.grpc.pb.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "tests/fakes/child_process.h"

namespace tandem::testing {

// The real trained model the suite runs (tests skip without ../shared/models).
std::filesystem::path FaultModelPath();

class FaultCluster;

struct FaultClusterOptions {
  std::string name;  // part of the run directory's name
  int prefill = 1;
  int decode = 1;
  bool kvstore = false;  // prefill workers then get --kvstore
  int ctx_size = 2048;
  int lease_ms = 2000;  // router's worker lease
  std::vector<std::string> router_args, prefill_args, decode_args, kvstore_args;
  // Extra flags for one worker only, by name ("decode-0").
  std::map<std::string, std::vector<std::string>> worker_args;
  // Routers ("router", then "router-1", ...), each on its own port; every worker registers
  // with all of them (--router A,B,...). The client calls go to router 0 until UseRouter.
  int routers = 1;
  // Indexes of the routers started without --model (they learn it from the workers' cards).
  std::vector<int> routers_without_model;
  // The model every process serves (empty: FaultModelPath()).
  std::string model;
  // --role of the decode workers: "decode", or "both" (colocated: prefill 0 then suffices).
  std::string decode_role = "decode";
  // Expert parallelism: each worker of the role is a group of this many processes, rank 0
  // the worker ("decode-0") and the expert ranks "decode-0-ep1", ... (started once rank 0
  // serves; not workers: worker_names() leaves them out). 1: no groups.
  int prefill_ep = 1;
  int decode_ep = 1;
  // Runs after the routers (and the kvstore) serve, before any worker starts.
  std::function<void(FaultCluster&)> before_workers;
};

struct Completion {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  bool finished = false;
  tandem::v1::FinishReason reason = tandem::v1::FINISH_REASON_UNSPECIFIED;
  std::string prefill_worker, decode_worker;
  tandem::v1::Usage usage;
  tandem::v1::TtftBreakdown ttft;
  absl::Duration elapsed;
};

// A greedy request (temperature 0) for `prompt`.
tandem::v1::GenerateRequest GreedyRequest(const std::string& prompt, int max_tokens,
                                          bool ignore_eos = false);

// What `tandem generate --json` prints for the same greedy request (a separate process), cached
// per (prompt, max_tokens). status is not OK when the CLI failed.
Completion GreedyReference(const std::string& prompt, int max_tokens);

// Alive and not a zombie.
bool ProcessRunning(pid_t pid);
// VmRSS of a process in KiB (from /proc/PID/status), -1 when unreadable.
int64_t VmRssKb(pid_t pid);

// A plain HTTP/1.1 exchange with 127.0.0.1:port (Connection: close), for /metrics and the
// router's OpenAI front door. status 0 when the connection failed.
struct HttpResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
};
HttpResponse HttpCall(int port, const std::string& method, const std::string& path,
                      const std::string& body = "", absl::Duration timeout = absl::Seconds(30));

// The value of an unlabelled-or-labelled Prometheus sample named `name` (the first series whose
// line starts with it), from /metrics text; -1 when absent.
double MetricValue(const std::string& exposition, const std::string& name);

template <typename Pred>
bool WaitFor(absl::Duration timeout, Pred pred, absl::Duration every = absl::Milliseconds(20)) {
  for (const absl::Time end = absl::Now() + timeout;; absl::SleepFor(every)) {
    if (pred()) return true;
    if (absl::Now() >= end) return false;
  }
}

class FaultCluster {
 public:
  explicit FaultCluster(FaultClusterOptions o);
  // SIGTERM to every process still running (workers first), SIGKILL after a grace; prints the
  // logs when the test failed, else removes the run directory.
  ~FaultCluster();
  FaultCluster(const FaultCluster&) = delete;
  FaultCluster& operator=(const FaultCluster&) = delete;

  // Starts the router, the kvstore (if any) and the workers, and waits until every worker is
  // registered with the router and serving.
  absl::Status Start(absl::Duration timeout = absl::Seconds(40));

  // The router the client calls go to (router 0 unless UseRouter chose another).
  const std::string& router_address() const { return router_address_; }
  std::string router_address(int i) const { return router_addresses_.at(i); }
  // "router" for 0, "router-I" otherwise (process names).
  static std::string RouterName(int i);
  // Generate, Workers, Registered and WaitIdle talk to router i from now on.
  void UseRouter(int i);
  const std::filesystem::path& dir() const { return dir_; }
  // "router", "kvstore", "prefill-0", "decode-1", ...; null when unknown or stopped by Remove.
  ChildProcess* process(const std::string& name);
  pid_t pid(const std::string& name);
  // The gRPC port a process serves on (0 when unknown or it serves none).
  int port(const std::string& name) const;
  std::vector<std::string> worker_names() const;

  // Starts an expert rank again after it died (the same flags); returns once it runs.
  absl::Status RestartExpertRank(const std::string& name);

  // SIGKILLs the kvstore and reaps it; Restart starts it again on the same port and SSD
  // directory and waits until it serves.
  void KillKvstore();
  absl::Status RestartKvstore(absl::Duration timeout = absl::Seconds(20));
  int kvstore_port() const { return kvstore_port_; }

  // One Generate call streamed to its end.
  Completion Generate(const tandem::v1::GenerateRequest& req,
                      absl::Duration timeout = absl::Seconds(60));
  tandem::v1::Inference::Stub& inference() { return *inference_; }

  // A worker's own Stats (not the router's heartbeat copy).
  absl::StatusOr<tandem::v1::WorkerStats> Stats(const std::string& worker);
  absl::StatusOr<std::vector<tandem::v1::WorkerInfo>> Workers();
  bool Registered(const std::string& worker);

  // Waits until every named worker (default: all still running) is idle: nothing running,
  // waiting or reserved, every KV block free, and the router holds nothing in flight for it.
  // On timeout *why says which worker was not.
  bool WaitIdle(absl::Duration timeout, std::string* why,
                std::vector<std::string> workers = {});

 private:
  struct Proc {
    std::string name, role, binary;
    std::vector<std::string> args;
    std::string port_file;  // empty: the process serves no port (an expert rank)
    int port = 0;
    std::unique_ptr<ChildProcess> child;
  };
  absl::Status Spawn(Proc& p, absl::Time deadline);
  std::vector<std::string> WorkerArgs(const std::string& role, const std::string& name) const;
  const std::string& model() const;

  FaultClusterOptions o_;
  std::filesystem::path dir_;
  std::string router_address_;
  std::vector<std::string> router_addresses_;
  int kvstore_port_ = 0;
  int kvstore_starts_ = 0;
  std::vector<std::unique_ptr<Proc>> procs_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<tandem::v1::Inference::Stub> inference_;
  std::unique_ptr<tandem::v1::Registry::Stub> registry_;
};

}  // namespace tandem::testing
