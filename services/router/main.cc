// tandem-router: the cluster's front door. The only file of the router that reads flags.
//
//   tandem-router [--model M] [--port P] [--host H] [--policy least-load|round-robin|kv-aware]
//                 [--lease-ms L] [--max-inflight N] [--max-queue N] [--cpus LIST]
//                 [--port-file F] [--http-port Q (OpenAI-compatible HTTP; 0: off)]
//                 [--metrics-port M] [--slo-ttft-ms T] [--slo-itl-ms I]
//                 [--prefill-capacity-tps X] [--decode-capacity-tps Y] [--max-migrations N]
//
// Prometheus /metrics: on the HTTP port when there is one, and on --metrics-port.
//
// SIGTERM / SIGINT: stop accepting, give in-flight requests a grace period, exit 0.
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "services/common/process_util.h"
#include "services/common/tls.h"
#include "services/common/trace_flags.h"
#include "services/router/auth.h"
#include "services/router/log.h"
#include "services/router/router_server.h"

namespace {

int Fail(const absl::Status& st) {
  std::fprintf(stderr, "tandem-router: error: %s\n", st.ToString().c_str());
  return st.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Abseil as packaged checks every lock acquisition for lock-order cycles, a debugging aid
  // that cost 3% of the router's CPU at 1,000 req/s (docs/perf/router-overhead.md). The tests
  // keep it; the served process does not.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
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
  app.add_option("--model", o.model_path,
                 "GGUF model file (only its tokenizer and metadata are read); without it the "
                 "router learns the model from the first worker's model card");
  app.add_option("--model-id", o.model_id, "Model name clients use (default: file stem)");
  app.add_option("--host", o.host, "Address to listen on");
  app.add_option("--port", o.port, "gRPC port (0: any free port)");
  app.add_option("--http-port", http_port, "OpenAI-compatible HTTP port (0: no HTTP)");
  app.add_option("--ctx-size", o.ctx_size, "Context per sequence (0: min(model's, 4096))");
  app.add_option("--policy", policy,
                 "Worker selection: least-load, round-robin or kv-aware (prefill by cached prefix)");
  app.add_option("--tenant", o.tenant,
                 "Tenant requests are served as without --api-keys (namespaces prefix caching)");
  app.add_option("--lease-ms", lease_ms, "Worker lease: dropped without a heartbeat this long");
  app.add_option("--reserve-lease-ms", reserve_lease_ms, "Lease of a KV reservation");
  app.add_option("--timeout-ms", timeout_ms, "Deadline of requests that carry none");
  app.add_option("--retry-ms", retry_ms, "How long a request waits for room in full pools");
  app.add_option("--max-inflight", o.max_inflight, "Requests worked on at once");
  app.add_option("--max-queue", o.max_queue,
                 "Requests waiting beyond that (more: RESOURCE_EXHAUSTED)");
  int64_t max_prefill_backlog_ms = 0;
  app.add_option("--max-prefill-backlog-ms", max_prefill_backlog_ms,
                 "Hold requests in the router's priority queue while every prefilling worker "
                 "has more than this much predicted work (0: never hold)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--grace-ms", grace_ms, "On SIGTERM, time in-flight requests get to finish");
  app.add_option("--cpus", cpus, "Pin to these CPUs, e.g. 0,2-3");
  app.add_option("--port-file", port_file, "Write the bound port to this file once serving");
  app.add_flag("--verbose", o.verbose, "Log every request");
  tandem::services::TraceFlags trace_flags;
  tandem::services::AddTraceFlags(&app, &trace_flags);
  app.add_option("--max-migrations", o.max_migrations,
                 "Times a request whose decode stream breaks mid-way moves to another worker "
                 "(0: never)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--prefill-retries", o.prefill_retries,
                 "Prefill or KV transfer failures a request retries on other prefill workers "
                 "(0: fail on the first)")
      ->check(CLI::NonNegativeNumber);
  std::string api_keys, tenant_secret_file;
  app.add_option("--api-keys", api_keys,
                 "Require API keys: file of 'KEY TENANT [RPS [BURST]]' lines or JSON (docs/security.md)");
  app.add_option("--tenant-secret-file", tenant_secret_file,
                 "Secret that salts each tenant's KV block hashes (with --api-keys)");
  app.add_option("--max-message-bytes", o.max_message_bytes,
                 "Largest gRPC message / HTTP body accepted")
      ->check(CLI::Range(1024, 1 << 30));
  tandem::services::TlsOptions tls;
  tandem::services::AddTlsFlags(app, &tls);
  double slo_ttft_ms = 0, slo_itl_ms = 0, window_s = absl::ToDoubleSeconds(o.autoscale.window);
  app.add_option("--metrics-port", o.metrics_port,
                 "serve Prometheus metrics on http://HOST:PORT/metrics (0: off)");
  app.add_option("--slo-ttft-ms", slo_ttft_ms, "TTFT target (p90) for recommended_replicas");
  app.add_option("--slo-itl-ms", slo_itl_ms, "Inter-token latency target (p90)");
  app.add_option("--prefill-capacity-tps", o.autoscale.prefill_capacity_tps,
                 "Prompt tokens/s one prefill worker sustains (0: measured)");
  app.add_option("--decode-capacity-tps", o.autoscale.decode_capacity_tps,
                 "Output tokens/s one decode worker sustains (0: unknown)");
  app.add_option("--autoscale-window-s", window_s, "Observation window of the recommendation");
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
  o.max_prefill_backlog = absl::Milliseconds(max_prefill_backlog_ms);
  if (slo_ttft_ms < 0 || slo_itl_ms < 0 || window_s <= 0 || o.metrics_port < 0 ||
      o.metrics_port > 65535) {
    return Fail(absl::InvalidArgumentError(
        "--slo-ttft-ms and --slo-itl-ms must be >= 0, --autoscale-window-s > 0, "
        "--metrics-port in [0, 65535]"));
  }
  o.autoscale.slo_ttft_s = slo_ttft_ms / 1000.0;
  o.autoscale.slo_itl_s = slo_itl_ms / 1000.0;
  o.autoscale.window = absl::Seconds(window_s);
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
  // Before any server or channel exists: they all take the process's TLS settings.
  if (absl::Status st = tandem::services::SetProcessTls(tls); !st.ok()) return Fail(st);
  if (!api_keys.empty()) {
    std::string secret;
    if (!tenant_secret_file.empty()) {
      std::ifstream in(tenant_secret_file, std::ios::binary);
      if (!in) {
        return Fail(absl::NotFoundError(
            absl::StrCat("--tenant-secret-file ", tenant_secret_file, ": cannot read it")));
      }
      secret.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    auto auth = tandem::router::Authenticator::Load(api_keys, std::move(secret));
    if (!auth.ok()) return Fail(auth.status());
    o.auth = std::move(*auth);
  } else if (!tenant_secret_file.empty()) {
    return Fail(absl::InvalidArgumentError("--tenant-secret-file needs --api-keys"));
  }
  // Declared before the server, so it is closed after the server has stopped.
  absl::StatusOr<std::unique_ptr<tandem::trace::Tracer>> tracer =
      tandem::services::OpenTrace(trace_flags, "tandem-router");
  if (!tracer.ok()) return Fail(tracer.status());
  o.tracer = tracer->get();
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
