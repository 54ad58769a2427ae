#include "common/transfer/nccl/nccl_transport.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/transfer/op_validation.h"

namespace tandem::transfer {
namespace {

using Clock = std::chrono::steady_clock;

// The one conversion of each foreign error space used here.
absl::Status FromCudaError(cudaError_t e, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(file, ":", line, ": CUDA: ", cudaGetErrorString(e));
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    return absl::UnavailableError(msg);
  }
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}
absl::Status FromNcclResult(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": NCCL: ", ncclGetErrorString(r));
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return absl::InvalidArgumentError(msg);
  if (r == ncclRemoteError || r == ncclSystemError) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}
#define CUDA_OR_RETURN(expr)                                                        \
  do {                                                                              \
    absl::Status _s = FromCudaError((expr), __FILE__, __LINE__);                    \
    if (!_s.ok()) return _s;                                                        \
  } while (0)
#define NCCL_OR_RETURN(expr)                                                        \
  do {                                                                              \
    absl::Status _s = FromNcclResult((expr), #expr);                                \
    if (!_s.ok()) return _s;                                                        \
  } while (0)

// A call on a non-blocking communicator may answer ncclInProgress; wait until it is enqueued.
// NCCL documents polling ncclCommGetAsyncError for this.
absl::Status NcclWait(ncclComm_t comm, ncclResult_t r, const char* what) {
  while (r == ncclInProgress) {
    std::this_thread::yield();
    ncclCommGetAsyncError(comm, &r);
  }
  return FromNcclResult(r, what);
}
#define NCCL_COMM_OR_RETURN(expr)                                                   \
  do {                                                                              \
    absl::Status _s = NcclWait(comm_, (expr), #expr);                               \
    if (!_s.ok()) return _s;                                                        \
  } while (0)

#define TANDEM_NCCL_RETURN_IF_ERROR(expr) \
  do {                                    \
    absl::Status _st = (expr);            \
    if (!_st.ok()) return _st;            \
  } while (0)

constexpr uint32_t kMagic = 0x314e4b54;  // "TKN1"
enum Kind : uint32_t { kWrite = 1, kAck = 2 };
struct Header {  // 64 bytes on the wire
  uint32_t magic;
  uint32_t kind;
  uint64_t batch_id;
  uint64_t region_id;
  uint64_t num_ops;
  int32_t status_code;  // kAck
  uint32_t reserved[7];
};
static_assert(sizeof(Header) == 64);
struct OpEntry {
  uint64_t offset;
  uint64_t length;
};

class NcclTransportImpl final : public NcclTransport {
 public:
  explicit NcclTransportImpl(int device) : device_(device) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~NcclTransportImpl() override {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    thread_.join();
  }

  absl::Status Init(int rank, int nranks, const std::string& unique_id,
                    Clock::time_point deadline) override {
    if (unique_id.size() != NCCL_UNIQUE_ID_BYTES || rank < 0 || rank >= nranks) {
      return absl::InvalidArgumentError("NCCL Init: bad rank, nranks or unique id");
    }
    return RunAndWait([&]() -> absl::Status {
      if (comm_ != nullptr || broken_) {
        return absl::FailedPreconditionError("NCCL transport already joined");
      }
      ncclUniqueId id;
      std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
      // Non-blocking, so that a rank that never joins costs an abort at the deadline rather
      // than a thread stuck in ncclCommInitRank. Every later call on the communicator may then
      // answer ncclInProgress; NcclWait finishes those.
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      ncclResult_t r = ncclCommInitRankConfig(&comm_, nranks, id, rank, &config);
      while (r == ncclInProgress && comm_ != nullptr) {
        if (Clock::now() >= deadline) {
          ncclCommAbort(comm_);
          comm_ = nullptr;
          broken_ = true;
          return absl::DeadlineExceededError(
              "NCCL Init: not every rank joined the communicator by the deadline");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ncclCommGetAsyncError(comm_, &r);
      }
      if (r != ncclSuccess) {
        if (comm_ != nullptr) ncclCommAbort(comm_);
        comm_ = nullptr;
        broken_ = true;
        return FromNcclResult(r, "ncclCommInitRankConfig");
      }
      rank_ = rank;
      address_prefix_ = AddressOfRank(unique_id, rank);
      address_prefix_.resize(address_prefix_.rfind(':') + 1);
      CUDA_OR_RETURN(cudaStreamCreateWithFlags(&send_stream_, cudaStreamNonBlocking));
      rx_.resize(nranks);
      for (int p = 0; p < nranks; ++p) {
        if (p == rank_) continue;
        Rx& rx = rx_[p];
        CUDA_OR_RETURN(cudaStreamCreateWithFlags(&rx.stream, cudaStreamNonBlocking));
        CUDA_OR_RETURN(cudaEventCreateWithFlags(&rx.done, cudaEventDisableTiming));
        CUDA_OR_RETURN(cudaMalloc(&rx.d_header, sizeof(Header)));
        TANDEM_NCCL_RETURN_IF_ERROR(PostHeaderRecv(p));
      }
      return absl::OkStatus();
    });
  }

  Capabilities capabilities() const override {
    return Capabilities{.name = "nccl",
                        .detail = "ncclSend/ncclRecv",
                        .one_sided = false,
                        .device_memory = true,
                        .cross_host = true};
  }

  absl::StatusOr<RegionDescriptor> RegisterRegion(void* base, uint64_t length) override {
    if (base == nullptr || length == 0) return absl::InvalidArgumentError("empty region");
    RegionDescriptor d;
    absl::Status s = RunAndWait([&]() -> absl::Status {
      if (broken_) return absl::UnavailableError("NCCL communicator was aborted");
      uint64_t id = next_region_++;
      regions_[id] = {static_cast<uint8_t*>(base), length};
      // Before Init the address is unknown (AddressOfRank gives it).
      if (rank_ >= 0) d.peer_address = absl::StrCat(address_prefix_, rank_);
      d.region_id = id;
      d.base = reinterpret_cast<uintptr_t>(base);
      d.length = length;
      return absl::OkStatus();
    });
    if (!s.ok()) return s;
    return d;
  }

  absl::Status DeregisterRegion(uint64_t region_id) override {
    // Receives into a region are posted and completed on the progress thread, so once this
    // task runs none is in flight for a later batch; one in flight now finishes first.
    return RunAndWait([&]() -> absl::Status {
      for (const Rx& rx : rx_) {
        if (rx.stage == Rx::kPayload && rx.header.region_id == region_id) {
          return absl::FailedPreconditionError("a write into the region is in progress");
        }
      }
      return regions_.erase(region_id) ? absl::OkStatus()
                                       : absl::NotFoundError("region is not registered");
    });
  }

  void WriteAsync(const RegionDescriptor& dst, std::vector<WriteOp> ops,
                  Clock::time_point deadline, std::function<void(absl::Status)> done) override {
    Post([this, dst, ops = std::move(ops), deadline, done = std::move(done)]() mutable {
      Out out{std::move(done), deadline, TotalBytes(ops), -1};
      absl::Status s = StartWrite(dst, ops, out);
      if (!s.ok()) {
        writes_failed_++;
        out.done(s);
      }
    });
  }

  void ForgetPeer(const std::string&) override {}  // ranks are fixed by the communicator

  TransportStats stats() const override {
    return {bytes_written_.load(), bytes_received_.load(), writes_failed_.load()};
  }

 private:
  struct Region {
    uint8_t* base;
    uint64_t length;
  };
  struct Out {
    std::function<void(absl::Status)> done;
    Clock::time_point deadline;
    uint64_t bytes;
    int peer;
  };
  struct Rx {
    enum Stage { kIdle, kHeader, kTable, kPayload } stage = kIdle;
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
    Header* d_header = nullptr;
    OpEntry* d_table = nullptr;
    Header header{};
    std::vector<OpEntry> table;
    std::vector<void*> scratch;
    absl::Status verdict;
  };

  void Post(std::function<void()> task) {
    absl::MutexLock l(&mu_);
    tasks_.push_back(std::move(task));
  }
  absl::Status RunAndWait(std::function<absl::Status()> fn) {
    absl::Notification finished;
    absl::Status result;
    Post([&] {
      result = fn();
      finished.Notify();
    });
    finished.WaitForNotification();
    return result;
  }

  absl::Status StartWrite(const RegionDescriptor& dst, const std::vector<WriteOp>& ops, Out& out) {
    if (broken_) return absl::UnavailableError("NCCL communicator was aborted");
    if (comm_ == nullptr) return absl::FailedPreconditionError("NCCL transport not joined");
    int peer = -1;
    if (!absl::StartsWith(dst.peer_address, address_prefix_) ||
        !absl::SimpleAtoi(std::string(dst.peer_address.substr(address_prefix_.size())), &peer) ||
        peer < 0 || peer >= static_cast<int>(rx_.size()) || peer == rank_) {
      return absl::InvalidArgumentError("descriptor is not for this NCCL communicator");
    }
    TANDEM_NCCL_RETURN_IF_ERROR(ValidateOps(dst.length, ops));
    if (Clock::now() > out.deadline) return absl::DeadlineExceededError("deadline passed");
    std::vector<OpEntry> table;
    for (const WriteOp& op : ops) {
      if (op.length > 0) table.push_back({op.remote_offset, op.length});
    }
    uint64_t id = next_batch_++;
    Header h{};
    h.magic = kMagic;
    h.kind = kWrite;
    h.batch_id = id;
    h.region_id = dst.region_id;
    h.num_ops = table.size();
    // Header and table travel from stream-ordered device buffers freed after the sends.
    size_t bytes = sizeof(Header) + table.size() * sizeof(OpEntry);
    uint8_t* d_buf = nullptr;
    CUDA_OR_RETURN(cudaMallocAsync(reinterpret_cast<void**>(&d_buf), bytes, send_stream_));
    CUDA_OR_RETURN(cudaMemcpyAsync(d_buf, &h, sizeof(h), cudaMemcpyHostToDevice, send_stream_));
    if (!table.empty()) {
      CUDA_OR_RETURN(cudaMemcpyAsync(d_buf + sizeof(h), table.data(),
                                     table.size() * sizeof(OpEntry), cudaMemcpyHostToDevice,
                                     send_stream_));
    }
    // The host copies above come from stack/heap memory: finish them before returning.
    CUDA_OR_RETURN(cudaStreamSynchronize(send_stream_));
    NCCL_OR_RETURN(ncclGroupStart());
    ncclSend(d_buf, sizeof(Header), ncclChar, peer, comm_, send_stream_);
    if (!table.empty()) {
      ncclSend(d_buf + sizeof(Header), table.size() * sizeof(OpEntry), ncclChar, peer, comm_,
               send_stream_);
    }
    for (const WriteOp& op : ops) {
      if (op.length > 0) ncclSend(op.src, op.length, ncclChar, peer, comm_, send_stream_);
    }
    NCCL_COMM_OR_RETURN(ncclGroupEnd());
    CUDA_OR_RETURN(cudaFreeAsync(d_buf, send_stream_));
    out.peer = peer;
    outstanding_.emplace(id, std::move(out));
    return absl::OkStatus();
  }

  absl::Status PostHeaderRecv(int peer) {
    Rx& rx = rx_[peer];
    NCCL_COMM_OR_RETURN(ncclRecv(rx.d_header, sizeof(Header), ncclChar, peer, comm_, rx.stream));
    CUDA_OR_RETURN(cudaEventRecord(rx.done, rx.stream));
    rx.stage = Rx::kHeader;
    return absl::OkStatus();
  }

  absl::Status SendAck(int peer, uint64_t batch, const absl::Status& verdict) {
    Header h{};
    h.magic = kMagic;
    h.kind = kAck;
    h.batch_id = batch;
    h.status_code = static_cast<int32_t>(verdict.code());
    void* d = nullptr;
    CUDA_OR_RETURN(cudaMallocAsync(&d, sizeof(h), send_stream_));
    CUDA_OR_RETURN(cudaMemcpyAsync(d, &h, sizeof(h), cudaMemcpyHostToDevice, send_stream_));
    CUDA_OR_RETURN(cudaStreamSynchronize(send_stream_));
    NCCL_COMM_OR_RETURN(ncclSend(d, sizeof(h), ncclChar, peer, comm_, send_stream_));
    CUDA_OR_RETURN(cudaFreeAsync(d, send_stream_));
    return absl::OkStatus();
  }

  // Advances the receive state machine of one peer; true if it moved.
  absl::StatusOr<bool> PollPeer(int peer) {
    Rx& rx = rx_[peer];
    if (rx.stage == Rx::kIdle) return false;
    cudaError_t q = cudaEventQuery(rx.done);
    if (q == cudaErrorNotReady) return false;
    CUDA_OR_RETURN(q);
    switch (rx.stage) {
      case Rx::kHeader: {
        CUDA_OR_RETURN(cudaMemcpy(&rx.header, rx.d_header, sizeof(Header), cudaMemcpyDeviceToHost));
        if (rx.header.magic != kMagic) return absl::DataLossError("NCCL: bad message header");
        if (rx.header.kind == kAck) {
          auto it = outstanding_.find(rx.header.batch_id);
          if (it != outstanding_.end()) {
            absl::Status s = rx.header.status_code == 0
                                 ? absl::OkStatus()
                                 : absl::Status(static_cast<absl::StatusCode>(rx.header.status_code),
                                                "peer refused KV write");
            Complete(it, s);
          }
          TANDEM_NCCL_RETURN_IF_ERROR(PostHeaderRecv(peer));
          return true;
        }
        rx.table.assign(rx.header.num_ops, {});
        rx.verdict = absl::OkStatus();
        if (rx.table.empty()) return FinishPayload(peer);
        CUDA_OR_RETURN(cudaMallocAsync(reinterpret_cast<void**>(&rx.d_table),
                                       rx.table.size() * sizeof(OpEntry), rx.stream));
        NCCL_COMM_OR_RETURN(ncclRecv(rx.d_table, rx.table.size() * sizeof(OpEntry), ncclChar, peer,
                                comm_, rx.stream));
        CUDA_OR_RETURN(cudaEventRecord(rx.done, rx.stream));
        rx.stage = Rx::kTable;
        return true;
      }
      case Rx::kTable: {
        CUDA_OR_RETURN(cudaMemcpy(rx.table.data(), rx.d_table, rx.table.size() * sizeof(OpEntry),
                                  cudaMemcpyDeviceToHost));
        CUDA_OR_RETURN(cudaFreeAsync(rx.d_table, rx.stream));
        rx.d_table = nullptr;
        auto rit = regions_.find(rx.header.region_id);
        NCCL_OR_RETURN(ncclGroupStart());
        for (const OpEntry& e : rx.table) {
          void* dst = nullptr;
          bool ok = rit != regions_.end() && e.offset <= rit->second.length &&
                    e.length <= rit->second.length - e.offset;
          if (ok) {
            dst = rit->second.base + e.offset;
          } else {
            // The sender sends the bytes regardless; take them somewhere harmless.
            if (rx.verdict.ok()) {
              rx.verdict = rit == regions_.end()
                               ? absl::NotFoundError("region is not registered")
                               : absl::InvalidArgumentError("write outside the region");
            }
            cudaMallocAsync(&dst, e.length, rx.stream);
            rx.scratch.push_back(dst);
          }
          ncclRecv(dst, e.length, ncclChar, peer, comm_, rx.stream);
        }
        NCCL_COMM_OR_RETURN(ncclGroupEnd());
        CUDA_OR_RETURN(cudaEventRecord(rx.done, rx.stream));
        rx.stage = Rx::kPayload;
        return true;
      }
      case Rx::kPayload:
        return FinishPayload(peer);
      case Rx::kIdle:
        break;
    }
    return false;
  }

  absl::StatusOr<bool> FinishPayload(int peer) {
    Rx& rx = rx_[peer];
    for (void* p : rx.scratch) cudaFreeAsync(p, rx.stream);
    rx.scratch.clear();
    if (rx.verdict.ok()) {
      for (const OpEntry& e : rx.table) bytes_received_ += e.length;
    }
    TANDEM_NCCL_RETURN_IF_ERROR(SendAck(peer, rx.header.batch_id, rx.verdict));
    TANDEM_NCCL_RETURN_IF_ERROR(PostHeaderRecv(peer));
    return true;
  }

  void Complete(std::map<uint64_t, Out>::iterator it, absl::Status s) {
    Out out = std::move(it->second);
    outstanding_.erase(it);
    if (s.ok()) {
      bytes_written_ += out.bytes;
    } else {
      writes_failed_++;
    }
    out.done(std::move(s));
  }

  // Aborts the communicator: the only way to stop NCCL operations that cannot finish.
  void Abort(const absl::Status& why) {
    if (comm_ != nullptr && !broken_) ncclCommAbort(comm_);
    broken_ = true;
    comm_ = nullptr;
    for (Rx& rx : rx_) rx.stage = Rx::kIdle;
    while (!outstanding_.empty()) {
      auto it = outstanding_.begin();
      Complete(it, it->second.deadline <= Clock::now()
                       ? absl::DeadlineExceededError("NCCL write not complete by its deadline")
                       : why);
    }
  }

  void Loop() {
    cudaSetDevice(device_);
    auto backoff = std::chrono::microseconds(0);
    for (;;) {
      std::deque<std::function<void()>> tasks;
      {
        absl::MutexLock l(&mu_);
        const bool idle = comm_ == nullptr || broken_;
        auto wake = [this] {
          mu_.AssertHeld();  // Await calls it under mu_
          return stop_ || !tasks_.empty();
        };
        if (idle) {
          mu_.Await(absl::Condition(&wake));
        } else if (backoff.count() > 0) {
          mu_.AwaitWithTimeout(absl::Condition(&wake), absl::FromChrono(backoff));
        }
        if (stop_) break;
        tasks.swap(tasks_);
      }
      bool moved = !tasks.empty();
      for (auto& t : tasks) t();
      if (comm_ != nullptr && !broken_) {
        for (int p = 0; p < static_cast<int>(rx_.size()); ++p) {
          if (p == rank_) continue;
          auto r = PollPeer(p);
          if (!r.ok()) {
            Abort(r.status());
            break;
          }
          moved |= *r;
        }
        Clock::time_point now = Clock::now();
        for (auto& [id, out] : outstanding_) {
          if (now > out.deadline) {
            Abort(absl::UnavailableError("NCCL communicator aborted after a missed deadline"));
            break;
          }
        }
      }
      backoff = moved ? std::chrono::microseconds(0)
                      : std::min(std::chrono::microseconds(1000),
                                 std::max(std::chrono::microseconds(20), backoff * 2));
    }
    // Shutdown: pending writes fail, the communicator goes.
    Abort(absl::CancelledError("NCCL transport shut down"));
    for (Rx& rx : rx_) {
      if (rx.stream != nullptr) cudaStreamDestroy(rx.stream);
      if (rx.done != nullptr) cudaEventDestroy(rx.done);
      if (rx.d_header != nullptr) cudaFree(rx.d_header);
    }
    if (send_stream_ != nullptr) cudaStreamDestroy(send_stream_);
  }

  const int device_;
  std::thread thread_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Progress thread only.
  ncclComm_t comm_ = nullptr;
  bool broken_ = false;
  int rank_ = -1;
  std::string address_prefix_;
  cudaStream_t send_stream_ = nullptr;
  std::vector<Rx> rx_;
  std::map<uint64_t, Region> regions_;
  uint64_t next_region_ = 1;
  std::map<uint64_t, Out> outstanding_;
  uint64_t next_batch_ = 1;

  std::atomic<uint64_t> bytes_written_{0}, bytes_received_{0}, writes_failed_{0};
};

}  // namespace

absl::StatusOr<std::string> NcclTransport::CreateUniqueId() {
  ncclUniqueId id;
  NCCL_OR_RETURN(ncclGetUniqueId(&id));
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

absl::StatusOr<std::unique_ptr<NcclTransport>> NcclTransport::Create(
    const NcclTransportOptions& opts) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return absl::UnavailableError(
        absl::StrCat("no CUDA device for the NCCL transport (", cudaGetErrorString(e), ")"));
  }
  if (opts.device < 0 || opts.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", opts.device, " of ", count));
  }
  return std::unique_ptr<NcclTransport>(new NcclTransportImpl(opts.device));
}

}  // namespace tandem::transfer
