// kv_transfer_bench: bandwidth and latency of the UCX KvTransport between two processes.
//
// The program starts a copy of itself as the receiver (--role receiver), which registers a
// region and prints its descriptor on stdout; this process then writes into it:
//   * "size" pattern: for each message size, a stream of single-op writes with `window` writes
//     in flight (what ucx_perftest's *_bw tests measure), reported in GB/s (1e9 B/s);
//   * "kv" pattern: a prefill->decode KV handoff: `layers` layers x {K, V} x `blocks` blocks of
//     `block_bytes`, scattered over a pool of blocks on both sides, one WriteAsync per layer
//     (as layers finish), reported as median handoff latency and GB/s.
// Each result is one line starting with RESULT (key=value pairs), for bench/kv_transfer/run.sh.
//
// Example: kv_transfer_bench --tls shm --alloc 1 --sizes 65536,1048576,67108864
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/transfer/transfer.h"
#include "common/transfer/ucx/ucx_transport.h"

extern char** environ;

namespace tandem::transfer {
namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string role = "sender";
  std::string tls = "shm";
  std::string mode = "auto";  // auto | put | am
  bool alloc = true;          // receiver region from AllocateRegion (shared memory)
  std::vector<uint64_t> sizes = {64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  uint64_t bytes_per_size = 1ull << 30;  // data moved per size (bounded by min/max iters)
  int window = 8;
  int ops_per_write = 1;  // 0: enough ops to move ~4 MiB per WriteAsync (at most 64)
  bool kv = true;
  int layers = 16;
  int blocks = 16;
  uint64_t block_bytes = 64 << 10;
  uint64_t pool_blocks = 2048;
  int handoffs = 30;
  uint64_t region_bytes = 0;  // receiver only
  std::string progress = "adaptive";  // adaptive | blocking | polling
  uint64_t am_rndv_threshold = 64 << 10;
  std::string ucx_config;  // KEY=VALUE[,KEY=VALUE...] passed to ucp_config_modify
  bool inline_writes = true;  // UcxTransportOptions::inline_writes (0: always via the thread)
};

std::vector<uint64_t> ParseList(const char* s) {
  std::vector<uint64_t> out;
  while (*s != '\0') {
    char* end = nullptr;
    out.push_back(std::strtoull(s, &end, 10));
    s = *end == ',' ? end + 1 : end;
    if (end == nullptr || (*end != ',' && *end != '\0')) break;
  }
  return out;
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--role") f.role = v;
    else if (k == "--tls") f.tls = v;
    else if (k == "--mode") f.mode = v;
    else if (k == "--alloc") f.alloc = std::strcmp(v, "1") == 0;
    else if (k == "--sizes") f.sizes = ParseList(v);
    else if (k == "--bytes-per-size") f.bytes_per_size = std::strtoull(v, nullptr, 10);
    else if (k == "--window") f.window = std::atoi(v);
    else if (k == "--ops-per-write") f.ops_per_write = std::atoi(v);
    else if (k == "--kv") f.kv = std::strcmp(v, "1") == 0;
    else if (k == "--layers") f.layers = std::atoi(v);
    else if (k == "--blocks") f.blocks = std::atoi(v);
    else if (k == "--block-bytes") f.block_bytes = std::strtoull(v, nullptr, 10);
    else if (k == "--pool-blocks") f.pool_blocks = std::strtoull(v, nullptr, 10);
    else if (k == "--handoffs") f.handoffs = std::atoi(v);
    else if (k == "--region-bytes") f.region_bytes = std::strtoull(v, nullptr, 10);
    else if (k == "--progress") f.progress = v;
    else if (k == "--am-rndv-threshold") f.am_rndv_threshold = std::strtoull(v, nullptr, 10);
    else if (k == "--ucx-config") f.ucx_config = v;
    else if (k == "--inline") f.inline_writes = std::strcmp(v, "1") == 0;
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  return f;
}

std::unique_ptr<KvTransport> MakeTransport(const Flags& f) {
  UcxTransportOptions o;
  o.transports = f.tls;
  if (f.mode == "put") o.write_mode = UcxTransportOptions::WriteMode::kPut;
  if (f.mode == "am") o.write_mode = UcxTransportOptions::WriteMode::kActiveMessage;
  if (f.progress == "blocking") o.progress_mode = UcxTransportOptions::ProgressMode::kBlocking;
  if (f.progress == "polling") o.progress_mode = UcxTransportOptions::ProgressMode::kPolling;
  o.am_rndv_threshold = f.am_rndv_threshold;
  o.inline_writes = f.inline_writes;
  std::string cfg = f.ucx_config;
  while (!cfg.empty()) {
    size_t comma = cfg.find(',');
    std::string kv = cfg.substr(0, comma);
    size_t eq = kv.find('=');
    if (eq != std::string::npos) o.ucx_config.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
    cfg = comma == std::string::npos ? "" : cfg.substr(comma + 1);
  }
  auto t = CreateUcxTransport(o);
  if (!t.ok()) {
    std::fprintf(stderr, "transport: %s\n", std::string(t.status().ToString()).c_str());
    std::exit(1);
  }
  return std::move(*t);
}

int RunReceiver(const Flags& f) {
  auto t = MakeTransport(f);
  std::vector<uint8_t> heap;
  RegionDescriptor d;
  if (f.alloc) {
    auto a = t->AllocateRegion(f.region_bytes);
    if (!a.ok()) {
      std::fprintf(stderr, "receiver: %s\n", std::string(a.status().ToString()).c_str());
      return 1;
    }
    std::memset(a->base, 0, f.region_bytes);  // fault the pages in before timing
    d = a->descriptor;
  } else {
    heap.assign(f.region_bytes, 0);
    auto r = t->RegisterRegion(heap.data(), heap.size());
    if (!r.ok()) {
      std::fprintf(stderr, "receiver: %s\n", std::string(r.status().ToString()).c_str());
      return 1;
    }
    d = *r;
  }
  std::string wire = d.Serialize();
  for (unsigned char c : wire) std::printf("%02x", c);
  std::printf("\n");
  std::fflush(stdout);
  char buf[64];
  while (std::fgets(buf, sizeof(buf), stdin) != nullptr) {
  }
  TransportStats s = t->stats();
  std::fprintf(stderr, "receiver: bytes_received=%llu\n",
               static_cast<unsigned long long>(s.bytes_received));
  return 0;
}

// Limits in-flight writes to `window` and waits for all of them.
class Window {
 public:
  explicit Window(int size) : size_(size) {}
  std::function<void(absl::Status)> Acquire() {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(
        +[](Window* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->inflight_ < w->size_; },
        this));
    ++inflight_;
    return [this](absl::Status s) {
      absl::MutexLock l(&mu_);
      --inflight_;
      if (!s.ok() && error_.ok()) error_ = s;
    };
  }
  absl::Status Drain() {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(
        +[](Window* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->inflight_ == 0; },
        this));
    return error_;
  }

 private:
  absl::Mutex mu_;
  int size_;
  int inflight_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

