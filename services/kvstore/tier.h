// One storage tier of the KV store: blocks of bytes named by their chained block hash.
//
// Three backends share this interface: DeviceTier (accelerator memory; on machines without CUDA
// a host arena stands in for it and says so in name()), HostTier (DRAM) and SsdTier (one file
// per block, O_DIRECT through io_uring, checksummed, survives restarts). The TieredStore stacks
// them and decides what lives where; a tier only stores, finds and forgets.
//
// Threading: tiers are thread-compatible, not thread-safe; the TieredStore serialises calls.
// Ownership: Put copies the bytes in, Get copies them out.
// Errors: Put gives RESOURCE_EXHAUSTED when the block does not fit (the store evicts first, so
// this means the block is larger than the tier allows), INVALID_ARGUMENT for an empty block;
// Get gives NOT_FOUND for an absent block and DATA_LOSS for a stored block that failed its
// integrity check (the tier drops it, so a retry is a plain NOT_FOUND); I/O failures are
// INTERNAL or the errno's canonical code.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::kvstore {

enum class TierKind : int { kDevice = 0, kHost = 1, kSsd = 2 };
inline constexpr int kNumTiers = 3;
// "device", "host", "ssd": the `tier` label of the kvstore metrics.
const char* TierKindName(TierKind k);

class Tier {
 public:
  virtual ~Tier() = default;

  virtual TierKind kind() const = 0;
  // The `tier` label of metrics, the Stats answer and log lines: TierKindName(kind()), except a
  // device tier without a GPU, which is "device-emulated".
  virtual std::string label() const { return TierKindName(kind()); }
  // Human-readable backend name, e.g. "device-emulated (host arena)".
  virtual std::string name() const = 0;

  // Stores a copy of `data` under `hash`, replacing any block already there.
  virtual absl::Status Put(uint64_t hash, std::span<const uint8_t> data) = 0;
  virtual absl::StatusOr<std::vector<uint8_t>> Get(uint64_t hash) = 0;
  // Several blocks at once, one result per hash, in order. The SSD tier keeps up to its queue
  // depth of them in flight; the memory tiers just loop.
  virtual std::vector<absl::StatusOr<std::vector<uint8_t>>> GetMany(
      std::span<const uint64_t> hashes) {
    std::vector<absl::StatusOr<std::vector<uint8_t>>> out;
    out.reserve(hashes.size());
    for (uint64_t h : hashes) out.push_back(Get(h));
    return out;
  }
  struct BlockRef {
    uint64_t hash = 0;
    std::span<const uint8_t> data;
  };
  // Several Puts at once, one status per block, in order (the SSD tier writes them together).
  virtual std::vector<absl::Status> PutMany(std::span<const BlockRef> blocks) {
    std::vector<absl::Status> out;
    out.reserve(blocks.size());
    for (const BlockRef& b : blocks) out.push_back(Put(b.hash, b.data));
    return out;
  }
  virtual bool Contains(uint64_t hash) const = 0;
  // NOT_FOUND when absent.
  virtual absl::Status Erase(uint64_t hash) = 0;

  // Bytes the tier's blocks occupy (in its own units: slots, heap bytes, file bytes) and the
  // most it may hold.
  virtual uint64_t Used() const = 0;
  virtual uint64_t Capacity() const = 0;
  // Bytes a block of `payload` bytes would occupy (what Used grows by).
  virtual uint64_t Footprint(uint64_t payload) const = 0;
  virtual int64_t NumBlocks() const = 0;
  // Every stored hash, in no particular order (the store rebuilds its index from a persistent
  // tier with this).
  virtual std::vector<uint64_t> Keys() const = 0;
  // Blocks dropped because they failed an integrity check (checksum, header, truncation).
  virtual int64_t integrity_failures() const { return 0; }
};

}  // namespace tandem::kvstore
