// The in-memory tiers.
//
// DeviceTier: a fixed arena cut into equal slots, as an accelerator KV pool is. This build has
// no CUDA allocation path, so the arena is host memory standing in for device memory and
// name() says "device-emulated"; the store's policy is the same either way. A block larger than
// a slot is refused (INVALID_ARGUMENT).
// HostTier: DRAM, one heap buffer per block; capacity counts payload bytes.
//
// Threading and errors: see tier.h.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "services/kvstore/tier.h"

namespace tandem::kvstore {

class DeviceTier : public Tier {
 public:
  // capacity_bytes / slot_bytes slots; both must be positive (INVALID_ARGUMENT otherwise).
  static absl::StatusOr<std::unique_ptr<DeviceTier>> Create(uint64_t capacity_bytes,
                                                            uint64_t slot_bytes);

  TierKind kind() const override { return TierKind::kDevice; }
  std::string name() const override;
  absl::Status Put(uint64_t hash, std::span<const uint8_t> data) override;
  absl::StatusOr<std::vector<uint8_t>> Get(uint64_t hash) override;
  bool Contains(uint64_t hash) const override { return index_.contains(hash); }
  absl::Status Erase(uint64_t hash) override;
  uint64_t Used() const override { return index_.size() * slot_bytes_; }
  uint64_t Capacity() const override { return num_slots_ * slot_bytes_; }
  uint64_t Footprint(uint64_t) const override { return slot_bytes_; }
  int64_t NumBlocks() const override { return static_cast<int64_t>(index_.size()); }
  std::vector<uint64_t> Keys() const override;
  uint64_t slot_bytes() const { return slot_bytes_; }

 private:
  DeviceTier(uint64_t num_slots, uint64_t slot_bytes);
  struct Slot {
    uint32_t index;
    uint64_t length;
  };
  uint64_t num_slots_;
  uint64_t slot_bytes_;
  std::unique_ptr<uint8_t[]> arena_;
  std::vector<uint32_t> free_slots_;
  absl::flat_hash_map<uint64_t, Slot> index_;
};

class HostTier : public Tier {
 public:
  explicit HostTier(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}

  TierKind kind() const override { return TierKind::kHost; }
  std::string name() const override { return "host-dram"; }
  absl::Status Put(uint64_t hash, std::span<const uint8_t> data) override;
  absl::StatusOr<std::vector<uint8_t>> Get(uint64_t hash) override;
  bool Contains(uint64_t hash) const override { return blocks_.contains(hash); }
  absl::Status Erase(uint64_t hash) override;
  uint64_t Used() const override { return used_; }
  uint64_t Capacity() const override { return capacity_; }
  uint64_t Footprint(uint64_t payload) const override { return payload; }
  int64_t NumBlocks() const override { return static_cast<int64_t>(blocks_.size()); }
  std::vector<uint64_t> Keys() const override;

 private:
  uint64_t capacity_;
  uint64_t used_ = 0;
  absl::flat_hash_map<uint64_t, std::vector<uint8_t>> blocks_;
};

}  // namespace tandem::kvstore