void Fail(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "%s failed: %s\n", what, std::string(s.ToString()).c_str());
  std::exit(1);
}

void BenchSizes(const Flags& f, KvTransport& t, const RegionDescriptor& d,
                const std::vector<uint8_t>& src) {
  const auto deadline = std::chrono::seconds(60);
  for (uint64_t size : f.sizes) {
    int ops = f.ops_per_write > 0
                  ? f.ops_per_write
                  : static_cast<int>(std::clamp<uint64_t>((4 << 20) / size, 1, 64));
    int iters = static_cast<int>(std::clamp<uint64_t>(f.bytes_per_size / size / ops, 16, 4000));
    std::vector<WriteOp> batch(ops, WriteOp{src.data(), size, 0});
    int warmup = std::max(2, iters / 10);
    Window w(f.window);
    Clock::time_point start;
    for (int i = 0; i < warmup + iters; ++i) {
      if (i == warmup) {
        absl::Status s = w.Drain();
        if (!s.ok()) Fail(s, "write");
        start = Clock::now();
      }
      // Like ucx_perftest: the same source and destination bytes every time (one write moves
      // `ops` messages).
      t.WriteAsync(d, batch, Clock::now() + deadline, w.Acquire());
    }
    absl::Status s = w.Drain();
    if (!s.ok()) Fail(s, "write");
    double secs = Seconds(Clock::now() - start);
    // Latency of one blocking write of this size (median of a few).
    std::vector<double> lat;
    for (int i = 0; i < 15; ++i) {
      auto t0 = Clock::now();
      absl::Status ws = t.Write(d, {{src.data(), size, 0}}, std::chrono::seconds(60));
      if (!ws.ok()) Fail(ws, "write");
      lat.push_back(Seconds(Clock::now() - t0) * 1e6);
    }
    std::sort(lat.begin(), lat.end());
    std::printf("RESULT pattern=size tls=%s mode=%s alloc=%d size=%llu ops=%d iters=%d "
                "gbps=%.3f lat_us=%.1f\n",
                f.tls.c_str(), f.mode.c_str(), f.alloc ? 1 : 0,
                static_cast<unsigned long long>(size), ops, iters,
                size * double(ops) * iters / secs / 1e9, lat[lat.size() / 2]);
    std::fflush(stdout);
  }
}

