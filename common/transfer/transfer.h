// KvTransport: how KV-cache bytes move between workers, never through gRPC or the router.
//
// Why an interface: the same prefill→decode handoff must run over UCX (shared memory, TCP, RDMA,
// CUDA when UCX has it), NCCL between GPUs, and an in-process loop for unit tests, and the
// services must not care which. Each backend states what it can do in Capabilities; core code
// never names a backend.
//
// Model: the receiver (decode worker, kvstore) registers a memory region — its whole KV pool —
// and hands the region's descriptor to the sender inside a control-plane (gRPC) message. The
// sender then writes byte ranges of its own memory into that region at chosen offsets. A
// backend may do that with one-sided puts (shm, RDMA) or with active messages received straight
// into the region (TCP, where UCX emulates puts slowly); either way the bytes land in the
// receiver's memory without the receiver's code copying them, and the sender learns when they
// are visible there. Completion of a handoff is then announced over gRPC (with checksums).
//
// Ownership: the caller owns all memory. Registered memory must stay mapped until Deregister
// returns. Source buffers of a write must stay unchanged until its callback has run.
// Threading: every method is thread-safe. Callbacks run on the transport's progress thread, or
// on the caller's thread before WriteAsync returns when the write completed at once (UCX puts
// into shared memory), so a caller must not hold across WriteAsync a lock its callback takes.
// Callbacks must not block; they may call WriteAsync again. The progress thread sleeps when
// idle (no busy polling), so an idle worker costs no CPU.
// Errors: an unreachable or dead peer, a bad descriptor or an out-of-range write is a Status,
// delivered through the callback; nothing here aborts the process.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::transfer {

struct Capabilities {
  std::string name;            // "ucx", "nccl", "inproc"
  std::string detail;          // e.g. the UCX transports in use: "posix,sysv,cma,tcp"
  bool one_sided = false;      // writes need no receiver-side progress (put), vs messages
  bool device_memory = false;  // regions may live in GPU memory
  bool cross_host = false;     // peers may be on other hosts
};

// What a receiver publishes so that a sender can write into its region. Plain bytes, so it can
// travel in a protobuf `bytes` field.
struct RegionDescriptor {
  std::string peer_address;  // the receiver's transport endpoint (e.g. packed UCX worker address)
  uint64_t region_id = 0;    // receiver-chosen id of the registered region
  uint64_t base = 0;         // remote virtual address of the region's first byte (if meaningful)
  uint64_t length = 0;
  std::string rkey;          // packed remote key (one-sided backends); empty otherwise

  std::string Serialize() const;
  static absl::StatusOr<RegionDescriptor> Parse(std::string_view bytes);
};

struct WriteOp {
  const void* src = nullptr;  // local bytes
  uint64_t length = 0;
  uint64_t remote_offset = 0;  // from the start of the remote region
};

// Memory a transport allocated and registered itself (see KvTransport::AllocateRegion).
struct AllocatedRegion {
  void* base = nullptr;
  RegionDescriptor descriptor;
};

struct TransportStats {
  uint64_t bytes_written = 0;   // bytes this endpoint sent and saw completed
  uint64_t bytes_received = 0;  // bytes that landed in this endpoint's regions, where visible
  uint64_t writes_failed = 0;
  // bytes_written by the lanes they went over: the backend's transports on the connection to
  // the receiver, sorted and comma-joined (UCX: "tcp", "cma,posix", "rc_mlx5"; a backend with
  // one kind of lane: its name). Shows where KV really travelled (e.g. never shared memory
  // between pods).
  std::map<std::string, uint64_t> bytes_written_by_lanes;
};

class KvTransport {
 public:
  virtual ~KvTransport() = default;

  virtual Capabilities capabilities() const = 0;

  // Makes [base, base + length) writable by peers. The descriptor goes to senders over gRPC.
  virtual absl::StatusOr<RegionDescriptor> RegisterRegion(void* base, uint64_t length) = 0;
  // Allocates `length` bytes that peers can write into most cheaply and registers them (UCX: a
  // shared-memory segment that local peers map, so a put is a single memcpy with no work on
  // this side). The transport owns the memory; DeregisterRegion frees it. Backends without a
  // better allocator return UNIMPLEMENTED (then allocate yourself and RegisterRegion).
  virtual absl::StatusOr<AllocatedRegion> AllocateRegion(uint64_t length);
  // After this returns no peer write lands in the region any more. NOT_FOUND for an unknown id.
  virtual absl::Status DeregisterRegion(uint64_t region_id) = 0;

  // Writes every op into the remote region; `done` runs exactly once, with OK when all bytes
  // are visible in the receiver's memory, or with the first error (UNAVAILABLE for a dead or
  // unreachable peer, INVALID_ARGUMENT for a range outside the region, NOT_FOUND where the
  // receiver can tell that the region was deregistered, DEADLINE_EXCEEDED).
  virtual void WriteAsync(const RegionDescriptor& dst, std::vector<WriteOp> ops,
                          std::chrono::steady_clock::time_point deadline,
                          std::function<void(absl::Status)> done) = 0;

  // Drops cached connections to a peer (e.g. after it left the cluster).
  virtual void ForgetPeer(const std::string& peer_address) = 0;

  virtual TransportStats stats() const = 0;

  // Blocking convenience over WriteAsync.
  absl::Status Write(const RegionDescriptor& dst, std::vector<WriteOp> ops,
                     std::chrono::milliseconds timeout);
};

}  // namespace tandem::transfer
