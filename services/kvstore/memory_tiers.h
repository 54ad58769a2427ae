// The in-memory tiers.
//
// DeviceTier: a fixed arena cut into equal slots, as an accelerator KV pool is. In a CUDA build
// on a machine with a GPU the arena is device memory (cudaMalloc; blocks are copied in and out
// with cudaMemcpy), labelled "device". Otherwise it is host memory standing in for device
// memory, and its label ("device-emulated": the `tier` label of every metric, the Stats answer
// and every log line) and name() say so; the store's policy is the same either way. A block
// larger than a slot is refused (INVALID_ARGUMENT).
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

// "device" where a DeviceTier created now would hold CUDA memory, "device-emulated" otherwise.
std::string DeviceTierLabel();

class DeviceTier : public Tier {
 public:
  // capacity_bytes / slot_bytes slots; both must be positive (INVALID_ARGUMENT otherwise).
  static absl::StatusOr<std::unique_ptr<DeviceTier>> Create(uint64_t capacity_bytes,
                                                            uint64_t slot_bytes);

  ~DeviceTier() override;
  TierKind kind() const override { return TierKind::kDevice; }
  std::string label() const override { return on_device_ ? "device" : "device-emulated"; }
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
  DeviceTier(uint64_t num_slots, uint64_t slot_bytes, uint8_t* device_arena, int ordinal);
  struct Slot {
    uint32_t index;
    uint64_t length;
  };
  uint64_t num_slots_;
  uint64_t slot_bytes_;
  std::unique_ptr<uint8_t[]> arena_;  // the host arena (emulated)
  uint8_t* device_arena_ = nullptr;   // the CUDA arena (cudaMalloc'd), owned
  bool on_device_ = false;
  int ordinal_ = -1;
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