void BenchKv(const Flags& f, KvTransport& t, const RegionDescriptor& d) {
  const uint64_t per_layer = 2ull * f.blocks;
  const uint64_t ops_total = per_layer * f.layers;
  // The sender's own cache: a pool as large as the receiver's, blocks scattered within it.
  std::vector<uint8_t> local(f.pool_blocks * f.block_bytes);
  std::mt19937_64 rng(1);
  for (auto& b : local) b = static_cast<uint8_t>(rng());
  // Touch the whole pool once first: the sender maps the receiver's shared-memory segment
  // lazily, and a long-running worker has paid those page faults long before.
  for (uint64_t off = 0; off < local.size(); off += 4 << 20) {
    uint64_t n = std::min<uint64_t>(4 << 20, local.size() - off);
    absl::Status s = t.Write(d, {{local.data() + off, n, off}}, std::chrono::seconds(60));
    if (!s.ok()) Fail(s, "kv warm-up");
  }
  std::vector<double> lat;
  for (int h = 0; h < f.handoffs + 2; ++h) {
    std::vector<uint64_t> dst_blocks(f.pool_blocks), src_blocks(f.pool_blocks);
    for (uint64_t i = 0; i < f.pool_blocks; ++i) dst_blocks[i] = src_blocks[i] = i;
    std::shuffle(dst_blocks.begin(), dst_blocks.end(), rng);
    std::shuffle(src_blocks.begin(), src_blocks.end(), rng);
    Window w(f.layers);
    auto t0 = Clock::now();
    for (int layer = 0; layer < f.layers; ++layer) {
      std::vector<WriteOp> ops;
      ops.reserve(per_layer);
      for (uint64_t k = 0; k < per_layer; ++k) {
        uint64_t idx = (layer * per_layer + k) % f.pool_blocks;
        ops.push_back({local.data() + src_blocks[idx] * f.block_bytes, f.block_bytes,
                       dst_blocks[idx] * f.block_bytes});
      }
      t.WriteAsync(d, std::move(ops), Clock::now() + std::chrono::seconds(60), w.Acquire());
    }
    absl::Status s = w.Drain();
    if (!s.ok()) Fail(s, "kv handoff");
    if (h >= 2) lat.push_back(Seconds(Clock::now() - t0));  // first two warm up
  }
  std::sort(lat.begin(), lat.end());
  double med = lat[lat.size() / 2];
  double bytes = double(ops_total) * f.block_bytes;
  std::printf("RESULT pattern=kv tls=%s mode=%s alloc=%d layers=%d blocks=%d block_bytes=%llu "
              "bytes=%.0f lat_ms=%.3f gbps=%.3f\n",
              f.tls.c_str(), f.mode.c_str(), f.alloc ? 1 : 0, f.layers, f.blocks,
              static_cast<unsigned long long>(f.block_bytes), bytes, med * 1e3,
              bytes / med / 1e9);
  std::fflush(stdout);
}

int RunSender(const Flags& f, const char* self) {
  uint64_t max_size = f.sizes.empty() ? 0 : *std::max_element(f.sizes.begin(), f.sizes.end());
  uint64_t region = std::max(max_size, f.kv ? f.pool_blocks * f.block_bytes : 0);
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) return 1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, to_child[0], 0);
  posix_spawn_file_actions_adddup2(&fa, from_child[1], 1);
  posix_spawn_file_actions_addclose(&fa, to_child[1]);
  posix_spawn_file_actions_addclose(&fa, from_child[0]);
  std::string region_s = std::to_string(region);
  std::vector<std::string> args = {self,   "--role",  "receiver", "--tls",        f.tls,
                                   "--mode", f.mode,  "--alloc",  f.alloc ? "1" : "0",
                                   "--region-bytes",   region_s, "--progress", f.progress};
  if (!f.ucx_config.empty()) {
    args.push_back("--ucx-config");
    args.push_back(f.ucx_config);
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, self, &fa, nullptr, argv.data(), environ) != 0) return 1;
  posix_spawn_file_actions_destroy(&fa);
  close(to_child[0]);
  close(from_child[1]);
  FILE* in = fdopen(from_child[0], "r");
  std::string hex;
  for (int c; (c = std::fgetc(in)) != EOF && c != '\n';) hex.push_back(static_cast<char>(c));
  std::string wire;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    wire.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  auto d = RegionDescriptor::Parse(wire);
  if (!d.ok()) Fail(d.status(), "receiver descriptor");

  auto t = MakeTransport(f);
  std::vector<uint8_t> src(std::max<uint64_t>(max_size, 1));
  std::mt19937_64 rng(2);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::fprintf(stderr, "sender: %s\n", t->capabilities().detail.c_str());
  if (!f.sizes.empty()) BenchSizes(f, *t, *d, src);
  if (f.kv) BenchKv(f, *t, *d);
  TransportStats s = t->stats();
  std::fprintf(stderr, "sender: bytes_written=%llu writes_failed=%llu\n",
               static_cast<unsigned long long>(s.bytes_written),
               static_cast<unsigned long long>(s.writes_failed));
  t.reset();
  close(to_child[1]);  // receiver exits on end of input
  int status = 0;
  waitpid(pid, &status, 0);
  std::fclose(in);
  return 0;
}

}  // namespace
}  // namespace tandem::transfer

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  auto flags = tandem::transfer::ParseFlags(argc, argv);
  if (flags.role == "receiver") return tandem::transfer::RunReceiver(flags);
  return tandem::transfer::RunSender(flags, "/proc/self/exe");
}
