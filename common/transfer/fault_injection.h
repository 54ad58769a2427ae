// FaultInjectingTransport: a KvTransport decorator that corrupts KV bytes in flight, for the
// fault-injection suite (tests/fault) only. Never enable it in production.
//
// Why it exists: the decode worker must refuse a sequence whose transferred KV differs from what
// prefill computed (block checksums, kv_layout.h), and the only honest way to prove that across
// real processes is to corrupt a real transfer. The decorator wraps whichever backend the worker
// runs (UCX, inproc), so the production write path, the checksums and the decode-side check are
// all exercised unchanged; only the bytes that land differ.
//
// What it does: every Nth WriteAsync call (counting from 1) that carries at least one op sends
// its first op from a private copy with one bit flipped (the middle byte of the op, a bit chosen
// round-robin). The caller's source buffer is never touched, so the sender's own KV and the
// checksums it computed from it stay correct: the receiver sees exactly one wrong bit. Every
// other call, and every other method, is forwarded to the wrapped transport as is.
//
// Threading: as thread-safe as KvTransport requires; the call counter is atomic.
// Ownership: owns the wrapped transport. The private copy lives until the write's callback ran.
// Errors: none of its own; the wrapped transport's statuses pass through unchanged.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "common/transfer/transfer.h"

namespace tandem::transfer {

struct FaultInjectionOptions {
  // Corrupt one bit of every Nth write call; 0 disables injection (everything is forwarded).
  uint64_t flip_bit_every_n_writes = 0;
};

class FaultInjectingTransport : public KvTransport {
 public:
  FaultInjectingTransport(std::unique_ptr<KvTransport> inner, const FaultInjectionOptions& o);

  // The wrapped backend's, with "fault-injection" appended to the detail so logs and
  // PrefillResponse.transport show that this worker corrupts its writes.
  Capabilities capabilities() const override;
  absl::StatusOr<RegionDescriptor> RegisterRegion(void* base, uint64_t length) override;
  absl::StatusOr<AllocatedRegion> AllocateRegion(uint64_t length) override;
  absl::Status DeregisterRegion(uint64_t region_id) override;
  void WriteAsync(const RegionDescriptor& dst, std::vector<WriteOp> ops,
                  std::chrono::steady_clock::time_point deadline,
                  std::function<void(absl::Status)> done) override;
  void ForgetPeer(const std::string& peer_address) override;
  TransportStats stats() const override;

  // Write calls that carried ops, and how many of them were corrupted.
  uint64_t writes_seen() const { return writes_seen_.load(); }
  uint64_t bits_flipped() const { return bits_flipped_.load(); }

 private:
  std::unique_ptr<KvTransport> inner_;
  const FaultInjectionOptions o_;
  std::atomic<uint64_t> writes_seen_{0};
  std::atomic<uint64_t> bits_flipped_{0};
};

// `inner` itself when `o` injects nothing, else `inner` wrapped in a FaultInjectingTransport.
std::unique_ptr<KvTransport> MaybeInjectFaults(std::unique_ptr<KvTransport> inner,
                                               const FaultInjectionOptions& o);

}  // namespace tandem::transfer
