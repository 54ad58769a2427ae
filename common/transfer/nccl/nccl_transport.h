// NcclTransport: KvTransport between GPUs over NCCL point-to-point (ncclSend / ncclRecv), for
// KV caches that live in device memory (the Debian UCX build has no CUDA support).
//
// Bootstrap: one process creates a unique id (CreateUniqueId, 128 opaque bytes) and hands it to
// the others over gRPC; every process then calls Init(rank, nranks, id, deadline), which blocks
// until all ranks have joined or the deadline passed (a non-blocking ncclCommInitRankConfig,
// aborted at the deadline, so a peer that dies before joining costs no hung thread). Regions
// and sources are device pointers on `device`; regions may be registered before Init (their
// descriptors then name the rank's address only after Init; AddressOfRank computes it).
//
// How the receiver learns what to receive. NCCL is two-sided: every ncclSend needs a matching
// ncclRecv of the same size, matched in order per (sender, receiver) pair. So each message from
// a rank to another starts with a fixed 64-byte header, and every rank keeps one header receive
// posted per peer (on that peer's receive stream):
//   WRITE {batch, region, num_ops} is followed by an op table (num_ops x {offset, length}) and
//         then the op payloads. On the header the receiver posts the table receive; on the
//         table it checks every op against its region and posts one ncclRecv per op straight
//         into the region (ops it refuses are received into scratch memory and dropped), then
//         re-posts the header receive.
//   ACK   {batch, status} goes back once the payload receives completed: the sender completes
//         the batch on it, so OK means the bytes are in the receiver's device memory.
// Sends of one rank (headers, tables, payloads, acks) are ordered on one send stream.
//
// Threading: one progress thread per transport owns the communicator and the streams; public
// methods hand work to it. With receives always posted it cannot sleep on an fd, so it polls
// the streams with a backoff that reaches 1 ms when nothing moves (about 1000 cheap wakeups a
// second when idle).
// Errors: a deadline cannot cancel an NCCL operation; the communicator is aborted
// (ncclCommAbort), the batch gets DEADLINE_EXCEEDED and every later call UNAVAILABLE until the
// caller builds a new transport. Concurrent NCCL kernels on several streams of one
// communicator (a posted header receive next to a send) need the GPU to co-schedule them, which
// NCCL documents as not guaranteed; keep at most a few peers per transport.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/transfer/transfer.h"

namespace tandem::transfer {

struct NcclTransportOptions {
  int device = 0;  // CUDA device of this rank
};

class NcclTransport : public KvTransport {
 public:
  // ncclGetUniqueId as bytes, to send to the other ranks over the control plane.
  static absl::StatusOr<std::string> CreateUniqueId();
  // Fails (UNAVAILABLE) when there is no CUDA device.
  static absl::StatusOr<std::unique_ptr<NcclTransport>> Create(const NcclTransportOptions& opts);
  // Joins the communicator; blocks until all `nranks` ranks have called it (OK), or until
  // `deadline` (DEADLINE_EXCEEDED; the half-built communicator is aborted and the transport
  // stays unusable).
  virtual absl::Status Init(int rank, int nranks, const std::string& unique_id,
                            std::chrono::steady_clock::time_point deadline) = 0;
  absl::Status Init(int rank, int nranks, const std::string& unique_id) {
    return Init(rank, nranks, unique_id, std::chrono::steady_clock::time_point::max());
  }

  // The RegionDescriptor::peer_address of `rank` in the communicator of `unique_id`: a sender
  // that learnt a region's id out of band builds the descriptor with it.
  static std::string AddressOfRank(std::string_view unique_id, int rank) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (unsigned char c : unique_id) h = (h ^ c) * 1099511628211ull;
    return "nccl:" + std::to_string(h) + ":" + std::to_string(rank);
  }
};

}  // namespace tandem::transfer
