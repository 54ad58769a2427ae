#include "common/transfer/ucx/ucx_transport.h"

#include <ifaddrs.h>
#include <net/if.h>
#include <poll.h>
#include <sys/syscall.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/transfer/op_validation.h"
#include "common/transfer/ucx/ucx_wrappers.h"
#include "common/util/status_util.h"

namespace tandem::transfer {
namespace {

using Clock = std::chrono::steady_clock;
using ucx::FromUcsStatus;

// Descriptor addresses of this backend: the prefix, the receiver's host identity (u64) and pid
// (u32), then the packed UCP worker address. Host identity + pid let a sender on the same host
// watch the receiver process (pidfd), the only dead-peer signal shared memory has in UCX 1.13.
constexpr char kAddressPrefix[] = "ucx1:";
constexpr size_t kAddressHeader = sizeof(kAddressPrefix) - 1 + 8 + 4;

// Active-message ids (UCX indexes a small table with them).
constexpr unsigned kAmWrite = 1;
constexpr unsigned kAmAck = 2;
constexpr uint32_t kWriteMagic = 0x3157'4b54;  // "TKW1"
constexpr uint32_t kAckMagic = 0x3141'4b54;    // "TKA1"

// Both ends run the same build on little-endian hosts, so these travel as raw structs.
struct AmWriteHeader {
  uint32_t magic;
  uint32_t num_ops;  // non-empty ops in the batch: the receiver acks after that many
  uint64_t sender_id;
  uint64_t batch_id;
  uint64_t region_id;
  uint64_t offset;
  uint64_t sender_host;  // HostId() of the sender
  int64_t deadline_ns;   // sender's CLOCK_MONOTONIC; compared only on the same host
};
struct AmAckHeader {
  uint32_t magic;
  int32_t code;  // absl::StatusCode of the receiver's verdict; the message is the AM payload
  uint64_t sender_id;
  uint64_t batch_id;
};

// How long shutdown waits for UCX to hand back requests before giving up on them, and how
// long a deadline-cancelled batch may wait for its force-closed requests.
constexpr auto kShutdownGrace = std::chrono::seconds(2);
constexpr auto kCancelGrace = std::chrono::seconds(1);
constexpr auto kDeregisterWait = std::chrono::seconds(10);
constexpr auto kInboundIdleDrop = std::chrono::seconds(60);
// How long a same-host receiver's positive liveness check is reused (Peer::ProcessAlive).
constexpr auto kAliveRecheck = std::chrono::microseconds(50);

uint64_t Fnv1a(std::string_view s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Identifies this kernel and pid namespace: equal values mean pids and CLOCK_MONOTONIC agree.
uint64_t HostId() {
  static const uint64_t id = [] {
    std::string text;
    if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
      char buf[64] = {};
      size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
      std::fclose(f);
      text.assign(buf, n);
    }
    char ns[128] = {};
    ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
    if (n > 0) text.append(ns, n);
    return Fnv1a(text);
  }();
  return id;
}

int64_t MonotonicNs(Clock::time_point t) {
  // steady_clock is CLOCK_MONOTONIC on Linux, which all processes of a host share.
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

template <typename T>
void AppendRaw(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// Splits on `sep` (this abseil's string_view is not std::string_view, so no absl::StrSplit).
std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}

// Transports that do one-sided RMA natively into any registered memory.
bool IsRdmaTransport(std::string_view tl) {
  return tl.substr(0, 3) == "rc_" || tl.substr(0, 3) == "dc_" || tl == "rc" || tl == "dc";
}

// Parses ucp_ep_print_info output ("lane[2]:  2:cma/memory.0 md[2] -> ... rma_bw#0"): true
// when some lane runs on an RDMA transport. `tls` collects the lanes' transports.
bool EndpointHasRdma(const std::string& info, std::string* tls) {
  bool rdma = false;
  for (const std::string& line_str : Split(info, '\n')) {
    std::string_view line(line_str);
    size_t lane = line.find("lane[");
    if (lane == std::string_view::npos) continue;
    size_t colon = line.find("]:", lane);
    if (colon == std::string_view::npos) continue;
    std::string_view rest = line.substr(colon + 2);
    size_t rsc = rest.find(':');
    size_t slash = rest.find('/');
    if (rsc == std::string_view::npos || slash == std::string_view::npos || slash < rsc) continue;
    std::string_view tl = rest.substr(rsc + 1, slash - rsc - 1);
    if (!tls->empty()) tls->append(",");
    tls->append(tl.data(), tl.size());
    rdma |= IsRdmaTransport(tl);
  }
  return rdma;
}

bool ListHasSharedMemory(const std::string& tls) {
  for (const std::string& tl : Split(tls, ',')) {
    if (tl == "all" || tl == "shm" || tl == "sm" || tl == "posix" || tl == "sysv" ||
        tl == "cma" || tl == "knem" || tl == "xpmem") {
      return true;
    }
  }
  return false;
}

// UCX lists its TCP interfaces once, when the context is created, and takes only those both up
// and running. A network interface brought up just before the process started (a pod's veth)
// turns running a moment later, asynchronously; a context made in between would advertise no
// reachable TCP address, and every peer's endpoint to it would fail ("Destination is
// unreachable") for the life of the process. So while some non-loopback interface is up but
// none is running yet, wait (boundedly). A host with one interface running and others without a
// carrier (a docker bridge) does not wait.
void AwaitRunningInterfaces(absl::Duration limit) {
  const absl::Time until = absl::Now() + limit;
  for (;;) {
    ifaddrs* list = nullptr;
    if (getifaddrs(&list) != 0) return;
    bool up = false, running = false;
    std::string pending;
    for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
      const unsigned flags = a->ifa_flags;
      if ((flags & IFF_LOOPBACK) != 0 || (flags & IFF_UP) == 0) continue;
      up = true;
      if ((flags & IFF_RUNNING) != 0) {
        running = true;
      } else {
        pending = a->ifa_name;
      }
    }
    freeifaddrs(list);
    if (!up || running) return;
    if (absl::Now() >= until) {
      std::fprintf(stderr, "ucx: interface %s is up but not running after %s; going on\n",
                   pending.c_str(), absl::FormatDuration(limit).c_str());
      return;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

bool ListHasTcp(const std::string& tls) {
  for (const std::string& tl : Split(tls, ',')) {
    if (tl == "all" || tl == "tcp") return true;
  }
  return false;
}

class UcxTransport final : public KvTransport {
 public:
  static absl::StatusOr<std::unique_ptr<KvTransport>> Create(const UcxTransportOptions& options);
  ~UcxTransport() override;

  Capabilities capabilities() const override { return caps_; }
  absl::StatusOr<RegionDescriptor> RegisterRegion(void* base, uint64_t length) override;
  absl::StatusOr<AllocatedRegion> AllocateRegion(uint64_t length) override;
  absl::Status DeregisterRegion(uint64_t region_id) override;
  void WriteAsync(const RegionDescriptor& dst, std::vector<WriteOp> ops, Clock::time_point deadline,
                  std::function<void(absl::Status)> done) override;
  void ForgetPeer(const std::string& peer_address) override;
  TransportStats stats() const override {
    TransportStats s{bytes_written_.load(), bytes_received_.load(), writes_failed_.load()};
    absl::MutexLock l(&lanes_mu_);
    s.bytes_written_by_lanes = bytes_by_lanes_;
    return s;
  }

 private:
  struct Region {
    std::unique_ptr<ucx::UcxMemRegion> mr;
    int active_recvs = 0;  // AM rendezvous receives writing into it now
    bool closing = false;  // DeregisterRegion started: new writes are refused
    std::function<void(absl::Status)> on_drained;
    Clock::time_point drain_deadline;
  };

  // How we write into one region of a peer.
  struct RemoteRegion {
    std::unique_ptr<ucx::UcxRemoteKey> rkey;
    bool use_put = false;
  };

  // A cached connection to one receiver. Shared by the cache and by the batches using it; the
  // endpoint closes when the last of them lets go (always on the progress thread).
  struct Peer {
    UcxTransport* owner = nullptr;
    std::string address;
    std::unique_ptr<ucx::UcxEndpoint> ep;
    bool rdma = false;  // the endpoint has an RDMA lane: puts are native for any region
    std::string lanes;  // its lanes' transports, sorted, without repeats ("tcp")
    bool failed = false;
    int pidfd = -1;     // the receiver process, when it runs on this host
    std::unordered_map<uint64_t, RemoteRegion> regions;  // by the peer's region id (stable)
    ~Peer() {
      regions.clear();  // remote keys before the endpoint they were unpacked on
      // Peers live in progress-thread state: the last reference drops under worker_mu_.
      owner->worker_mu_.AssertHeld();
      if (ep != nullptr) owner->CloseEndpoint(std::move(ep), /*force=*/failed);
      if (pidfd >= 0) close(pidfd);
    }
    // False once the receiver process has exited (same-host peers only; others: true). The
    // check is a poll() on the pidfd, a syscall that cost more than the memcpy of a 64 KiB put
    // when it ran twice per write (profiled: ~20 % of the sender's time), so a positive answer
    // is reused for kAliveRecheck: a receiver that dies in that window can have one more write
    // reported OK into its orphaned segment, which nobody reads; its requests fail anyway on
    // the control plane, where the dead worker no longer answers.
    bool ProcessAlive() const {
      if (pidfd < 0) return true;
      const Clock::time_point now = Clock::now();
      if (now - alive_checked_at < kAliveRecheck) return true;
      pollfd p{pidfd, POLLIN, 0};
      const bool alive = poll(&p, 1, 0) == 0;
      if (alive) alive_checked_at = now;
      return alive;
    }
    mutable Clock::time_point alive_checked_at{};  // steady clock epoch: long ago
  };

  struct Batch {
    UcxTransport* owner = nullptr;
    uint64_t id = 0;
    std::shared_ptr<Peer> peer;
    RemoteRegion* remote = nullptr;  // only used while the batch is issued
    std::function<void(absl::Status)> done;
    Clock::time_point deadline;
    Clock::time_point give_up_at = Clock::time_point::max();
    uint64_t bytes = 0;
    absl::Status status;
    int pending = 0;            // UCP requests of this batch not yet completed
    bool awaiting_ack = false;  // AM path: the receiver's verdict has not arrived
    bool deadline_handled = false;
    bool callback_ran = false;
    std::vector<void*> requests;
    std::vector<AmWriteHeader> headers;  // AM headers must live until their sends complete
  };

  struct InboundKey {
    uint64_t sender_id;
    uint64_t batch_id;
    bool operator==(const InboundKey& o) const {
      return sender_id == o.sender_id && batch_id == o.batch_id;
    }
    template <typename H>
    friend H AbslHashValue(H h, const InboundKey& k) {
      return H::combine(std::move(h), k.sender_id, k.batch_id);
    }
  };
  // Receiver-side progress of one sender's batch on the AM path.
  struct Inbound {
    uint32_t expected = 0;
    uint32_t landed = 0;  // ops received or refused
    ucp_ep_h reply_ep = nullptr;
    absl::Status status;
    Clock::time_point last_activity;
  };
  struct RecvContext {
    UcxTransport* owner;
    InboundKey key;
    uint64_t region_id;
    uint64_t length;
  };
  struct AckMessage {
    AmAckHeader header;
    std::string text;
  };

  UcxTransport(const UcxTransportOptions& options, std::string tls, bool peer_failure)
      : options_(options), tls_(std::move(tls)), peer_failure_(peer_failure) {}

  absl::Status Init();
  void Post(std::function<void()> task);
  // Runs `fn` on the progress thread and waits for it to call its reply.
  absl::Status CallAndWait(std::function<void(std::function<void(absl::Status)>)> fn);

  // ---- progress thread only below ----
  void Loop() ABSL_LOCKS_EXCLUDED(worker_mu_);
  bool RunTasks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void AfterProgress() ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void CheckDeadlines(Clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  bool Busy() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  bool ReadyToExit(Clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void CheckPeerProcesses() ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void BeginShutdown() ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);

  // Returns the new batch's id.
  uint64_t StartBatch(const RegionDescriptor& dst, std::vector<WriteOp> ops,
                      Clock::time_point deadline, std::function<void(absl::Status)> done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  // The caller-thread fast path of WriteAsync; false (nothing done, `ops` and `done` untouched)
  // when it cannot take it.
  bool TryWriteInline(const RegionDescriptor& dst, std::vector<WriteOp>& ops,
                      Clock::time_point deadline, std::function<void(absl::Status)>& done)
      ABSL_LOCKS_EXCLUDED(worker_mu_);
  // Settles a batch whose requests are all complete: stats, the dead-receiver check, and the
  // callback to run (moved out). Progress-thread state: under worker_mu_.
  std::function<void()> Settle(Batch* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  absl::Status IssuePuts(Batch* b, const RegionDescriptor& dst, const std::vector<WriteOp>& ops)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  absl::Status IssueMessages(Batch* b, const RegionDescriptor& dst, const std::vector<WriteOp>& ops)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  bool Track(Batch* b, ucs_status_ptr_t req, std::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void Fail(Batch* b, absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void MaybeFinish(Batch* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  absl::StatusOr<std::shared_ptr<Peer>> GetPeer(const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  absl::StatusOr<RemoteRegion*> GetRemoteRegion(Peer& peer, const RegionDescriptor& dst)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  absl::StatusOr<RegionDescriptor> AddRegion(void* base, uint64_t length, void** allocated);
  void DropPeer(const std::shared_ptr<Peer>& peer, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void CloseEndpoint(std::unique_ptr<ucx::UcxEndpoint> ep, bool force)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void FinishDeregister(uint64_t region_id, absl::Status s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);

  // UCX calls these from inside ucp_worker_progress and other UCP calls, which run under
  // worker_mu_ (the static trampolines below say so to the analysis).
  ucs_status_t OnAmWrite(const void* header, size_t header_length, void* data, size_t length,
                         const ucp_am_recv_param_t* param)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  ucs_status_t OnAmAck(const void* header, size_t header_length, void* data, size_t length,
                       const ucp_am_recv_param_t* param) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void OnRecvDone(RecvContext* ctx, ucs_status_t st) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void MaybeAck(const InboundKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void OnRequestDone(Batch* b, void* request, ucs_status_t st)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);
  void OnEndpointError(ucp_ep_h ep, ucs_status_t st) ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker_mu_);

  static void SendDoneCb(void* request, ucs_status_t st, void* user_data) {
    auto* b = static_cast<Batch*>(user_data);
    b->owner->worker_mu_.AssertHeld();
    b->owner->OnRequestDone(b, request, st);
  }
  static void RecvDoneCb(void* request, ucs_status_t st, size_t, void* user_data) {
    auto* ctx = static_cast<RecvContext*>(user_data);
    UcxTransport* self = ctx->owner;
    self->worker_mu_.AssertHeld();
    ucp_request_free(request);
    --self->inflight_;
    self->OnRecvDone(ctx, st);
  }
  static void AckSentCb(void* request, ucs_status_t, void* user_data) {
    auto* ack = static_cast<AckMessage*>(user_data);
    ucp_request_free(request);
    delete ack;
  }
  static ucs_status_t AmWriteCb(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    self->worker_mu_.AssertHeld();
    return self->OnAmWrite(header, header_length, data, length, param);
  }
  static ucs_status_t AmAckCb(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    self->worker_mu_.AssertHeld();
    return self->OnAmAck(header, header_length, data, length, param);
  }
  static void EndpointErrorCb(void* arg, ucp_ep_h ep, ucs_status_t st) {
    auto* self = static_cast<UcxTransport*>(arg);
    self->worker_mu_.AssertHeld();
    self->OnEndpointError(ep, st);
  }

  const UcxTransportOptions options_;
  const std::string tls_;
  const bool peer_failure_;
  Capabilities caps_;
  std::string address_;  // kAddressPrefix + packed worker address
  uint64_t instance_id_ = 0;

  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> writes_failed_{0};
  mutable absl::Mutex lanes_mu_;
  std::map<std::string, uint64_t> bytes_by_lanes_ ABSL_GUARDED_BY(lanes_mu_);

  // Cross-thread hand-off to the progress thread.
  absl::Mutex mu_;
  std::vector<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> has_tasks_{false};
  std::atomic<bool> sleeping_{false};  // the loop is (about to be) in poll()
  int wake_fd_ = -1;
  std::thread thread_;
  std::atomic<std::thread::id> thread_id_;

  // The worker lock. Every UCP call and all the state below is used under it. The progress
  // thread holds it all the time except while it sleeps in poll(); a WriteAsync caller that
  // finds it free (the progress thread is idle) issues its write itself. The UCP worker is
  // therefore created UCS_THREAD_MODE_SERIALIZED.
  absl::Mutex worker_mu_;

  // Owned by the progress thread (created before it starts, destroyed after it joins).
  // Init holds the lock while it sets them up, the destructor while it tears them down.
  std::unique_ptr<ucx::UcxContext> context_ ABSL_PT_GUARDED_BY(worker_mu_);
  std::unique_ptr<ucx::UcxWorker> worker_ ABSL_PT_GUARDED_BY(worker_mu_);
  std::map<uint64_t, Region> regions_ ABSL_GUARDED_BY(worker_mu_);
  uint64_t next_region_id_ ABSL_GUARDED_BY(worker_mu_) = 1;
  absl::flat_hash_map<std::string, std::shared_ptr<Peer>> peers_ ABSL_GUARDED_BY(worker_mu_);
  // Open endpoints, for the error handler.
  absl::flat_hash_map<ucp_ep_h, Peer*> peer_by_ep_ ABSL_GUARDED_BY(worker_mu_);
  absl::flat_hash_map<uint64_t, std::unique_ptr<Batch>> batches_ ABSL_GUARDED_BY(worker_mu_);
  uint64_t next_batch_id_ ABSL_GUARDED_BY(worker_mu_) = 1;
  std::vector<uint64_t> finished_ ABSL_GUARDED_BY(worker_mu_);  // batches whose callback may be due
  // Reported by the error handler, handled after progress.
  std::vector<ucp_ep_h> failed_eps_ ABSL_GUARDED_BY(worker_mu_);
  // Closing regions whose last receive completed.
  std::vector<uint64_t> drained_ ABSL_GUARDED_BY(worker_mu_);
  absl::flat_hash_map<InboundKey, Inbound> inbound_ ABSL_GUARDED_BY(worker_mu_);
  std::vector<void*> closing_ ABSL_GUARDED_BY(worker_mu_);  // endpoint close requests
  int inflight_ ABSL_GUARDED_BY(worker_mu_) = 0;            // outstanding UCP requests of all kinds
  bool stopping_ ABSL_GUARDED_BY(worker_mu_) = false;
  Clock::time_point stop_started_ ABSL_GUARDED_BY(worker_mu_);
  Clock::time_point next_deadline_ ABSL_GUARDED_BY(worker_mu_) = Clock::time_point::max();
  Clock::time_point next_gc_ ABSL_GUARDED_BY(worker_mu_);
  Clock::time_point next_liveness_check_ ABSL_GUARDED_BY(worker_mu_);
};

// ------------------------------------------------------------------------------------------
// Construction, shutdown and the thread hand-off

absl::StatusOr<std::unique_ptr<KvTransport>> UcxTransport::Create(
    const UcxTransportOptions& options) {
  TANDEM_ASSIGN_OR_RETURN(std::string tls, ResolveUcxTransports(options.transports));
  bool peer_failure = false;
  switch (options.peer_failure_detection) {
    case UcxTransportOptions::PeerFailureDetection::kAuto:
      peer_failure = !ListHasSharedMemory(tls);
      break;
    case UcxTransportOptions::PeerFailureDetection::kOn:
      peer_failure = true;
      break;
    case UcxTransportOptions::PeerFailureDetection::kOff:
      peer_failure = false;
      break;
  }
  if (ListHasTcp(tls)) AwaitRunningInterfaces(absl::Seconds(5));
  std::unique_ptr<UcxTransport> t(new UcxTransport(options, tls, peer_failure));
  TANDEM_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<KvTransport>(std::move(t));
}

absl::Status UcxTransport::Init() {
  // No other thread yet; the progress thread, started last, waits for it to return.
  absl::MutexLock l(&worker_mu_);
  std::vector<std::pair<std::string, std::string>> config = {{"TLS", tls_}};
  config.insert(config.end(), options_.ucx_config.begin(), options_.ucx_config.end());
  TANDEM_ASSIGN_OR_RETURN(
      context_,
      ucx::UcxContext::Create(config, UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP));
  TANDEM_ASSIGN_OR_RETURN(worker_, ucx::UcxWorker::Create(*context_));
  address_ = kAddressPrefix;
  AppendRaw<uint64_t>(address_, HostId());
  AppendRaw<uint32_t>(address_, static_cast<uint32_t>(getpid()));
  address_ += worker_->address();
  instance_id_ = std::random_device{}() ^ (uint64_t{std::random_device{}()} << 32) ^
                 static_cast<uint64_t>(Clock::now().time_since_epoch().count());

  for (auto [id, cb] : {std::pair<unsigned, ucp_am_recv_callback_t>{kAmWrite, &AmWriteCb},
                        std::pair<unsigned, ucp_am_recv_callback_t>{kAmAck, &AmAckCb}}) {
    ucp_am_handler_param_t p{};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                   UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id = id;
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    p.cb = cb;
    p.arg = this;
    ucs_status_t st = ucp_worker_set_am_recv_handler(worker_->get(), &p);
    if (st != UCS_OK) return FromUcsStatus(st, "ucp_worker_set_am_recv_handler");
  }

  caps_.name = "ucx";
  caps_.detail = absl::StrCat(tls_, peer_failure_ ? "; peer failure detection" : "",
                              options_.write_mode == UcxTransportOptions::WriteMode::kPut ? "; put"
                              : options_.write_mode ==
                                      UcxTransportOptions::WriteMode::kActiveMessage
                                  ? "; am"
                                  : "; put or am per peer");
  caps_.one_sided = false;
  caps_.cross_host = false;
  for (const std::string& tl : Split(tls_, ',')) {
    // One-sided for regions from AllocateRegion (shared memory) or over RDMA.
    if (tl == "all" || tl == "posix" || tl == "sysv" || tl == "xpmem" || IsRdmaTransport(tl)) {
      caps_.one_sided = true;
    }
    if (tl == "all" || tl == "tcp" || absl::StartsWith(tl, "rc") || absl::StartsWith(tl, "dc") ||
        absl::StartsWith(tl, "ud") || tl == "ib") {
      caps_.cross_host = true;
    }
  }
  if (options_.write_mode == UcxTransportOptions::WriteMode::kActiveMessage) {
    caps_.one_sided = false;
  }
  // Device memory only where this UCX build has CUDA support (cuda_copy/cuda_ipc transports),
  // asked at run time: Debian's libucx has none, a UCX built with CUDA does.
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_->get(), &attr) == UCS_OK) {
    caps_.device_memory = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  if (caps_.device_memory) caps_.detail += "; cuda memory";

  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return util::FromErrno(errno, "eventfd");
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

UcxTransport::~UcxTransport() {
  if (thread_.joinable()) {
    {
      absl::MutexLock l(&mu_);
      stop_requested_ = true;
    }
    has_tasks_.store(true);
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  // The thread has exited: its objects are ours now. Order: regions, endpoints, worker, context.
  absl::MutexLock l(&worker_mu_);
  regions_.clear();
  peers_.clear();
  // A batch UCX still holds requests of (shutdown grace ran out) is leaked on purpose: a late
  // completion callback would otherwise touch freed memory.
  for (auto& [id, b] : batches_) {
    if (b->pending > 0) (void)b.release();
  }
  batches_.clear();
  for (void* req : closing_) ucp_request_free(req);
  closing_.clear();
  worker_.reset();
  context_.reset();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void UcxTransport::Post(std::function<void()> task) {
  {
    absl::MutexLock l(&mu_);
    tasks_.push_back(std::move(task));
  }
  has_tasks_.store(true);
  // The loop re-checks has_tasks_ after announcing that it sleeps, so a Post that sees it
  // awake needs no syscall (both sides are sequentially consistent).
  if (sleeping_.load()) {
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
}

absl::Status UcxTransport::CallAndWait(
    std::function<void(std::function<void(absl::Status)>)> fn) {
  if (std::this_thread::get_id() == thread_id_) {
    // From a transfer callback: run inline; the work must not need to wait.
    std::optional<absl::Status> result;
    fn([&result](absl::Status s) { result = std::move(s); });
    if (!result.has_value()) {
      return absl::FailedPreconditionError(
          "operation would wait for receives in flight; not allowed from a transfer callback");
    }
    return *result;
  }
  struct State {
    absl::Notification done;
    absl::Status status;
  };
  auto state = std::make_shared<State>();
  Post([fn = std::move(fn), state] {
    fn([state](absl::Status s) {
      state->status = std::move(s);
      state->done.Notify();
    });
  });
  state->done.WaitForNotification();
  return state->status;
}

// ------------------------------------------------------------------------------------------
// Public operations

absl::StatusOr<RegionDescriptor> UcxTransport::RegisterRegion(void* base, uint64_t length) {
  if (base == nullptr || length == 0) {
    return absl::InvalidArgumentError("RegisterRegion needs a non-null base and a length > 0");
  }
  return AddRegion(base, length, nullptr);
}

absl::StatusOr<AllocatedRegion> UcxTransport::AllocateRegion(uint64_t length) {
  if (length == 0) return absl::InvalidArgumentError("AllocateRegion of 0 bytes");
  void* base = nullptr;
  TANDEM_ASSIGN_OR_RETURN(RegionDescriptor d, AddRegion(nullptr, length, &base));
  return AllocatedRegion{base, std::move(d)};
}

// Maps caller memory (allocated == nullptr) or lets UCX allocate it, on the progress thread.
absl::StatusOr<RegionDescriptor> UcxTransport::AddRegion(void* base, uint64_t length,
                                                         void** allocated) {
  RegionDescriptor d;
  absl::Status s = CallAndWait([&](std::function<void(absl::Status)> reply) {
    worker_mu_.AssertHeld();  // on the progress thread, as every CallAndWait task
    auto mr = allocated != nullptr ? ucx::UcxMemRegion::Allocate(*context_, length)
                                   : ucx::UcxMemRegion::Map(*context_, base, length);
    if (!mr.ok()) return reply(mr.status());
    uint64_t id = next_region_id_++;
    d.peer_address = address_;
    d.region_id = id;
    d.base = reinterpret_cast<uintptr_t>((*mr)->base());
    d.length = length;
    d.rkey = (*mr)->packed_rkey();
    if (allocated != nullptr) *allocated = (*mr)->base();
    regions_[id].mr = std::move(*mr);
    reply(absl::OkStatus());
  });
  if (!s.ok()) return s;
  return d;
}

absl::Status UcxTransport::DeregisterRegion(uint64_t region_id) {
  return CallAndWait([this, region_id](std::function<void(absl::Status)> reply) {
    worker_mu_.AssertHeld();  // on the progress thread, as every CallAndWait task
    auto it = regions_.find(region_id);
    if (it == regions_.end() || it->second.closing) {
      return reply(absl::NotFoundError(absl::StrCat("region ", region_id, " is not registered")));
    }
    Region& r = it->second;
    if (r.active_recvs == 0) {
      regions_.erase(it);  // ucp_mem_unmap
      return reply(absl::OkStatus());
    }
    if (std::this_thread::get_id() == thread_id_) {
      // Called from a transfer callback: waiting here would stop the receives it waits for.
      return reply(absl::FailedPreconditionError(absl::StrCat(
          "region ", region_id, " has receives in flight; deregister it outside a callback")));
    }
    r.closing = true;  // the AM handler refuses new writes from here on
    r.on_drained = std::move(reply);
    r.drain_deadline = Clock::now() + kDeregisterWait;
    next_deadline_ = std::min(next_deadline_, r.drain_deadline);
  });
}

void UcxTransport::WriteAsync(const RegionDescriptor& dst, std::vector<WriteOp> ops,
                              Clock::time_point deadline,
                              std::function<void(absl::Status)> done) {
  if (options_.inline_writes && TryWriteInline(dst, ops, deadline, done)) return;
  Post([this, dst, ops = std::move(ops), deadline, done = std::move(done)]() mutable {
    worker_mu_.AssertHeld();  // tasks run on the progress thread, under the lock
    StartBatch(dst, std::move(ops), deadline, std::move(done));
  });
}

// Handing a write to the progress thread costs a queue push, an eventfd wake-up, that thread's
// scheduling, and a callback from it: ~20 us on a loaded 2-vCPU guest, more than the memcpy of
// a 64 KiB shared-memory put. When the progress thread is asleep (its lock is free) and has
// nothing queued, the caller issues a put batch itself. A put into a mapped shared-memory
// segment and its flush complete inside the calls, so the callback runs here, before
// WriteAsync returns, with no thread hop at all; anything still pending (RDMA puts, a busy send
// queue) is left to the progress thread, which is woken for it.
bool UcxTransport::TryWriteInline(const RegionDescriptor& dst, std::vector<WriteOp>& ops,
                                  Clock::time_point deadline,
                                  std::function<void(absl::Status)>& done) {
  // Queued tasks (earlier writes, registrations) go first; the progress thread itself and
  // callbacks it runs take the queue (the worker lock is not reentrant).
  if (has_tasks_.load() || std::this_thread::get_id() == thread_id_.load()) return false;
  if (!worker_mu_.TryLock()) return false;
  // Only puts to a peer region already set up: those complete inside the calls. Active
  // messages wait for the receiver's ack on the progress thread anyway (measured: no gain,
  // possibly a loss), and a first write to a peer (endpoint creation) stays there too.
  bool put_ready = false;
  if (auto p = peers_.find(dst.peer_address); p != peers_.end() && !p->second->failed) {
    auto r = p->second->regions.find(dst.region_id);
    put_ready = r != p->second->regions.end() && r->second.use_put;
  }
  if (has_tasks_.load() || !put_ready) {
    worker_mu_.Unlock();
    return false;
  }
  const uint64_t id = StartBatch(dst, std::move(ops), deadline, std::move(done));
  std::function<void()> callback;
  bool wake = false;
  auto it = batches_.find(id);
  if (it != batches_.end()) {
    Batch* b = it->second.get();
    if (b->pending == 0 && !b->awaiting_ack && !b->callback_ran) {
      callback = Settle(b);
      batches_.erase(it);  // its id may still sit in finished_: AfterProgress skips it
    } else {
      wake = true;  // requests in flight: only the progress thread progresses them
    }
  }
  worker_mu_.Unlock();
  // Outside the lock: a callback may call into the transport (RegisterRegion waits for the
  // progress thread, which needs the lock).
  if (callback) callback();
  if (wake) {
    has_tasks_.store(true);  // makes a thread about to sleep look again
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
  return true;
}

std::function<void()> UcxTransport::Settle(Batch* b) {
  b->callback_ran = true;
  // A put into the shared memory of a receiver that has exited "succeeds" (we still map the
  // segment); only the process check tells.
  if (b->status.ok() && b->peer != nullptr && !b->peer->ProcessAlive()) {
    b->status = absl::UnavailableError("peer process has exited");
  }
  if (b->status.ok()) {
    bytes_written_.fetch_add(b->bytes);
    if (b->peer != nullptr) {
      absl::MutexLock l(&lanes_mu_);
      bytes_by_lanes_[b->peer->lanes] += b->bytes;
    }
  } else {
    writes_failed_.fetch_add(1);
  }
  return [done = std::move(b->done), s = b->status]() mutable { done(std::move(s)); };
}

void UcxTransport::ForgetPeer(const std::string& peer_address) {
  // The endpoint closes once batches still using it are done (Peer's destructor).
  Post([this, peer_address] {
    worker_mu_.AssertHeld();  // tasks run on the progress thread, under the lock
    peers_.erase(peer_address);
  });
}

// ------------------------------------------------------------------------------------------
// The progress loop

void UcxTransport::Loop() {
  thread_id_ = std::this_thread::get_id();
  // Held except while asleep in poll(): see worker_mu_.
  worker_mu_.Lock();
  ucp_worker_h w = worker_->get();
  Clock::time_point last_progress = Clock::now();
  for (;;) {
    if (has_tasks_.load(std::memory_order_acquire) && RunTasks()) BeginShutdown();
    unsigned n = 0;
    for (int i = 0; i < 64; ++i) {
      unsigned c = ucp_worker_progress(w);
      if (c == 0) break;
      n += c;
    }
    AfterProgress();
    Clock::time_point now = Clock::now();
    if (now >= next_deadline_ || stopping_) CheckDeadlines(now);
    if (now >= next_liveness_check_ && !batches_.empty()) {
      next_liveness_check_ = now + std::chrono::milliseconds(5);
      CheckPeerProcesses();
    }
    AfterProgress();
    if (stopping_ && ReadyToExit(now)) break;
    if (n > 0) {
      last_progress = now;
      continue;
    }
    bool busy = Busy();
    if (busy) {
      if (options_.progress_mode == UcxTransportOptions::ProgressMode::kPolling) continue;
      if (options_.progress_mode == UcxTransportOptions::ProgressMode::kAdaptive &&
          now - last_progress < options_.spin) {
        continue;
      }
    }
    // Sleep until the worker or a task needs us (or a deadline / a short nap while busy, in
    // case some transport's events do not cover everything in flight).
    if (ucp_worker_arm(w) == UCS_ERR_BUSY) continue;
    sleeping_.store(true);
    if (has_tasks_.load()) {
      sleeping_.store(false);
      continue;
    }
    int timeout_ms = -1;
    if (busy || stopping_) timeout_ms = 1;
    if (next_deadline_ != Clock::time_point::max()) {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline_ - now).count();
      ms = std::max<int64_t>(ms + 1, 0);
      if (timeout_ms < 0 || ms < timeout_ms) timeout_ms = static_cast<int>(std::min<int64_t>(ms, 60'000));
    }
    if (!inbound_.empty() && (timeout_ms < 0 || timeout_ms > 1000)) timeout_ms = 1000;  // GC
    pollfd fds[2] = {{worker_->event_fd(), POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    worker_mu_.Unlock();
    int rc = poll(fds, 2, timeout_ms);
    worker_mu_.Lock();
    sleeping_.store(false);
    if (rc > 0 && (fds[1].revents & POLLIN)) {
      uint64_t v;
      (void)!read(wake_fd_, &v, sizeof(v));
    }
    last_progress = Clock::now();
  }
  // Exit: everything left is force-closed; callbacks that are still due run now.
  for (auto& [id, b] : batches_) {
    if (!b->callback_ran) {
      Fail(b.get(), absl::CancelledError("UCX transport shut down"));
      b->give_up_at = Clock::time_point::min();
      finished_.push_back(id);
    }
  }
  AfterProgress();
  inbound_.clear();
  worker_mu_.Unlock();
}

// Returns true when a stop was requested.
bool UcxTransport::RunTasks() {
  std::vector<std::function<void()>> tasks;
  bool stop;
  {
    absl::MutexLock l(&mu_);
    tasks.swap(tasks_);
    has_tasks_.store(false, std::memory_order_relaxed);
    stop = stop_requested_;
  }
  for (auto& t : tasks) t();
  return stop && !stopping_;
}

bool UcxTransport::Busy() const {
  if (inflight_ > 0 || !closing_.empty()) return true;
  for (const auto& [id, b] : batches_) {
    if (b->awaiting_ack) return true;
  }
  return false;
}

void UcxTransport::BeginShutdown() {
  stopping_ = true;
  stop_started_ = Clock::now();
  std::vector<std::shared_ptr<Peer>> peers;
  for (auto& [addr, p] : peers_) peers.push_back(p);
  for (auto& [id, b] : batches_) peers.push_back(b->peer);
  for (auto& p : peers) {
    if (p) DropPeer(p, absl::CancelledError("UCX transport shut down"));
  }
  peers_.clear();
}

bool UcxTransport::ReadyToExit(Clock::time_point now) {
  bool grace_over = now - stop_started_ > kShutdownGrace;
  bool receives_done = true;
  for (auto& [id, r] : regions_) receives_done &= r.active_recvs == 0;
  return grace_over || (batches_.empty() && closing_.empty() && receives_done);
}

// Work that must not run inside UCX callbacks: endpoint failures, region drains, completed
// batches (user callbacks), finished endpoint closes and stale inbound records.
void UcxTransport::AfterProgress() {
  while (!failed_eps_.empty()) {
    ucp_ep_h ep = failed_eps_.back();
    failed_eps_.pop_back();
    auto it = peer_by_ep_.find(ep);
    if (it == peer_by_ep_.end()) continue;
    Peer* raw = it->second;
    auto cached = peers_.find(raw->address);
    std::shared_ptr<Peer> p;
    if (cached != peers_.end() && cached->second.get() == raw) p = cached->second;
    for (auto& [id, b] : batches_) {
      if (b->peer.get() == raw) p = b->peer;
    }
    if (p) DropPeer(p, absl::UnavailableError("UCX endpoint to peer failed"));
  }
  while (!drained_.empty()) {
    uint64_t id = drained_.back();
    drained_.pop_back();
    FinishDeregister(id, absl::OkStatus());
  }
  while (!finished_.empty()) {
    std::vector<uint64_t> ids;
    ids.swap(finished_);
    for (uint64_t id : ids) {
      auto it = batches_.find(id);
      if (it == batches_.end()) continue;
      Batch* b = it->second.get();
      bool settled = b->pending == 0 && !b->awaiting_ack;
      if (!b->callback_ran && (settled || Clock::now() >= b->give_up_at)) {
        Settle(b)();
        it = batches_.find(id);  // the callback may have started new batches
      }
      if (it != batches_.end() && it->second->callback_ran && it->second->pending == 0) {
        batches_.erase(it);
      }
    }
  }
  for (size_t i = 0; i < closing_.size();) {
    if (ucp_request_check_status(closing_[i]) != UCS_INPROGRESS) {
      ucp_request_free(closing_[i]);
      closing_[i] = closing_.back();
      closing_.pop_back();
    } else {
      ++i;
    }
  }
}

// Batches waiting on a receiver process that has exited fail now: nobody will read their
// source buffers any more, so their callbacks need not wait for UCX to hand requests back.
void UcxTransport::CheckPeerProcesses() {
  std::vector<std::shared_ptr<Peer>> dead;
  for (auto& [id, b] : batches_) {
    if (b->callback_ran || b->peer == nullptr || b->peer->pidfd < 0) continue;
    if (std::find(dead.begin(), dead.end(), b->peer) == dead.end() && !b->peer->ProcessAlive()) {
      dead.push_back(b->peer);
    }
  }
  for (auto& peer : dead) {
    DropPeer(peer, absl::UnavailableError("peer process has exited"));
    for (auto& [id, b] : batches_) {
      if (b->peer == peer && !b->callback_ran) {
        Fail(b.get(), absl::UnavailableError("peer process has exited"));
        b->give_up_at = Clock::time_point::min();
        finished_.push_back(id);
      }
    }
  }
}

void UcxTransport::CheckDeadlines(Clock::time_point now) {
  next_deadline_ = Clock::time_point::max();
  std::vector<Batch*> expired;
  for (auto& [id, b] : batches_) {
    if (b->callback_ran) continue;
    if (!b->deadline_handled && now >= b->deadline) {
      expired.push_back(b.get());
    } else if (!b->deadline_handled) {
      next_deadline_ = std::min(next_deadline_, b->deadline);
    }
    if (b->deadline_handled) {
      if (now >= b->give_up_at) {
        finished_.push_back(id);
      } else {
        next_deadline_ = std::min(next_deadline_, b->give_up_at);
      }
    }
  }
  for (Batch* b : expired) {
    b->deadline_handled = true;
    Fail(b, absl::DeadlineExceededError(
                absl::StrCat("KV write of ", b->bytes, " bytes not complete by its deadline")));
    for (void* req : b->requests) ucp_request_cancel(worker_->get(), req);
    if (b->pending > 0) {
      // UCX 1.13 cannot cancel send requests: closing the endpoint by force completes them (with
      // an error), after which UCX no longer touches the source buffers.
      DropPeer(b->peer, absl::UnavailableError(
                            "connection closed because a write to the same peer timed out"));
      b->give_up_at = now + kCancelGrace;
      next_deadline_ = std::min(next_deadline_, b->give_up_at);
    }
    MaybeFinish(b);
  }
  // Regions whose deregistration waits on receives that never finish.
  for (auto& [id, r] : regions_) {
    if (r.on_drained && now >= r.drain_deadline) {
      auto reply = std::move(r.on_drained);
      r.on_drained = nullptr;
      reply(absl::DeadlineExceededError(
          absl::StrCat("region ", id, ": receives still in flight; it stays registered")));
    } else if (r.on_drained) {
      next_deadline_ = std::min(next_deadline_, r.drain_deadline);
    }
  }
  if (!inbound_.empty() && now >= next_gc_) {
    next_gc_ = now + std::chrono::seconds(1);
    absl::erase_if(inbound_, [now](const auto& kv) {
      return now - kv.second.last_activity > kInboundIdleDrop;
    });
  }
}

// ------------------------------------------------------------------------------------------
// Sending

uint64_t UcxTransport::StartBatch(const RegionDescriptor& dst, std::vector<WriteOp> ops,
                                  Clock::time_point deadline,
                                  std::function<void(absl::Status)> done) {
  auto owned = std::make_unique<Batch>();
  Batch* b = owned.get();
  b->owner = this;
  b->id = next_batch_id_++;
  b->done = std::move(done);
  b->deadline = deadline;
  b->bytes = TotalBytes(ops);
  batches_.emplace(b->id, std::move(owned));

  absl::Status s;
  if (stopping_) {
    s = absl::CancelledError("UCX transport shut down");
  } else if (s = ValidateOps(dst.length, ops); !s.ok()) {
  } else if (Clock::now() > deadline) {
    s = absl::DeadlineExceededError("KV write deadline passed before it started");
  } else if (b->bytes > 0) {
    auto peer = GetPeer(dst.peer_address);
    if (!peer.ok()) {
      s = peer.status();
    } else if (!(*peer)->ProcessAlive()) {
      DropPeer(*peer, absl::UnavailableError("peer process has exited"));
      s = absl::UnavailableError("peer process has exited");
    } else {
      b->peer = std::move(*peer);
      auto remote = GetRemoteRegion(*b->peer, dst);
      if (!remote.ok()) {
        s = remote.status();
      } else {
        b->remote = *remote;
        s = b->remote->use_put ? IssuePuts(b, dst, ops) : IssueMessages(b, dst, ops);
      }
    }
  }
  if (!s.ok()) Fail(b, std::move(s));
  if (!b->callback_ran && b->deadline < next_deadline_) next_deadline_ = b->deadline;
  MaybeFinish(b);
  return b->id;
}

absl::Status UcxTransport::IssuePuts(Batch* b, const RegionDescriptor& dst,
                                     const std::vector<WriteOp>& ops) {
  Peer& peer = *b->peer;
  ucx::UcxRemoteKey* rkey = b->remote->rkey.get();
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  param.cb.send = &SendDoneCb;
  param.user_data = b;
  param.memory_type = UCS_MEMORY_TYPE_HOST;
  for (const WriteOp& op : ops) {
    if (op.length == 0) continue;
    ucs_status_ptr_t req = ucp_put_nbx(peer.ep->get(), op.src, op.length,
                                       dst.base + op.remote_offset, rkey->get(), &param);
    if (!Track(b, req, "ucp_put_nbx")) return absl::OkStatus();  // Track recorded the error
  }
  // Remote completion: the flush completes once every put before it is in the peer's memory.
  ucp_request_param_t fparam{};
  fparam.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  fparam.cb.send = &SendDoneCb;
  fparam.user_data = b;
  Track(b, ucp_ep_flush_nbx(peer.ep->get(), &fparam), "ucp_ep_flush_nbx");
  return absl::OkStatus();
}

absl::Status UcxTransport::IssueMessages(Batch* b, const RegionDescriptor& dst,
                                         const std::vector<WriteOp>& ops) {
  Peer& peer = *b->peer;
  uint32_t n = 0;
  for (const WriteOp& op : ops) n += op.length > 0;
  b->headers.reserve(n);
  b->awaiting_ack = true;
  for (const WriteOp& op : ops) {
    if (op.length == 0) continue;
    b->headers.push_back(AmWriteHeader{kWriteMagic, n, instance_id_, b->id, dst.region_id,
                                       op.remote_offset, HostId(), MonotonicNs(b->deadline)});
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.cb.send = &SendDoneCb;
    param.user_data = b;
    param.memory_type = UCS_MEMORY_TYPE_HOST;
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    if (op.length >= options_.am_rndv_threshold) param.flags |= UCP_AM_SEND_FLAG_RNDV;
    ucs_status_ptr_t req = ucp_am_send_nbx(peer.ep->get(), kAmWrite, &b->headers.back(),
                                           sizeof(AmWriteHeader), op.src, op.length, &param);
    if (!Track(b, req, "ucp_am_send_nbx")) break;
  }
  return absl::OkStatus();
}

// Accounts for a request just issued. False (and the batch failed) if it failed at once.
bool UcxTransport::Track(Batch* b, ucs_status_ptr_t req, std::string_view what) {
  if (req == nullptr) return true;
  if (UCS_PTR_IS_ERR(req)) {
    Fail(b, FromUcsStatus(UCS_PTR_STATUS(req), what));
    return false;
  }
  ++b->pending;
  ++inflight_;
  b->requests.push_back(req);
  return true;
}

void UcxTransport::OnRequestDone(Batch* b, void* request, ucs_status_t st) {
  auto it = std::find(b->requests.begin(), b->requests.end(), request);
  if (it != b->requests.end()) {
    *it = b->requests.back();
    b->requests.pop_back();
  }
  ucp_request_free(request);
  --b->pending;
  --inflight_;
  if (st != UCS_OK) Fail(b, FromUcsStatus(st, "KV write to peer"));
  MaybeFinish(b);
}

// Records the first error; a failed batch no longer waits for the receiver's ack.
void UcxTransport::Fail(Batch* b, absl::Status s) {
  if (b->status.ok()) b->status = std::move(s);
  b->awaiting_ack = false;
}

void UcxTransport::MaybeFinish(Batch* b) {
  if ((b->pending == 0 && !b->awaiting_ack) || b->callback_ran) finished_.push_back(b->id);
}

absl::StatusOr<std::shared_ptr<UcxTransport::Peer>> UcxTransport::GetPeer(
    const std::string& address) {
  auto it = peers_.find(address);
  if (it != peers_.end()) return it->second;
  if (!absl::StartsWith(address, kAddressPrefix) || address.size() < kAddressHeader + 8) {
    return absl::InvalidArgumentError("descriptor is not for the UCX transport");
  }
  uint64_t host = 0;
  uint32_t pid = 0;
  std::memcpy(&host, address.data() + sizeof(kAddressPrefix) - 1, sizeof(host));
  std::memcpy(&pid, address.data() + sizeof(kAddressPrefix) - 1 + 8, sizeof(pid));
  int pidfd = -1;
  if (host == HostId() && pid != static_cast<uint32_t>(getpid())) {
    pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
    if (pidfd < 0 && errno == ESRCH) {
      return absl::UnavailableError(absl::StrCat("peer process ", pid, " has exited"));
    }
  }
  std::string_view raw(address);
  raw.remove_prefix(kAddressHeader);
  auto ep = ucx::UcxEndpoint::Create(
      *worker_, {.remote_address = raw,
                 .peer_error_handling = peer_failure_,
                 .on_error = &EndpointErrorCb,
                 .on_error_arg = this});
  if (!ep.ok()) {
    if (pidfd >= 0) close(pidfd);
    return absl::UnavailableError(absl::StrCat("cannot reach peer: ", ep.status().message()));
  }
  auto peer = std::make_shared<Peer>();
  peer->owner = this;
  peer->pidfd = pidfd;
  peer->address = address;
  peer->ep = std::move(*ep);
  std::string rma_tls;
  peer->rdma = EndpointHasRdma(peer->ep->Info(), &rma_tls);
  std::vector<std::string> lanes = Split(rma_tls, ',');
  std::sort(lanes.begin(), lanes.end());
  lanes.erase(std::unique(lanes.begin(), lanes.end()), lanes.end());
  peer->lanes = absl::StrJoin(lanes, ",");
  peer_by_ep_[peer->ep->get()] = peer.get();
  peers_[address] = peer;
  return peer;
}

absl::StatusOr<UcxTransport::RemoteRegion*> UcxTransport::GetRemoteRegion(
    Peer& peer, const RegionDescriptor& dst) {
  auto it = peer.regions.find(dst.region_id);
  if (it != peer.regions.end()) return &it->second;
  RemoteRegion r;
  if (!dst.rkey.empty()) {
    auto rkey = ucx::UcxRemoteKey::Unpack(peer.ep->get(), dst.rkey);
    if (rkey.ok()) r.rkey = std::move(*rkey);
  }
  switch (options_.write_mode) {
    case UcxTransportOptions::WriteMode::kPut:
      if (r.rkey == nullptr) {
        return absl::InvalidArgumentError("descriptor carries no remote key usable for puts");
      }
      r.use_put = true;
      break;
    case UcxTransportOptions::WriteMode::kActiveMessage:
      r.use_put = false;
      break;
    case UcxTransportOptions::WriteMode::kAuto: {
      // ucp_rkey_ptr succeeds when the region is a shared-memory segment mapped here: then a
      // put is a plain memcpy by UCX. Otherwise puts are native only over RDMA.
      void* local = nullptr;
      r.use_put = r.rkey != nullptr &&
                  (peer.rdma || ucp_rkey_ptr(r.rkey->get(), dst.base, &local) == UCS_OK);
      break;
    }
  }
  return &peer.regions.emplace(dst.region_id, std::move(r)).first->second;
}

// Takes a peer out of service: out of the cache, endpoint force-closed (outstanding requests
// complete with errors), batches waiting on its acks failed.
void UcxTransport::DropPeer(const std::shared_ptr<Peer>& peer, const absl::Status& why) {
  auto it = peers_.find(peer->address);
  if (it != peers_.end() && it->second == peer) peers_.erase(it);
  peer->failed = true;
  for (auto& [id, b] : batches_) {
    if (b->peer == peer && b->awaiting_ack) {
      Fail(b.get(), why);
      MaybeFinish(b.get());
    }
  }
  peer->regions.clear();
  if (peer->ep != nullptr) CloseEndpoint(std::move(peer->ep), /*force=*/true);
}

void UcxTransport::CloseEndpoint(std::unique_ptr<ucx::UcxEndpoint> ep, bool force) {
  peer_by_ep_.erase(ep->get());
  ucs_status_ptr_t req = ep->StartClose(force);
  if (req != nullptr && !UCS_PTR_IS_ERR(req)) closing_.push_back(req);
}

void UcxTransport::OnEndpointError(ucp_ep_h ep, ucs_status_t) {
  failed_eps_.push_back(ep);  // handled after ucp_worker_progress returns
}

// ------------------------------------------------------------------------------------------
// Receiving (active-message path)

ucs_status_t UcxTransport::OnAmWrite(const void* header, size_t header_length, void* data,
                                     size_t length, const ucp_am_recv_param_t* param) {
  AmWriteHeader h;
  if (header_length != sizeof(h)) return UCS_OK;  // not ours: drop
  std::memcpy(&h, header, sizeof(h));
  if (h.magic != kWriteMagic || h.num_ops == 0) return UCS_OK;
  InboundKey key{h.sender_id, h.batch_id};
  Inbound& in = inbound_[key];
  if (in.expected == 0) {
    in.expected = h.num_ops;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) in.reply_ep = param->reply_ep;
  }
  in.last_activity = Clock::now();

  auto rit = regions_.find(h.region_id);
  absl::Status refused;
  if (h.sender_host == HostId() && MonotonicNs(Clock::now()) > h.deadline_ns) {
    // The sender has given up on this batch (and may reuse both its buffer and, through the
    // control plane, these blocks): landing it now could only corrupt a later write.
    refused = absl::DeadlineExceededError("write arrived after its deadline");
  } else if (rit == regions_.end() || rit->second.closing) {
    refused = absl::NotFoundError(absl::StrCat("region ", h.region_id, " is not registered"));
  } else if (h.offset > rit->second.mr->length() ||
             length > rit->second.mr->length() - h.offset) {
    refused = absl::InvalidArgumentError(absl::StrCat(
        "write [", h.offset, ", +", length, ") is outside region ", h.region_id, " of ",
        rit->second.mr->length(), " bytes"));
  }
  if (!refused.ok()) {
    // Returning OK without receiving drops a rendezvous payload; the ack carries the refusal.
    if (in.status.ok()) in.status = std::move(refused);
    ++in.landed;
    MaybeAck(key);
    return UCS_OK;
  }
  Region& r = rit->second;
  uint8_t* dst = r.mr->base() + h.offset;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    auto* ctx = new RecvContext{this, key, h.region_id, length};
    ++r.active_recvs;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p.cb.recv_am = &RecvDoneCb;
    p.user_data = ctx;
    p.memory_type = UCS_MEMORY_TYPE_HOST;
    ucs_status_ptr_t req = ucp_am_recv_data_nbx(worker_->get(), data, dst, length, &p);
    if (req == nullptr) {
      OnRecvDone(ctx, UCS_OK);
    } else if (UCS_PTR_IS_ERR(req)) {
      OnRecvDone(ctx, UCS_PTR_STATUS(req));
    } else {
      ++inflight_;
    }
    return UCS_OK;
  }
  std::memcpy(dst, data, length);
  bytes_received_.fetch_add(length);
  ++in.landed;
  MaybeAck(key);
  return UCS_OK;
}

void UcxTransport::OnRecvDone(RecvContext* ctx, ucs_status_t st) {
  auto rit = regions_.find(ctx->region_id);
  if (rit != regions_.end() && --rit->second.active_recvs == 0 && rit->second.closing) {
    drained_.push_back(ctx->region_id);
  }
  auto it = inbound_.find(ctx->key);
  if (it != inbound_.end()) {
    Inbound& in = it->second;
    if (st == UCS_OK) {
      bytes_received_.fetch_add(ctx->length);
    } else if (in.status.ok()) {
      in.status = FromUcsStatus(st, "receiving KV write");
    }
    ++in.landed;
    in.last_activity = Clock::now();
    MaybeAck(ctx->key);
  }
  delete ctx;
}

void UcxTransport::MaybeAck(const InboundKey& key) {
  auto it = inbound_.find(key);
  if (it == inbound_.end() || it->second.landed < it->second.expected) return;
  Inbound in = std::move(it->second);
  inbound_.erase(it);
  if (in.reply_ep == nullptr) return;
  auto* ack = new AckMessage{
      AmAckHeader{kAckMagic, static_cast<int32_t>(in.status.code()), key.sender_id,
                  key.batch_id},
      std::string(in.status.message())};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = &AckSentCb;
  p.user_data = ack;
  p.flags = UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t req = ucp_am_send_nbx(in.reply_ep, kAmAck, &ack->header, sizeof(ack->header),
                                         ack->text.data(), ack->text.size(), &p);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) delete ack;  // sent at once, or peer gone
}

ucs_status_t UcxTransport::OnAmAck(const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param) {
  AmAckHeader h;
  if (header_length != sizeof(h)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  if (h.magic != kAckMagic || h.sender_id != instance_id_) return UCS_OK;
  auto it = batches_.find(h.batch_id);
  if (it == batches_.end() || !it->second->awaiting_ack) return UCS_OK;
  Batch* b = it->second.get();
  b->awaiting_ack = false;
  if (h.code != 0) {
    std::string text;
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
      text.assign(static_cast<const char*>(data), length);
    }
    Fail(b, absl::Status(static_cast<absl::StatusCode>(h.code),
                         absl::StrCat("peer refused KV write: ", text)));
  }
  MaybeFinish(b);
  return UCS_OK;
}

void UcxTransport::FinishDeregister(uint64_t region_id, absl::Status s) {
  auto it = regions_.find(region_id);
  if (it == regions_.end() || !it->second.closing || it->second.active_recvs > 0) return;
  auto reply = std::move(it->second.on_drained);
  regions_.erase(it);  // ucp_mem_unmap
  if (reply) reply(std::move(s));
}

}  // namespace

absl::StatusOr<std::string> ResolveUcxTransports(const std::string& transports) {
  if (transports == "shm") return std::string("posix,sysv,cma,self");
  if (transports == "tcp") return std::string("tcp,self");
  if (transports == "all") return std::string("all");
  if (transports.empty()) return absl::InvalidArgumentError("empty UCX transport list");
  for (char c : transports) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == ',' || c == '^')) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad UCX transport list '", transports, "' (want e.g. shm, tcp, all or "
                       "posix,cma,tcp)"));
    }
  }
  return transports;
}

absl::StatusOr<std::unique_ptr<KvTransport>> CreateUcxTransport(
    const UcxTransportOptions& options) {
  return UcxTransport::Create(options);
}

}  // namespace tandem::transfer
