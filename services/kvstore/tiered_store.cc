#include "services/kvstore/tiered_store.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"
#include "services/kvstore/memory_tiers.h"

namespace tandem::kvstore {
namespace {

absl::Status CheckWatermarks(const char* tier, const TierConfig& t) {
  if (!(t.low_watermark > 0 && t.low_watermark <= t.high_watermark && t.high_watermark <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(tier, " tier: watermarks must satisfy 0 < low <= high <= 1 (low ",
                     t.low_watermark, ", high ", t.high_watermark, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

TieredStore::TieredStore(const TieredStoreConfig& c) : c_(c) {}

absl::StatusOr<std::unique_ptr<TieredStore>> TieredStore::Create(const TieredStoreConfig& c) {
  TANDEM_RETURN_IF_ERROR(CheckWatermarks("device", c.device));
  TANDEM_RETURN_IF_ERROR(CheckWatermarks("host", c.host));
  TANDEM_RETURN_IF_ERROR(CheckWatermarks("ssd", c.ssd));
  if (c.ssd_min_hits < 0) return absl::InvalidArgumentError("ssd_min_hits must be >= 0");
  std::unique_ptr<TieredStore> s(new TieredStore(c));
  // Device capacity 0: no device tier (a CPU-only pod); puts then land in the host tier.
  if (c.device.capacity_bytes > 0) {
    TANDEM_ASSIGN_OR_RETURN(s->tiers_[0],
                            DeviceTier::Create(c.device.capacity_bytes, c.device_slot_bytes));
  }
  if (c.host.capacity_bytes > 0) s->tiers_[1] = std::make_unique<HostTier>(c.host.capacity_bytes);
  if (c.ssd.capacity_bytes > 0) {
    if (c.ssd_dir.empty()) {
      return absl::InvalidArgumentError("an SSD tier capacity needs ssd_dir");
    }
    SsdTierOptions o;
    o.dir = c.ssd_dir;
    o.capacity_bytes = c.ssd.capacity_bytes;
    o.use_io_uring = c.ssd_use_io_uring;
    o.fsync = c.ssd_fsync;
    TANDEM_ASSIGN_OR_RETURN(s->tiers_[2], SsdTier::Open(o));
    // Blocks that survived a restart are known again; their use history is not.
    absl::MutexLock l(&s->mu_);
    for (uint64_t h : s->tiers_[2]->Keys()) {
      Block& b = s->blocks_[h];
      b.in[2] = true;
      b.lru_it[2] = s->lru_[2].insert(s->lru_[2].end(), h);
    }
  }
  s->top_ = 0;
  while (s->top_ < kNumTiers && s->tiers_[s->top_] == nullptr) ++s->top_;
  if (s->top_ == kNumTiers) {
    return absl::InvalidArgumentError("every tier has capacity 0: the store could hold nothing");
  }
  absl::MutexLock l(&s->mu_);
  for (int t = 0; t < kNumTiers; ++t) {
    if (s->tiers_[t] != nullptr) {
      s->stats_.tiers[t].name = s->tiers_[t]->name();
      s->stats_.tiers[t].label = s->tiers_[t]->label();
    }
  }
  return s;
}

int TieredStore::Top(const Block& b) const {
  for (int t = 0; t < kNumTiers; ++t) {
    if (b.in[t]) return t;
  }
  return -1;
}

void TieredStore::Touch(int t, uint64_t hash, Block& b) {
  if (b.in[t]) lru_[t].erase(b.lru_it[t]);
  b.in[t] = true;
  b.lru_it[t] = lru_[t].insert(lru_[t].end(), hash);
}

void TieredStore::Forget(int t, uint64_t hash, Block& b) {
  if (!b.in[t]) return;
  lru_[t].erase(b.lru_it[t]);
  b.in[t] = false;
  (void)tiers_[t]->Erase(hash);
}

void TieredStore::DropIfHomeless(uint64_t hash) {
  auto it = blocks_.find(hash);
  if (it != blocks_.end() && Top(it->second) < 0) blocks_.erase(it);
}

void TieredStore::MakeRoom(int t, uint64_t need, bool to_low) {
  Tier& tier = *tiers_[t];
  const TierConfig& tc = config(t);
  const double low = tc.low_watermark * static_cast<double>(tier.Capacity());
  while (!lru_[t].empty()) {
    const bool over = tier.Used() + need > tier.Capacity();
    const bool above_low = to_low && static_cast<double>(tier.Used()) > low;
    if (!over && !above_low) break;
    // The newest block (just placed) stays even when the watermark alone would move it.
    if (!over && lru_[t].size() == 1) break;
    Demote(t, lru_[t].front());
  }
}

absl::Status TieredStore::Place(int t, uint64_t hash, std::span<const uint8_t> data) {
  Tier& tier = *tiers_[t];
  const uint64_t fp = tier.Footprint(data.size());
  if (fp > tier.Capacity()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(tier.name(), ": a block of ", data.size(), " bytes is larger than the tier"));
  }
  MakeRoom(t, fp, /*to_low=*/false);
  TANDEM_RETURN_IF_ERROR(tier.Put(hash, data));
  auto it = blocks_.find(hash);
  if (it == blocks_.end()) it = blocks_.try_emplace(hash).first;
  Block& b = it->second;
  b.payload = data.size();
  Touch(t, hash, b);
  if (static_cast<double>(tier.Used()) >
      config(t).high_watermark * static_cast<double>(tier.Capacity())) {
    MakeRoom(t, 0, /*to_low=*/true);
  }
  return absl::OkStatus();
}

void TieredStore::Demote(int t, uint64_t hash) {
  Block& b = blocks_.at(hash);
  absl::StatusOr<std::vector<uint8_t>> data = tiers_[t]->Get(hash);
  Forget(t, hash, b);
  ++stats_.tiers[t].evicted;
  int next = t + 1;
  while (next < kNumTiers && tiers_[next] == nullptr) ++next;
  if (data.ok() && next < kNumTiers && !b.in[next]) {
    if (next == 2 && b.hits < c_.ssd_min_hits) {
      ++stats_.dropped_cold;
    } else {
      absl::Status st = Place(next, hash, *data);
      if (st.ok()) {
        ++stats_.tiers[next].demoted_in;
      } else {
        std::fprintf(stderr, "tandem-kvstore: demoting block %016llx to %s failed: %s\n",
                     static_cast<unsigned long long>(hash), tiers_[next]->label().c_str(),
                     st.ToString().c_str());
      }
    }
  }
  DropIfHomeless(hash);
}

absl::Status TieredStore::Put(uint64_t hash, std::span<const uint8_t> data) {
  if (data.empty()) return absl::InvalidArgumentError("empty block");
  if (data.size() > c_.device_slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block of ", data.size(), " bytes exceeds the largest block (", c_.device_slot_bytes, ")"));
  }
  absl::MutexLock l(&mu_);
  ++stats_.puts;
  auto it = blocks_.find(hash);
  if (it != blocks_.end()) {
    // The new bytes replace every older copy: a stale SSD copy must not outlive them (equal
    // hashes should mean equal bytes, but the store does not rely on it).
    Forget(1, hash, it->second);
    Forget(2, hash, it->second);
    if (it->second.in[0]) {
      // Refresh in place rather than shuffling other blocks.
      TANDEM_RETURN_IF_ERROR(tiers_[0]->Put(hash, data));
      Touch(0, hash, it->second);
      return absl::OkStatus();
    }
  }
  absl::Status st = Place(top_, hash, data);
  if (!st.ok()) DropIfHomeless(hash);
  return st;
}

absl::StatusOr<std::vector<uint8_t>> TieredStore::Get(uint64_t hash) {
  absl::MutexLock l(&mu_);
  ++stats_.gets;
  absl::Status last = absl::NotFoundError(absl::StrCat("no block ", absl::Hex(hash)));
  for (;;) {
    auto it = blocks_.find(hash);
    const int top = it == blocks_.end() ? -1 : Top(it->second);
    if (top < 0) {
      for (int t = 0; t < kNumTiers; ++t) {
        if (tiers_[t] != nullptr) ++stats_.tiers[t].misses;
      }
      return last;
    }
    for (int t = 0; t < top; ++t) {
      if (tiers_[t] != nullptr) ++stats_.tiers[t].misses;
    }
    absl::StatusOr<std::vector<uint8_t>> data = tiers_[top]->Get(hash);
    if (!data.ok()) {
      // The tier dropped a corrupt copy (DATA_LOSS) or lost the file; try any other copy.
      ++stats_.tiers[top].misses;
      Block& b = it->second;
      lru_[top].erase(b.lru_it[top]);
      b.in[top] = false;
      (void)tiers_[top]->Erase(hash);
      DropIfHomeless(hash);
      last = data.status();
      continue;
    }
    ++stats_.tiers[top].hits;
    Block& b = it->second;
    ++b.hits;
    if (top == top_) {
      Touch(top, hash, b);
    } else {
      if (top == 2) Touch(2, hash, b);  // the SSD copy stays; it was just used
      if (b.in[1]) Forget(1, hash, b);
      absl::Status st = Place(top_, hash, *data);
      if (st.ok()) {
        ++stats_.tiers[top].promoted_out;
      } else {
        std::fprintf(stderr, "tandem-kvstore: promoting block %016llx failed: %s\n",
                     static_cast<unsigned long long>(hash), st.ToString().c_str());
      }
    }
    return data;
  }
}

bool TieredStore::Contains(uint64_t hash) const {
  absl::MutexLock l(&mu_);
  return blocks_.contains(hash);
}

absl::Status TieredStore::Erase(uint64_t hash) {
  absl::MutexLock l(&mu_);
  auto it = blocks_.find(hash);
  if (it == blocks_.end()) return absl::NotFoundError(absl::StrCat("no block ", absl::Hex(hash)));
  for (int t = 0; t < kNumTiers; ++t) Forget(t, hash, it->second);
  blocks_.erase(it);
  return absl::OkStatus();
}

PrefixMatch TieredStore::LookupPrefix(std::span<const uint64_t> hashes) const {
  absl::MutexLock l(&mu_);
  PrefixMatch m;
  for (uint64_t h : hashes) {
    auto it = blocks_.find(h);
    if (it == blocks_.end()) break;
    const int top = Top(it->second);
    if (top < 0) break;
    m.tiers.push_back(static_cast<TierKind>(top));
    ++m.matched;
  }
  return m;
}

std::optional<TierKind> TieredStore::Where(uint64_t hash) const {
  absl::MutexLock l(&mu_);
  auto it = blocks_.find(hash);
  if (it == blocks_.end() || Top(it->second) < 0) return std::nullopt;
  return static_cast<TierKind>(Top(it->second));
}

void TieredStore::CountRejectedBlock() {
  absl::MutexLock l(&mu_);
  ++stats_.rejected_blocks;
}

TieredStoreStats TieredStore::stats() const {
  absl::MutexLock l(&mu_);
  TieredStoreStats s = stats_;
  for (int t = 0; t < kNumTiers; ++t) {
    if (tiers_[t] == nullptr) continue;
    s.tiers[t].capacity_bytes = tiers_[t]->Capacity();
    s.tiers[t].used_bytes = tiers_[t]->Used();
    s.tiers[t].blocks = tiers_[t]->NumBlocks();
    s.tiers[t].integrity_failures = tiers_[t]->integrity_failures();
  }
  return s;
}

}  // namespace tandem::kvstore
