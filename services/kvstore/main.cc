// tandem-kvstore: the tiered KV store as a process. The only file of the kvstore that reads flags.
//
//   tandem-kvstore [--host H] [--port P] [--port-file F] [--dir SSD_DIR]
//                  [--device-mb N] [--host-mb N] [--ssd-mb N] [--block-kb N]
//                  [--high-watermark F] [--low-watermark F] [--ssd-min-hits N] [--no-io-uring]
//                  [--ssd-queue-depth N]
//                  [--metrics-port P] [--model-name NAME]
//                  [--transport ucx|inproc|none] [--ucx-tls shm|tcp|all|LIST] [--staging-mb N]
//                  [--stage-lease-ms N]
//   tandem-kvstore --dir SSD_DIR --ssd-bench-mb N [--block-kb N] [--no-io-uring]
//                  [--ssd-queue-depth N]
//
// Serves tandem.v1.KvStore (plus health and reflection). SSD is enabled when --dir is given and
// --ssd-mb is positive; blocks already in --dir are served again after a restart.
// --metrics-port serves Prometheus metrics (services/kvstore/metrics.h) on
// http://HOST:PORT/metrics, labelled model_name=--model-name and role="kvstore".
// --transport (as the workers take it) is the data plane: Read writes blocks into a requester's
// registered region, Stage/Commit take blocks a publisher wrote into the store's staging region
// (--staging-mb, cut into --block-kb slots). `none` leaves only the inline Put and Get.
// --ssd-bench-mb writes N MiB of --block-kb blocks through the SSD tier (its own files, O_DIRECT,
// io_uring, --ssd-queue-depth files in flight), reads them back, deletes them, prints one JSON
// line with the GB/s and exits; the kv_tiers benchmark compares it with fio on the same
// directory at the same block size and queue depth.
// SIGTERM / SIGINT: stop accepting, let in-flight calls finish, exit 0.
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "services/common/grpc_server.h"
#include "services/common/metrics.h"
#include "services/common/process_util.h"
#include "services/common/tls.h"
#include "services/common/trace_flags.h"
#include "services/common/transport_metrics.h"
#include "services/common/transport_factory.h"
#include "services/kvstore/data_plane.h"
#include "services/kvstore/kvstore_service.h"
#include "services/kvstore/metrics.h"
#include "services/kvstore/tiered_store.h"

namespace {

int Fail(const absl::Status& st);

int SsdBench(const tandem::kvstore::TieredStoreConfig& c, uint64_t mb) {
  using tandem::kvstore::SsdTier;
  using tandem::kvstore::Tier;
  tandem::kvstore::SsdTierOptions o;
  o.dir = c.ssd_dir;
  o.capacity_bytes = (mb + 64) << 20;
  o.use_io_uring = c.ssd_use_io_uring;
  o.queue_depth = c.ssd_queue_depth;
  auto tier = SsdTier::Open(o);
  if (!tier.ok()) {
    std::fprintf(stderr, "tandem-kvstore: ssd bench: %s\n", tier.status().ToString().c_str());
    return 1;
  }
  // Payloads that fill their files exactly: the bytes timed are the bytes on disk. Blocks go
  // in batches (PutMany / GetMany keep the queue depth in flight), 64 distinct payloads each.
  const uint64_t payload = c.device_slot_bytes - SsdTier::kHeaderBytes;
  const uint64_t n = std::max<uint64_t>(1, (mb << 20) / c.device_slot_bytes);
  constexpr uint64_t kBatch = 64;
  std::vector<std::vector<uint8_t>> data(std::min(n, kBatch), std::vector<uint8_t>(payload));
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& d : data) {
    for (auto& b : d) b = static_cast<uint8_t>((x = x * 6364136223846793005ull + 1) >> 56);
  }
  const uint64_t base = 0x5353440000000000ull;
  std::vector<Tier::BlockRef> refs;
  std::vector<uint64_t> hashes;
  const absl::Time t0 = absl::Now();
  for (uint64_t i = 0; i < n; i += kBatch) {
    refs.clear();
    for (uint64_t j = i; j < std::min(n, i + kBatch); ++j) {
      refs.push_back({base + j, data[j - i]});
    }
    for (const absl::Status& st : (*tier)->PutMany(refs)) {
      if (!st.ok()) return Fail(st);
    }
  }
  const absl::Time t1 = absl::Now();
  for (uint64_t i = 0; i < n; i += kBatch) {
    hashes.clear();
    for (uint64_t j = i; j < std::min(n, i + kBatch); ++j) hashes.push_back(base + j);
    for (const auto& got : (*tier)->GetMany(hashes)) {
      if (!got.ok()) return Fail(got.status());
    }
  }
  const absl::Time t2 = absl::Now();
  for (uint64_t i = 0; i < n; ++i) (void)(*tier)->Erase(base + i);
  const double bytes = double(n) * double(c.device_slot_bytes);
  std::printf("{\"blocks\": %llu, \"block_bytes\": %llu, \"queue_depth\": %d, "
              "\"write_gbps\": %.3f, \"read_gbps\": %.3f, \"io_uring\": %s}\n",
              static_cast<unsigned long long>(n),
              static_cast<unsigned long long>(c.device_slot_bytes), c.ssd_queue_depth,
              bytes / absl::ToDoubleSeconds(t1 - t0) / 1e9,
              bytes / absl::ToDoubleSeconds(t2 - t1) / 1e9,
              (*tier)->using_io_uring() ? "true" : "false");
  return 0;
}

