// tandem-router: the cluster's front door. The only file of the router that reads flags.
//
//   tandem-router --model M [--port P] [--host H] [--policy least-load|round-robin]
//                 [--lease-ms L] [--max-inflight N] [--max-queue N] [--cpus LIST]
//                 [--port-file F] [--http-port Q (OpenAI-compatible HTTP; 0: off)]
//
// SIGTERM / SIGINT: stop accepting, give in-flight requests a grace period, exit 0.
#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "services/common/process_util.h"
#include "services/router/log.h"
#include "services/router/router_server.h"

namespace {

int Fail(const absl::Status& st) {
  std::fprintf(stderr, "tandem-router: error: %s\n", st.ToString().c_str());
  return st.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  using tandem::router::RouterOptions;
  RouterOptions o;
  CLI::App app{"tandem-router: routes requests to prefill and decode workers"};
  int http_port = 0;
  int64_t lease_ms = absl::ToInt64Milliseconds(o.worker_lease);
  int64_t reserve_lease_ms = absl::ToInt64Milliseconds(o.reserve_lease);
  int64_t timeout_ms = absl::ToInt64Milliseconds(o.default_timeout);
  int64_t retry_ms = absl::ToInt64Milliseconds(o.retry_budget);
  int64_t grace_ms = 5000;
  std::string policy = "least-load", cpus, port_file;
  app.add_option("--model", o.model_path, "GGUF model file (its tokenizer is used)")->required();
  app.add_option("--model-id", o.model_id, "Model name clients use (default: file stem)");
  app.add_option("--host", o.host, "Address to listen on");
  app.add_option("--port", o.port, "gRPC port (0: any free port)");
  app.add_option("--http-port", http_port, "OpenAI-compatible HTTP port (0: no HTTP)");
  app.add_option("--ctx-size", o.ctx_size, "Context per sequence (0: min(model's, 4096))");
  app.add_option("--policy", policy, "Worker selection: least-load or round-robin");
  app.add_option("--lease-ms", lease_ms, "Worker lease: dropped without a heartbeat this long");
  app.add_option("--reserve-lease-ms", reserve_lease_ms, "Lease of a KV reservation");
  app.add_option("--timeout-ms", timeout_ms, "Deadline of requests that carry none");
  app.add_option("--retry-ms", retry_ms, "How long a request waits for room in full pools");
  app.add_option("--max-inflight", o.max_inflight, "Requests worked on at once");
  app.add_option("--max-queue", o.max_queue,
                 "Requests waiting beyond that (more: RESOURCE_EXHAUSTED)");
  app.add_option("--grace-ms", grace_ms, "On SIGTERM, time in-flight requests get to finish");
  app.add_option("--cpus", cpus, "Pin to these CPUs, e.g. 0,2-3");
  app.add_option("--port-file", port_file, "Write the bound port to this file once serving");
  app.add_flag("--verbose", o.verbose, "Log every request");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (absl::Status st = tandem::router::ParsePolicy(policy, &o.policy); !st.ok()) return Fail(st);
  o.worker_lease = absl::Milliseconds(lease_ms);
  o.reserve_lease = absl::Milliseconds(reserve_lease_ms);
  o.default_timeout = absl::Milliseconds(timeout_ms);
  o.retry_budget = absl::Milliseconds(retry_ms);
  // Before any thread starts, so that every thread inherits the signal mask and the affinity.
  tandem::services::BlockTerminationSignals();
  if (!cpus.empty()) {
    absl::StatusOr<std::vector<int>> list = tandem::services::ParseCpuList(cpus);
    if (!list.ok()) return Fail(list.status());
    if (absl::Status st = tandem::services::PinToCpus(*list); !st.ok()) return Fail(st);
  }

  if (http_port < 0 || http_port > 65535) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--http-port must be in [0, 65535], got ", http_port)));
  }
  tandem::router::HttpFrontOptions http;
  http.enabled = http_port > 0;
  http.port = http_port;
  auto server = tandem::router::RouterServer::Create(o, http);
  if (!server.ok()) return Fail(server.status());
  if (!port_file.empty()) {
    if (absl::Status st =
            tandem::services::WriteFileAtomically(port_file, absl::StrCat((*server)->port(), "\n"));
        !st.ok()) {
      return Fail(st);
    }
  }
  const int sig = tandem::services::WaitForTerminationSignal();
  tandem::router::Logf("signal %d: shutting down (grace %lld ms)", sig,
                       static_cast<long long>(grace_ms));
  (*server)->Shutdown(absl::Milliseconds(grace_ms));
  return 0;
}
