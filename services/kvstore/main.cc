// tandem-kvstore: the tiered KV store as a process. The only file of the kvstore that reads flags.
//
//   tandem-kvstore [--host H] [--port P] [--port-file F] [--dir SSD_DIR]
//                  [--device-mb N] [--host-mb N] [--ssd-mb N] [--block-kb N]
//                  [--high-watermark F] [--low-watermark F] [--ssd-min-hits N] [--no-io-uring]
//                  [--metrics-port P] [--model-name NAME]
//
// Serves tandem.v1.KvStore (plus health and reflection). SSD is enabled when --dir is given and
// --ssd-mb is positive; blocks already in --dir are served again after a restart.
// --metrics-port serves Prometheus metrics (services/kvstore/metrics.h) on
// http://HOST:PORT/metrics, labelled model_name=--model-name and role="kvstore".
// SIGTERM / SIGINT: stop accepting, let in-flight calls finish, exit 0.
#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "services/common/grpc_server.h"
#include "services/common/metrics.h"
#include "services/common/process_util.h"
#include "services/kvstore/kvstore_service.h"
#include "services/kvstore/metrics.h"
#include "services/kvstore/tiered_store.h"

namespace {

int Fail(const absl::Status& st) {
  std::fprintf(stderr, "tandem-kvstore: error: %s\n", st.ToString().c_str());
  return st.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  using tandem::kvstore::TieredStoreConfig;
  TieredStoreConfig c;
  std::string host = "127.0.0.1", port_file, cpus;
  int port = 0, metrics_port = 0;
  std::string model_name;
  uint64_t device_mb = 64, host_mb = 256, ssd_mb = 1024, block_kb = 64;
  double high = c.device.high_watermark, low = c.device.low_watermark;
  int64_t grace_ms = 2000;
  bool no_io_uring = false;
  CLI::App app{"tandem-kvstore: tiered KV block store (device, host, SSD)"};
  app.add_option("--host", host, "Address to listen on");
  app.add_option("--port", port, "gRPC port (0: any free port)");
  app.add_option("--port-file", port_file, "Write the bound port to this file once serving");
  app.add_option("--dir", c.ssd_dir, "SSD tier directory (no SSD tier without it)");
  app.add_option("--device-mb", device_mb, "Device tier capacity, MiB");
  app.add_option("--host-mb", host_mb, "Host (DRAM) tier capacity, MiB (0: no host tier)");
  app.add_option("--ssd-mb", ssd_mb, "SSD tier capacity, MiB (0: no SSD tier)");
  app.add_option("--block-kb", block_kb, "Largest block, KiB (the device tier's slot size)");
  app.add_option("--high-watermark", high, "Usage fraction that starts demotion (every tier)");
  app.add_option("--low-watermark", low, "Usage fraction demotion brings a tier back to");
  app.add_option("--ssd-min-hits", c.ssd_min_hits,
                 "Hits a block needs before demotion writes it to SSD");
  app.add_flag("--no-io-uring", no_io_uring, "SSD I/O with pread/pwrite instead of io_uring");
  app.add_option("--grace-ms", grace_ms, "On SIGTERM, time in-flight calls get to finish");
  app.add_option("--cpus", cpus, "Pin to these CPUs, e.g. 0,2-3");
  app.add_option("--metrics-port", metrics_port,
                 "Serve Prometheus metrics on http://HOST:PORT/metrics (0: off)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--model-name", model_name, "The model_name label of the metrics");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  c.device = {device_mb << 20, high, low};
  c.host = {host_mb << 20, high, low};
  c.ssd = {c.ssd_dir.empty() ? 0 : ssd_mb << 20, high, low};
  c.device_slot_bytes = block_kb << 10;
  c.ssd_use_io_uring = !no_io_uring;

  tandem::services::BlockTerminationSignals();
  if (!cpus.empty()) {
    absl::StatusOr<std::vector<int>> list = tandem::services::ParseCpuList(cpus);
    if (!list.ok()) return Fail(list.status());
    if (absl::Status st = tandem::services::PinToCpus(*list); !st.ok()) return Fail(st);
  }
  auto store = tandem::kvstore::TieredStore::Create(c);
  if (!store.ok()) return Fail(store.status());
  tandem::kvstore::KvStoreService service(store->get());
  tandem::services::GrpcServerOptions so;
  so.host = host;
  so.port = port;
  so.services = {&service};
  auto server = tandem::services::GrpcServer::Start(so);
  if (!server.ok()) return Fail(server.status());
  for (int t = 0; t < tandem::kvstore::kNumTiers; ++t) {
    const auto* tier = (*store)->tier(static_cast<tandem::kvstore::TierKind>(t));
    if (tier == nullptr) continue;
    std::fprintf(stderr, "tandem-kvstore: tier %s: %s, %llu bytes, %lld blocks\n",
                 tandem::kvstore::TierKindName(tier->kind()), tier->name().c_str(),
                 static_cast<unsigned long long>(tier->Capacity()),
                 static_cast<long long>(tier->NumBlocks()));
  }
  std::fprintf(stderr, "tandem-kvstore: serving on %s\n", (*server)->address().c_str());
  // Declared after the store: the server (and so every scrape) ends before the store does.
  tandem::services::Metrics metrics;
  std::unique_ptr<tandem::services::MetricsServer> metrics_server;
  if (metrics_port > 0) {
    tandem::kvstore::ExportKvStoreMetrics(store->get(), model_name, "kvstore", &metrics);
    auto ms = tandem::services::MetricsServer::Start(host, metrics_port, &metrics);
    if (!ms.ok()) return Fail(ms.status());
    metrics_server = std::move(*ms);
    std::fprintf(stderr, "tandem-kvstore: metrics on %s\n", metrics_server->url().c_str());
  }
  if (!port_file.empty()) {
    if (absl::Status st =
            tandem::services::WriteFileAtomically(port_file, absl::StrCat((*server)->port(), "\n"));
        !st.ok()) {
      return Fail(st);
    }
  }
  const int sig = tandem::services::WaitForTerminationSignal();
  std::fprintf(stderr, "tandem-kvstore: signal %d: shutting down\n", sig);
  (*server)->Shutdown(absl::Milliseconds(grace_ms));
  return 0;
}
