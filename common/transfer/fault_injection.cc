#include "common/transfer/fault_injection.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tandem::transfer {

FaultInjectingTransport::FaultInjectingTransport(std::unique_ptr<KvTransport> inner,
                                                 const FaultInjectionOptions& o)
    : inner_(std::move(inner)), o_(o) {}

Capabilities FaultInjectingTransport::capabilities() const {
  Capabilities c = inner_->capabilities();
  c.detail = c.detail.empty() ? "fault-injection" : absl::StrCat(c.detail, ",fault-injection");
  return c;
}

absl::StatusOr<RegionDescriptor> FaultInjectingTransport::RegisterRegion(void* base,
                                                                        uint64_t length) {
  return inner_->RegisterRegion(base, length);
}

absl::StatusOr<AllocatedRegion> FaultInjectingTransport::AllocateRegion(uint64_t length) {
  return inner_->AllocateRegion(length);
}

absl::Status FaultInjectingTransport::DeregisterRegion(uint64_t region_id) {
  return inner_->DeregisterRegion(region_id);
}

void FaultInjectingTransport::WriteAsync(const RegionDescriptor& dst, std::vector<WriteOp> ops,
                                         std::chrono::steady_clock::time_point deadline,
                                         std::function<void(absl::Status)> done) {
  const uint64_t every = o_.flip_bit_every_n_writes;
  if (every == 0 || ops.empty() || ops[0].length == 0 || ops[0].src == nullptr) {
    inner_->WriteAsync(dst, std::move(ops), deadline, std::move(done));
    return;
  }
  const uint64_t n = writes_seen_.fetch_add(1) + 1;
  if (n % every != 0) {
    inner_->WriteAsync(dst, std::move(ops), deadline, std::move(done));
    return;
  }
  // The caller's bytes stay intact (its checksums were computed from them); the receiver gets
  // a copy that differs in exactly one bit.
  const uint64_t flipped = bits_flipped_.fetch_add(1);
  WriteOp& op = ops[0];
  auto copy = std::make_shared<std::vector<uint8_t>>(op.length);
  std::memcpy(copy->data(), op.src, op.length);
  (*copy)[op.length / 2] ^= static_cast<uint8_t>(1u << (flipped % 8));
  op.src = copy->data();
  inner_->WriteAsync(dst, std::move(ops), deadline,
                     [copy, done = std::move(done)](absl::Status st) { done(std::move(st)); });
}

void FaultInjectingTransport::ForgetPeer(const std::string& peer_address) {
  inner_->ForgetPeer(peer_address);
}

TransportStats FaultInjectingTransport::stats() const { return inner_->stats(); }

std::unique_ptr<KvTransport> MaybeInjectFaults(std::unique_ptr<KvTransport> inner,
                                               const FaultInjectionOptions& o) {
  if (inner == nullptr || o.flip_bit_every_n_writes == 0) return inner;
  return std::make_unique<FaultInjectingTransport>(std::move(inner), o);
}

}  // namespace tandem::transfer
