#include "common/transfer/cuda_ipc/cuda_ipc_transport.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <fstream>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/cuda/cuda_raii.h"
#include "common/transfer/op_validation.h"

namespace tandem::transfer {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kScheme[] = "cuda_ipc";
constexpr size_t kRkeyBytes = CUDA_IPC_HANDLE_SIZE + sizeof(uint64_t);

// This node's identity: processes on one node share it, others differ.
std::string BootId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  if (id.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    id = host;
  }
  return id;
}

struct PeerAddress {
  std::string node;
  int64_t pid = 0;
  uint64_t nonce = 0;
};

absl::StatusOr<PeerAddress> ParseAddress(const std::string& s) {
  std::vector<std::string> parts = absl::StrSplit(s, '/');
  PeerAddress a;
  if (parts.size() != 4 || parts[0] != kScheme || parts[1].empty() ||
      !absl::SimpleAtoi(parts[2], &a.pid) || !absl::SimpleHexAtoi(parts[3], &a.nonce)) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a cuda_ipc peer address: \"", s, "\" (expected cuda_ipc/NODE/PID/ID)"));
  }
  a.node = parts[1];
  return a;
}

// The allocation that holds `p` (IPC handles name whole allocations). Resolved through the
// runtime's driver entry point so the binary needs no link-time libcuda.
using GetAddressRangeFn = int (*)(unsigned long long* base, size_t* size, unsigned long long p);

absl::StatusOr<std::pair<uint8_t*, size_t>> AllocationOf(const void* p) {
  static GetAddressRangeFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<GetAddressRangeFn>(nullptr);
    }
    return reinterpret_cast<GetAddressRangeFn>(f);
  }();
  if (fn == nullptr) {
    return absl::FailedPreconditionError("cuda_ipc: the driver lacks cuMemGetAddressRange");
  }
  unsigned long long base = 0;
  size_t size = 0;
  if (const int r = fn(&base, &size, reinterpret_cast<unsigned long long>(p)); r != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc: cuMemGetAddressRange failed (CUresult ", r, ") for 0x",
                     absl::Hex(reinterpret_cast<uintptr_t>(p))));
  }
  return std::make_pair(reinterpret_cast<uint8_t*>(base), size);
}

class CudaIpcTransport final : public KvTransport {
 public:
  CudaIpcTransport(int device, cuda::CudaStream stream)
      : device_(device), stream_(std::move(stream)) {
    std::random_device rd;
    nonce_ = (uint64_t{rd()} << 32) ^ rd() ^ uint64_t(getpid());
    node_ = BootId();
    address_ = absl::StrCat(kScheme, "/", node_, "/", getpid(), "/", absl::Hex(nonce_));
    progress_ = std::thread([this] { Progress(); });
  }