// Allocates `bytes` in `chunk`-sized pieces, touches every page and frees them all: with the
// mallopt settings in main() the pages stay faulted in, in the one arena, for later blocks.
// Stops early once `stop` is set.
void WarmHeap(uint64_t bytes, uint64_t chunk, const std::atomic<bool>& stop) {
  if (chunk == 0) return;
  std::vector<std::unique_ptr<uint8_t[]>> pieces;
  for (uint64_t done = 0; done < bytes && !stop.load(std::memory_order_relaxed); done += chunk) {
    pieces.emplace_back(new uint8_t[chunk]);
    volatile uint8_t* p = pieces.back().get();  // volatile: the stores must happen
    for (uint64_t off = 0; off < chunk; off += 4096) p[off] = 0;
  }
}

int Fail(const absl::Status& st) {
  std::fprintf(stderr, "tandem-kvstore: error: %s\n", st.ToString().c_str());
  return st.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Block-sized buffers (hundreds of KiB) come and go with every Read, Put and tier hop. By
  // default glibc serves them from fresh mappings, from per-thread arenas (each gRPC handler
  // thread starts its own) and hands freed heap back to the kernel; faulting those pages in
  // again costs more than copying the block. One arena that keeps what it freed avoids that;
  // the footprint stays at its peak, which the tier capacities bound.
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  using tandem::kvstore::TieredStoreConfig;
  TieredStoreConfig c;
  std::string host = "127.0.0.1", port_file, cpus;
  int port = 0, metrics_port = 0;
  std::string model_name;
  uint64_t device_mb = 64, host_mb = 256, ssd_mb = 1024, block_kb = 64;
  double high = c.device.high_watermark, low = c.device.low_watermark;
  int64_t grace_ms = 2000;
  bool no_io_uring = false;
  std::string transport = "ucx", ucx_tls = "shm";
  uint64_t staging_mb = 64, ssd_bench_mb = 0;
  int64_t stage_lease_ms = 10000;
  CLI::App app{"tandem-kvstore: tiered KV block store (device, host, SSD)"};
  app.add_option("--host", host, "Address to listen on");
  app.add_option("--port", port, "gRPC port (0: any free port)");
  app.add_option("--port-file", port_file, "Write the bound port to this file once serving");
  app.add_option("--dir", c.ssd_dir, "SSD tier directory (no SSD tier without it)");
  app.add_option("--device-mb", device_mb, "Device tier capacity, MiB (0: no device tier; puts land in the host tier)");
  app.add_option("--host-mb", host_mb, "Host (DRAM) tier capacity, MiB (0: no host tier)");
  app.add_option("--ssd-mb", ssd_mb, "SSD tier capacity, MiB (0: no SSD tier)");
  app.add_option("--block-kb", block_kb, "Largest block, KiB (the device tier's slot size)");
  app.add_option("--high-watermark", high, "Usage fraction that starts demotion (every tier)");
  app.add_option("--low-watermark", low, "Usage fraction demotion brings a tier back to");
  app.add_option("--ssd-min-hits", c.ssd_min_hits,
                 "Hits a block needs before demotion writes it to SSD");
  app.add_flag("--no-io-uring", no_io_uring, "SSD I/O with pread/pwrite instead of io_uring");
  app.add_option("--ssd-queue-depth", c.ssd_queue_depth,
                 "SSD block files in flight at once in a multi-block read or write")
      ->check(CLI::Range(1, 256));
  app.add_option("--grace-ms", grace_ms, "On SIGTERM, time in-flight calls get to finish");
  app.add_option("--cpus", cpus, "Pin to these CPUs, e.g. 0,2-3");
  app.add_option("--metrics-port", metrics_port,
                 "Serve Prometheus metrics on http://HOST:PORT/metrics (0: off)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--model-name", model_name, "The model_name label of the metrics");
  app.add_option("--transport", transport,
                 "KV data plane: ucx, inproc (same process only) or none (inline bytes only)")
      ->check(CLI::IsMember({"ucx", "inproc", "none"}));
  app.add_option("--ucx-tls", ucx_tls, "UCX transports: shm, tcp, all or a UCX_TLS list");
  app.add_option("--staging-mb", staging_mb, "Staging region for published blocks, MiB");
  tandem::services::TraceFlags trace_flags;
  tandem::services::AddTraceFlags(&app, &trace_flags);
  app.add_option("--stage-lease-ms", stage_lease_ms,
                 "How long staged slots wait for their Commit")
      ->check(CLI::PositiveNumber);
  app.add_option("--ssd-bench-mb", ssd_bench_mb,
                 "Measure the SSD tier's write and read GB/s on --dir with this many MiB, then exit");
  tandem::services::TlsOptions tls;
  tandem::services::AddTlsFlags(app, &tls);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // The gRPC server below takes the process's TLS settings (files are read here).
  if (absl::Status st = tandem::services::SetProcessTls(tls); !st.ok()) return Fail(st);
  c.device = {device_mb << 20, high, low};
  c.host = {host_mb << 20, high, low};
  c.ssd = {c.ssd_dir.empty() ? 0 : ssd_mb << 20, high, low};
  c.device_slot_bytes = block_kb << 10;
  c.ssd_use_io_uring = !no_io_uring;

  if (ssd_bench_mb > 0) {
    if (c.ssd_dir.empty()) return Fail(absl::InvalidArgumentError("--ssd-bench-mb needs --dir"));
    return SsdBench(c, ssd_bench_mb);
  }
  tandem::services::BlockTerminationSignals();
  if (!cpus.empty()) {
    absl::StatusOr<std::vector<int>> list = tandem::services::ParseCpuList(cpus);
    if (!list.ok()) return Fail(list.status());
    if (absl::Status st = tandem::services::PinToCpus(*list); !st.ok()) return Fail(st);
  }
  // Fault in the heap the host tier and a Read's copies will use, once, rather than inside
  // the first requests' TTFT: touched and freed, it stays in the arena (above). On a thread of
  // its own, so the store serves (and passes its readiness probe) at once: faulting in GiBs
  // takes seconds to tens of seconds on a small node, and requests meanwhile only pay the
  // faults they would have paid anyway.
  std::atomic<bool> stop_warm{false};
  std::thread warm([bytes = (host_mb + staging_mb) << 20, slot = c.device_slot_bytes, &stop_warm] {
    WarmHeap(bytes, slot, stop_warm);
  });
  struct JoinAtExit {
    std::atomic<bool>& stop;
    std::thread& t;
    ~JoinAtExit() {
      stop = true;
      t.join();
    }
  } join_warm{stop_warm, warm};
  auto store = tandem::kvstore::TieredStore::Create(c);
  if (!store.ok()) return Fail(store.status());
  std::unique_ptr<tandem::transfer::KvTransport> kv_transport;
  std::unique_ptr<tandem::kvstore::KvDataPlane> data_plane;
  if (transport != "none") {
    tandem::services::TransportChoice tc;
    tc.kind = transport;
    tc.name = "kvstore";
    tc.ucx_tls = ucx_tls;
    auto t = tandem::services::CreateTransport(tc);
    if (!t.ok()) return Fail(t.status());
    kv_transport = std::move(*t);
    tandem::kvstore::DataPlaneOptions dpo;
    dpo.transport = kv_transport.get();
    dpo.staging_bytes = staging_mb << 20;
    dpo.slot_bytes = c.device_slot_bytes;
    dpo.stage_lease = absl::Milliseconds(stage_lease_ms);
    auto dp = tandem::kvstore::KvDataPlane::Create(dpo, store->get());
    if (!dp.ok()) return Fail(dp.status());
    data_plane = std::move(*dp);
    std::fprintf(stderr, "tandem-kvstore: data plane %s, %d staging slots of %llu bytes\n",
                 kv_transport->capabilities().name.c_str(), data_plane->num_slots(),
                 static_cast<unsigned long long>(c.device_slot_bytes));
  }
  absl::StatusOr<std::unique_ptr<tandem::trace::Tracer>> tracer =
      tandem::services::OpenTrace(trace_flags, "tandem-kvstore");
  if (!tracer.ok()) return Fail(tracer.status());
  // The tiers as opened (SSD blocks found after a restart), read before the server starts: from
  // then on the store is read only under its lock.
  for (int t = 0; t < tandem::kvstore::kNumTiers; ++t) {
    const auto* tier = (*store)->tier(static_cast<tandem::kvstore::TierKind>(t));
    if (tier == nullptr) continue;
    std::fprintf(stderr, "tandem-kvstore: tier %s: %s, %llu bytes, %lld blocks\n",
                 tier->label().c_str(), tier->name().c_str(),
                 static_cast<unsigned long long>(tier->Capacity()),
                 static_cast<long long>(tier->NumBlocks()));
  }
  tandem::kvstore::KvStoreService service(store->get(), data_plane.get(), tracer->get());
  tandem::services::GrpcServerOptions so;
  so.host = host;
  so.port = port;
  so.services = {&service};
  auto server = tandem::services::GrpcServer::Start(so);
  if (!server.ok()) return Fail(server.status());
  std::fprintf(stderr, "tandem-kvstore: serving on %s\n", (*server)->address().c_str());
  // Declared after the store: the server (and so every scrape) ends before the store does.
  tandem::services::Metrics metrics;
  std::unique_ptr<tandem::services::MetricsServer> metrics_server;
  if (metrics_port > 0) {
    tandem::kvstore::ExportKvStoreMetrics(store->get(), model_name, "kvstore", &metrics);
    tandem::services::ExportTransportMetrics(&metrics, model_name, "kvstore", kv_transport.get());
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
