// NcclPairTransport: the "nccl" KvTransport of the worker binaries. It owns one two-rank
// NcclTransport (communicator) per (sender, receiver) pair and builds each one on demand, so
// workers on different nodes move KV device to device without a cluster-wide communicator.
//
// Bootstrap over the control plane. A receiver (decode) publishes descriptors whose
// peer_address names its control-plane endpoint and an instance id
// ("ncclpair:<instance>@<host:port>"). On its first write to such a peer a sender (prefill)
// calls `join` (in the services: the DecodeWorker.JoinKvGroup RPC) with the write's deadline;
// the receiver's HandleJoin creates a unique id and a rank, registers every region on it,
// starts its rank-0 Init on a thread of the pair and answers with the id and the pair's region
// ids. The sender then Inits rank 1 (same deadline), caches the pair and writes through it.
// A pair whose communicator failed (UNAVAILABLE, DEADLINE_EXCEEDED) is dropped and the next
// write to that peer joins again; so is one whose region map misses a region registered after
// the join. ForgetPeer drops a sending pair. A receiver keeps at most max_receiving_pairs
// pairs, replacing a sender's old pair when it joins again and evicting the oldest beyond that
// (a sender still using an evicted pair sees its writes fail and joins again).
//
// This file knows neither gRPC nor NCCL: `join` and the rank factory are injected, so the
// protocol is tested on the CPU with fakes and the services stay out of common/transfer.
//
// Threading: every method is thread-safe; `join`, the rank Inits and pair teardown run on
// threads of the transport, never on the caller's. Write callbacks run on a rank's progress
// thread, on a join thread (a write that waited for its pair), or on the caller's thread for
// a write refused at once. Ownership: the caller owns all memory (see transfer.h); the
// transport owns its ranks. Errors: a failed join reaches the writes that waited for it, with
// its status; a descriptor of another receiver instance (a restarted decode) is
// FAILED_PRECONDITION; DEADLINE_EXCEEDED when a pair could not be built in time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transfer/nccl/nccl_transport.h"
#include "common/transfer/transfer.h"

namespace tandem::transfer {

struct NcclJoinRequest {
  std::string receiver_instance;  // from the descriptor: refused if the receiver restarted
  std::string sender_instance;    // a sender that joins again replaces its old pair
};

struct NcclJoinReply {
  std::string unique_id;  // ncclUniqueId bytes of the pair's communicator
  // (region id in the receiver's descriptors, region id in the pair's communicator)
  std::vector<std::pair<uint64_t, uint64_t>> regions;
};

// Sender side: asks the receiver at `control_address` to start a pair. Must honour `deadline`.
using NcclJoinFn = std::function<absl::StatusOr<NcclJoinReply>(
    const std::string& control_address, const NcclJoinRequest& request,
    std::chrono::steady_clock::time_point deadline)>;

struct NcclPairTransportOptions {
  // Receiver: this worker's control-plane endpoint (host:port), written into descriptors.
  // Empty: RegisterRegion is FAILED_PRECONDITION (a sender-only transport).
  std::string control_address;
  NcclJoinFn join;  // sender; null: writes are FAILED_PRECONDITION
  // One rank of a new pair (production: NcclTransport::Create for the worker's device).
  std::function<absl::StatusOr<std::unique_ptr<NcclTransport>>()> create_rank;
  // A fresh unique id (production: NcclTransport::CreateUniqueId).
  std::function<absl::StatusOr<std::string>()> create_unique_id;
  size_t max_receiving_pairs = 64;
};

class NcclPairTransport : public KvTransport {
 public:
  // INVALID_ARGUMENT when create_rank or create_unique_id is missing.
  static absl::StatusOr<std::unique_ptr<NcclPairTransport>> Create(NcclPairTransportOptions o);

  // Receiver side of `join` (the services call it from the RPC handler): returns once the
  // pair's rank 0 is joining in the background; its Init gives up at `deadline`.
  virtual absl::StatusOr<NcclJoinReply> HandleJoin(
      const NcclJoinRequest& request, std::chrono::steady_clock::time_point deadline) = 0;

  // Random per transport: a restarted receiver at the same address refuses old descriptors.
  virtual std::string instance() const = 0;
  // Pairs held now (sending, receiving), for tests and stats.
  virtual std::pair<size_t, size_t> pair_counts() const = 0;
};

}  // namespace tandem::transfer