  ~CudaIpcTransport() override {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    progress_.join();
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_.get());
    absl::MutexLock l(&mu_);
    for (Pending& p : pending_) {
      if (p.done) p.done(absl::CancelledError("cuda_ipc transport destroyed"));
    }
    pending_.clear();
    for (auto& [key, m] : mappings_) {
      if (m.opened != nullptr) cudaIpcCloseMemHandle(m.opened);
    }
    mappings_.clear();
  }

  Capabilities capabilities() const override {
    Capabilities c;
    c.name = kScheme;
    c.detail = absl::StrCat("cuda", device_);
    c.one_sided = true;
    c.device_memory = true;
    c.cross_host = false;
    return c;
  }

  absl::StatusOr<RegionDescriptor> RegisterRegion(void* base, uint64_t length) override {
    if (base == nullptr || length == 0) {
      return absl::InvalidArgumentError("cuda_ipc: empty region");
    }
    TANDEM_CUDA_RETURN_IF(cudaSetDevice(device_));
    const cuda::PointerKind kind = cuda::ClassifyPointer(base);
    if (!kind.device) {
      return absl::InvalidArgumentError(
          "cuda_ipc registers device memory only; this region is host memory (use the ucx "
          "transport for a host KV pool)");
    }
    absl::StatusOr<std::pair<uint8_t*, size_t>> alloc = AllocationOf(base);
    if (!alloc.ok()) return alloc.status();
    const uint64_t offset = static_cast<uint8_t*>(base) - alloc->first;
    if (offset + length > alloc->second) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_ipc: region of ", length, " bytes at offset ", offset,
                       " overruns its allocation of ", alloc->second, " bytes"));
    }
    cudaIpcMemHandle_t h;
    TANDEM_CUDA_RETURN_IF(cudaIpcGetMemHandle(&h, alloc->first));
    RegionDescriptor d;
    d.peer_address = address_;
    d.base = reinterpret_cast<uint64_t>(base);
    d.length = length;
    d.rkey.resize(kRkeyBytes);
    std::memcpy(d.rkey.data(), &h, CUDA_IPC_HANDLE_SIZE);
    std::memcpy(d.rkey.data() + CUDA_IPC_HANDLE_SIZE, &offset, sizeof(offset));
    absl::MutexLock l(&mu_);
    d.region_id = ++next_region_;
    regions_[d.region_id] = length;
    return d;
  }

  absl::Status DeregisterRegion(uint64_t region_id) override {
    absl::MutexLock l(&mu_);
    if (regions_.erase(region_id) == 0) {
      return absl::NotFoundError(absl::StrCat("cuda_ipc: no region ", region_id));
    }
    return absl::OkStatus();
  }

  void WriteAsync(const RegionDescriptor& dst, std::vector<WriteOp> ops, Clock::time_point deadline,
                  std::function<void(absl::Status)> done) override {
    absl::Status st = Enqueue(dst, ops, deadline, done);
    if (!st.ok()) {
      {
        absl::MutexLock l(&mu_);
        ++stats_.writes_failed;
      }
      done(std::move(st));
    }
  }

  void ForgetPeer(const std::string& peer_address) override {
    absl::MutexLock l(&mu_);
    // Copies into the peer's memory may be queued: let them finish before unmapping.
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_.get());
    for (auto it = mappings_.begin(); it != mappings_.end();) {
      if (it->first.first == peer_address) {
        if (it->second.opened != nullptr) cudaIpcCloseMemHandle(it->second.opened);
        mappings_.erase(it++);
      } else {
        ++it;
      }
    }
  }

  TransportStats stats() const override {
    absl::MutexLock l(&mu_);
    return stats_;
  }

 private:
  struct Mapping {
    uint8_t* region = nullptr;  // the region's first byte in this process
    void* opened = nullptr;     // what cudaIpcOpenMemHandle returned (null: same process)
  };
  struct Pending {
    cuda::CudaEvent event;
    std::function<void(absl::Status)> done;  // empty once answered (deadline)
    Clock::time_point deadline;
    uint64_t bytes = 0;
  };

  absl::StatusOr<uint8_t*> MapLocked(const RegionDescriptor& dst)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto key = std::make_pair(dst.peer_address, dst.region_id);
    if (auto it = mappings_.find(key); it != mappings_.end()) return it->second.region;
    absl::StatusOr<PeerAddress> peer = ParseAddress(dst.peer_address);
    if (!peer.ok()) return peer.status();
    if (peer->node != node_) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda_ipc reaches GPUs of this node only; the peer ", dst.peer_address,
                       " is on another node (across nodes use a UCX built with CUDA)"));
    }
    if (dst.rkey.size() != kRkeyBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_ipc: remote key has ", dst.rkey.size(), " bytes, not ", kRkeyBytes));
    }
    Mapping m;
    if (peer->pid == getpid()) {
      // A process cannot open its own handle; its pointer is valid here as it is.
      m.region = reinterpret_cast<uint8_t*>(dst.base);
    } else {
      cudaIpcMemHandle_t h;
      uint64_t offset = 0;
      std::memcpy(&h, dst.rkey.data(), CUDA_IPC_HANDLE_SIZE);
      std::memcpy(&offset, dst.rkey.data() + CUDA_IPC_HANDLE_SIZE, sizeof(offset));
      void* p = nullptr;
      const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return absl::UnavailableError(absl::StrCat(
            "cuda_ipc: cannot map the region of peer ", dst.peer_address, ": ", cudaGetErrorName(e),
            " (", cudaGetErrorString(e), "); the peer may have exited"));
      }
      m.opened = p;
      m.region = static_cast<uint8_t*>(p) + offset;
    }
    mappings_[key] = m;
    return m.region;
  }

  absl::Status Enqueue(const RegionDescriptor& dst, const std::vector<WriteOp>& ops,
                       Clock::time_point deadline, std::function<void(absl::Status)>& done) {
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError("cuda_ipc: write deadline passed before it started");
    }
    if (absl::Status v = ValidateOps(dst.length, ops); !v.ok()) return v;
    TANDEM_CUDA_RETURN_IF(cudaSetDevice(device_));
    absl::StatusOr<cuda::CudaEvent> ev = cuda::CudaEvent::Create();
    if (!ev.ok()) return ev.status();
    absl::MutexLock l(&mu_);
    if (stop_) return absl::CancelledError("cuda_ipc transport is shutting down");
    absl::StatusOr<uint8_t*> region = MapLocked(dst);
    if (!region.ok()) return region.status();
    uint64_t bytes = 0;
    for (const WriteOp& op : ops) {
      if (op.length == 0) continue;
      TANDEM_CUDA_RETURN_IF(cudaMemcpyAsync(*region + op.remote_offset, op.src, op.length,
                                            cudaMemcpyDefault, stream_.get()));
      bytes += op.length;
    }
    TANDEM_CUDA_RETURN_IF(cudaEventRecord(ev->get(), stream_.get()));
    pending_.push_back(Pending{std::move(*ev), std::move(done), deadline, bytes});
    return absl::OkStatus();
  }

  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !pending_.empty(); }

  // Answers writes in order (events on one stream complete in order).
  void Progress() {
    cudaSetDevice(device_);
    absl::Duration backoff = absl::Microseconds(20);
    for (;;) {
      std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> answers;
      {
        absl::MutexLock l(&mu_);
        mu_.Await(absl::Condition(this, &CudaIpcTransport::HasWork));
        if (stop_) return;
        const Clock::time_point now = Clock::now();
        while (!pending_.empty()) {
          Pending& p = pending_.front();
          const cudaError_t e = cudaEventQuery(p.event.get());
          if (e == cudaErrorNotReady) {
            // Answer a late write at its deadline; keep its event until the copy is done.
            if (p.done && now >= p.deadline) {
              ++stats_.writes_failed;
              answers.emplace_back(std::move(p.done),
                                   absl::DeadlineExceededError(
                                       "cuda_ipc: device copy still running at the deadline"));
              p.done = nullptr;
            }
            break;
          }
          absl::Status st = cuda::FromCudaError(e, "cuda_ipc copy", __FILE__, __LINE__);
          if (p.done) {
            if (st.ok()) {
              stats_.bytes_written += p.bytes;
            } else {
              ++stats_.writes_failed;
            }
            answers.emplace_back(std::move(p.done), std::move(st));
          }
          pending_.pop_front();
        }
      }
      for (auto& [cb, st] : answers) cb(std::move(st));
      if (answers.empty()) {
        absl::SleepFor(backoff);
        backoff = std::min(backoff * 2, absl::Milliseconds(1));
      } else {
        backoff = absl::Microseconds(20);
      }
    }
  }

  const int device_;
  cuda::CudaStream stream_;
  uint64_t nonce_ = 0;
  std::string node_;
  std::string address_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_region_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, uint64_t> regions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::pair<std::string, uint64_t>, Mapping> mappings_ ABSL_GUARDED_BY(mu_);
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  TransportStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread progress_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvTransport>> CreateCudaIpcTransport(
    const CudaIpcTransportOptions& o) {
  const int n = cuda::VisibleDeviceCount();
  if (n == 0) {
    return absl::FailedPreconditionError(
        "transport cuda_ipc: no CUDA device is visible (no NVIDIA driver, no GPU, or "
        "CUDA_VISIBLE_DEVICES hides them)");
  }
  int device = o.device;
  if (device < 0) TANDEM_CUDA_RETURN_IF(cudaGetDevice(&device));
  if (device >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("transport cuda_ipc: device ", device, " of ", n, " visible"));
  }
  TANDEM_CUDA_RETURN_IF(cudaSetDevice(device));
  absl::StatusOr<cuda::CudaStream> s = cuda::CudaStream::Create();
  if (!s.ok()) return s.status();
  return std::unique_ptr<KvTransport>(new CudaIpcTransport(device, std::move(*s)));
}

}  // namespace tandem::transfer
