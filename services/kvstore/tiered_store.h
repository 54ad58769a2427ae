// The tiered KV store: blocks named by chained block hash, kept in the fastest tier that has
// room, moved down as they cool and back up when they are used.
//
// Placement: a Put lands in the top enabled tier (device; host when the device capacity is 0).
// When a tier's usage passes its high watermark (or a new block does not fit), its least
// recently used blocks are demoted until usage is back under the low watermark: device -> host
// -> SSD. A block is written to SSD only once it has been hit at least `ssd_min_hits` times, so
// one-off prefixes do not wear the disk or push out useful blocks; below that it is dropped. A
// hit in a lower tier promotes the block to the top enabled tier. Device and host hold a block
// in at most one of them; SSD keeps its copy on promotion (the file is the durable copy, and a
// later demotion of an unchanged block then needs no write). SSD contents are re-indexed on
// start, so blocks survive restarts.
//
// Reads: GetPrefix serves a request's leading run of blocks in one call, and reads the run's
// SSD blocks together (SsdTier::GetMany: up to its queue depth of files in flight) before it
// counts and promotes each block in order, exactly as that many Gets would.
// Threading: thread-safe; one mutex serialises every call (SSD I/O included).
// Errors: Get gives NOT_FOUND for an unknown block and DATA_LOSS when the only copy failed its
// integrity check (it is dropped; the block is then simply missing). Put gives INVALID_ARGUMENT
// for an empty block or one larger than a device slot.
#pragma once

#include <array>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "services/kvstore/ssd_tier.h"
#include "services/kvstore/tier.h"

namespace tandem::kvstore {

struct TierConfig {
  uint64_t capacity_bytes = 0;   // 0 disables the tier (at least one must be enabled)
  double high_watermark = 0.95;  // fraction of capacity that triggers demotion
  double low_watermark = 0.80;   // fraction demotion brings usage back to
};

struct TieredStoreConfig {
  TierConfig device{64ull << 20};
  TierConfig host{256ull << 20};
  TierConfig ssd{0};
  uint64_t device_slot_bytes = 64 << 10;  // largest block the store accepts
  std::string ssd_dir;                    // required when ssd.capacity_bytes > 0
  int32_t ssd_min_hits = 1;               // hits a block needs before a demotion writes it to SSD
  bool ssd_use_io_uring = true;
  int ssd_queue_depth = 8;                // SSD block files in flight in a multi-block read
  bool ssd_fsync = false;
};

struct TierStats {
  std::string name;
  std::string label;  // Tier::label(): "device" or "device-emulated", "host", "ssd"
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  int64_t blocks = 0;
  int64_t hits = 0;    // Gets served from this tier
  int64_t misses = 0;  // Gets that looked past this tier (not in it)
  int64_t integrity_failures = 0;
  int64_t demoted_in = 0;    // blocks that arrived from the tier above
  int64_t promoted_out = 0;  // blocks copied to the top after a hit here
  int64_t evicted = 0;       // blocks that left this tier for lower tiers or for good
};

struct TieredStoreStats {
  std::array<TierStats, kNumTiers> tiers;  // indexed by TierKind
  int64_t puts = 0;
  int64_t gets = 0;
  int64_t dropped_cold = 0;  // demotions to SSD skipped by the frequency filter
  // Blocks refused before they were stored because their bytes did not match the checksum the
  // publisher sent (data plane Commit); counted in kv_integrity_failures_total with the tiers'.
  int64_t rejected_blocks = 0;
};

struct PrefixMatch {
  int32_t matched = 0;          // leading hashes present
  std::vector<TierKind> tiers;  // where each matched block is now (fastest copy)
};

class TieredStore {
 public:
  // INVALID_ARGUMENT for a bad config (no tier with capacity, watermarks out of order, an SSD
  // capacity without a directory); the SSD tier's errors when its directory cannot be opened.
  static absl::StatusOr<std::unique_ptr<TieredStore>> Create(const TieredStoreConfig& c);

  absl::Status Put(uint64_t hash, std::span<const uint8_t> data);
  absl::StatusOr<std::vector<uint8_t>> Get(uint64_t hash);
  // The leading run of `hashes` the store can serve, each counted and promoted as Get does,
  // with the tier its fastest copy was found in. The run's SSD blocks are read together (up to
  // the SSD tier's queue depth in flight). Stops at the first block that is absent or whose
  // every copy failed its integrity check; *stop is that Get's status (OK when all were read).
  struct Found {
    std::vector<uint8_t> data;
    TierKind tier = TierKind::kDevice;
  };
  std::vector<Found> GetPrefix(std::span<const uint64_t> hashes, absl::Status* stop);
  bool Contains(uint64_t hash) const;
  absl::Status Erase(uint64_t hash);
  // How many leading `hashes` are stored, and where. Does not count hits or move blocks.
  PrefixMatch LookupPrefix(std::span<const uint64_t> hashes) const;
  std::optional<TierKind> Where(uint64_t hash) const;
  TieredStoreStats stats() const;
  // Counts a block refused by an integrity check before it reached the store.
  void CountRejectedBlock();
  // Null for a disabled tier. For inspection (names, tests) while no other thread uses the
  // store: the tier itself is not locked.
  const Tier* tier(TierKind k) const { return tiers_[static_cast<int>(k)].get(); }

 private:
  struct Block {
    uint64_t payload = 0;
    int32_t hits = 0;
    // Membership and LRU position per tier.
    std::array<bool, kNumTiers> in{};
    std::array<std::list<uint64_t>::iterator, kNumTiers> lru_it{};
  };
  explicit TieredStore(const TieredStoreConfig& c);
  int top_ = 0;  // the fastest enabled tier: where puts land and hits are promoted to
  TierConfig& config(int t) { return t == 0 ? c_.device : t == 1 ? c_.host : c_.ssd; }
  int Top(const Block& b) const;
  void Touch(int t, uint64_t hash, Block& b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Forget(int t, uint64_t hash, Block& b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places the block in tier t (or the next enabled one below), making room first.
  absl::Status Place(int t, uint64_t hash, std::span<const uint8_t> data)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Demotes LRU blocks of tier t until `need` more bytes fit, and, when `to_low`, until usage
  // is at or under the low watermark.
  void MakeRoom(int t, uint64_t need, bool to_low) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A block on its way to the SSD tier, out of the tier above and not yet written.
  struct Outgoing {
    uint64_t hash = 0;
    std::vector<uint8_t> data;
  };
  // Moves the block out of tier t into the next enabled tier; one bound for SSD is appended to
  // `to_ssd` instead, for WriteToSsd.
  void Demote(int t, uint64_t hash, std::vector<Outgoing>* to_ssd)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes room on SSD and writes `blocks` in one batch (SsdTier::PutMany); empties it.
  void WriteToSsd(std::vector<Outgoing>* blocks) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropIfHomeless(uint64_t hash) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Get under the lock. `ssd_copy`, when given, is the block's SSD file already read; it is
  // used if the SSD copy is still the fastest one. *where gets the tier it was served from.
  absl::StatusOr<std::vector<uint8_t>> GetLocked(uint64_t hash,
                                                 absl::StatusOr<std::vector<uint8_t>>* ssd_copy,
                                                 TierKind* where)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  TieredStoreConfig c_;
  mutable absl::Mutex mu_;
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers_;
  absl::flat_hash_map<uint64_t, Block> blocks_ ABSL_GUARDED_BY(mu_);
  std::array<std::list<uint64_t>, kNumTiers> lru_ ABSL_GUARDED_BY(mu_);  // front: coldest
  TieredStoreStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::kvstore
