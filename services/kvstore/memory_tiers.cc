#include "services/kvstore/memory_tiers.h"

#include <cstring>

#include "absl/strings/str_cat.h"

#if defined(TANDEM_KVSTORE_CUDA)
#include "common/cuda/cuda_raii.h"
#endif

namespace tandem::kvstore {

const char* TierKindName(TierKind k) {
  switch (k) {
    case TierKind::kDevice:
      return "device";
    case TierKind::kHost:
      return "host";
    case TierKind::kSsd:
      return "ssd";
  }
  return "unknown";
}

std::string DeviceTierLabel() {
#if defined(TANDEM_KVSTORE_CUDA)
  if (cuda::VisibleDeviceCount() > 0) return "device";
#endif
  return "device-emulated";
}

absl::StatusOr<std::unique_ptr<DeviceTier>> DeviceTier::Create(uint64_t capacity_bytes,
                                                               uint64_t slot_bytes) {
  if (slot_bytes == 0 || capacity_bytes < slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("device tier: capacity ", capacity_bytes,
                                                   " holds no slot of ", slot_bytes, " bytes"));
  }
  const uint64_t slots = capacity_bytes / slot_bytes;
  if (slots > UINT32_MAX) return absl::InvalidArgumentError("device tier: too many slots");
  uint8_t* device_arena = nullptr;
  int ordinal = -1;
#if defined(TANDEM_KVSTORE_CUDA)
  if (cuda::VisibleDeviceCount() > 0) {
    TANDEM_CUDA_RETURN_IF(cudaGetDevice(&ordinal));
    void* p = nullptr;
    TANDEM_CUDA_RETURN_IF(cudaMalloc(&p, slots * slot_bytes));
    device_arena = static_cast<uint8_t*>(p);
  }
#endif
  return std::unique_ptr<DeviceTier>(new DeviceTier(slots, slot_bytes, device_arena, ordinal));
}

DeviceTier::DeviceTier(uint64_t num_slots, uint64_t slot_bytes, uint8_t* device_arena, int ordinal)
    : num_slots_(num_slots),
      slot_bytes_(slot_bytes),
      device_arena_(device_arena),
      on_device_(device_arena != nullptr),
      ordinal_(ordinal) {
  free_slots_.reserve(num_slots);
  for (uint64_t i = num_slots; i > 0; --i) free_slots_.push_back(static_cast<uint32_t>(i - 1));
  if (!on_device_) {
    arena_.reset(new uint8_t[num_slots * slot_bytes]);
    // Fault the arena in now, as a device allocation would be ready, not on the first blocks.
    std::memset(arena_.get(), 0, num_slots * slot_bytes);
  }
}

DeviceTier::~DeviceTier() {
#if defined(TANDEM_KVSTORE_CUDA)
  if (device_arena_ != nullptr) cudaFree(device_arena_);
#endif
}

std::string DeviceTier::name() const {
  if (on_device_) return absl::StrCat("device (CUDA device ", ordinal_, " memory)");
  // No GPU (or no CUDA in this build): say plainly that this is host memory.
  return "device-emulated (host arena)";
}

absl::Status DeviceTier::Put(uint64_t hash, std::span<const uint8_t> data) {
  if (data.empty()) return absl::InvalidArgumentError("device tier: empty block");
  if (data.size() > slot_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("device tier: block of ", data.size(),
                                                   " bytes exceeds the slot size ", slot_bytes_));
  }
  auto it = index_.find(hash);
  uint32_t slot;
  if (it != index_.end()) {
    slot = it->second.index;
  } else {
    if (free_slots_.empty()) return absl::ResourceExhaustedError("device tier: no free slot");
    slot = free_slots_.back();
    free_slots_.pop_back();
  }
  const uint64_t at = uint64_t{slot} * slot_bytes_;
  if (on_device_) {
#if defined(TANDEM_KVSTORE_CUDA)
    TANDEM_CUDA_RETURN_IF(cudaSetDevice(ordinal_));
    TANDEM_CUDA_RETURN_IF(
        cudaMemcpy(device_arena_ + at, data.data(), data.size(), cudaMemcpyHostToDevice));
#endif
  } else {
    std::memcpy(arena_.get() + at, data.data(), data.size());
  }
  index_[hash] = Slot{slot, data.size()};
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> DeviceTier::Get(uint64_t hash) {
  auto it = index_.find(hash);
  if (it == index_.end()) return absl::NotFoundError("device tier: no such block");
  const uint64_t at = uint64_t{it->second.index} * slot_bytes_;
  if (on_device_) {
    std::vector<uint8_t> out(it->second.length);
#if defined(TANDEM_KVSTORE_CUDA)
    TANDEM_CUDA_RETURN_IF(cudaSetDevice(ordinal_));
    TANDEM_CUDA_RETURN_IF(
        cudaMemcpy(out.data(), device_arena_ + at, out.size(), cudaMemcpyDeviceToHost));
#endif
    return out;
  }
  const uint8_t* p = arena_.get() + at;
  return std::vector<uint8_t>(p, p + it->second.length);
}

absl::Status DeviceTier::Erase(uint64_t hash) {
  auto it = index_.find(hash);
  if (it == index_.end()) return absl::NotFoundError("device tier: no such block");
  free_slots_.push_back(it->second.index);
  index_.erase(it);
  return absl::OkStatus();
}

std::vector<uint64_t> DeviceTier::Keys() const {
  std::vector<uint64_t> out;
  out.reserve(index_.size());
  for (const auto& [h, s] : index_) out.push_back(h);
  return out;
}

absl::Status HostTier::Put(uint64_t hash, std::span<const uint8_t> data) {
  if (data.empty()) return absl::InvalidArgumentError("host tier: empty block");
  auto it = blocks_.find(hash);
  const uint64_t old = it == blocks_.end() ? 0 : it->second.size();
  if (used_ - old + data.size() > capacity_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host tier: ", data.size(), " more bytes exceed the capacity ", capacity_));
  }
  blocks_[hash].assign(data.begin(), data.end());
  used_ = used_ - old + data.size();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> HostTier::Get(uint64_t hash) {
  auto it = blocks_.find(hash);
  if (it == blocks_.end()) return absl::NotFoundError("host tier: no such block");
  return it->second;
}

absl::Status HostTier::Erase(uint64_t hash) {
  auto it = blocks_.find(hash);
  if (it == blocks_.end()) return absl::NotFoundError("host tier: no such block");
  used_ -= it->second.size();
  blocks_.erase(it);
  return absl::OkStatus();
}

std::vector<uint64_t> HostTier::Keys() const {
  std::vector<uint64_t> out;
  out.reserve(blocks_.size());
  for (const auto& [h, b] : blocks_) out.push_back(h);
  return out;
}

}  // namespace tandem::kvstore
