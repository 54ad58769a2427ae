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
    o.queue_depth = c.ssd_queue_depth;
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
  // Blocks bound for SSD are written together, a queue depth's worth at a time.
  std::vector<Outgoing> to_ssd;
  while (!lru_[t].empty()) {
    const bool over = tier.Used() + need > tier.Capacity();
    const bool above_low = to_low && static_cast<double>(tier.Used()) > low;
    if (!over && !above_low) break;
    // The newest block (just placed) stays even when the watermark alone would move it.
    if (!over && lru_[t].size() == 1) break;
    Demote(t, lru_[t].front(), &to_ssd);
    if (static_cast<int>(to_ssd.size()) >= c_.ssd_queue_depth) WriteToSsd(&to_ssd);
  }
  WriteToSsd(&to_ssd);
}

void TieredStore::WriteToSsd(std::vector<Outgoing>* blocks) {
  if (blocks->empty()) return;
  Tier& ssd = *tiers_[2];
  uint64_t need = 0;
  std::vector<Tier::BlockRef> refs;
  for (const Outgoing& o : *blocks) {
    need += ssd.Footprint(o.data.size());
    refs.push_back({o.hash, o.data});
  }
  MakeRoom(2, std::min(need, ssd.Capacity()), /*to_low=*/false);
  const std::vector<absl::Status> st = ssd.PutMany(refs);
  for (size_t i = 0; i < blocks->size(); ++i) {
    const uint64_t hash = (*blocks)[i].hash;
    auto it = blocks_.find(hash);
    if (st[i].ok() && it != blocks_.end()) {
      Touch(2, hash, it->second);
      ++stats_.tiers[2].demoted_in;
    } else if (!st[i].ok()) {
      std::fprintf(stderr, "tandem-kvstore: demoting block %016llx to %s failed: %s\n",
                   static_cast<unsigned long long>(hash), ssd.label().c_str(),
                   st[i].ToString().c_str());
    }
    DropIfHomeless(hash);
  }
  blocks->clear();
  const double high = c_.ssd.high_watermark * static_cast<double>(ssd.Capacity());
  if (static_cast<double>(ssd.Used()) > high) {
    MakeRoom(2, 0, /*to_low=*/true);
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

void TieredStore::Demote(int t, uint64_t hash, std::vector<Outgoing>* to_ssd) {
  Block& b = blocks_.at(hash);
  absl::StatusOr<std::vector<uint8_t>> data = tiers_[t]->Get(hash);
  Forget(t, hash, b);
  ++stats_.tiers[t].evicted;
  int next = t + 1;
  while (next < kNumTiers && tiers_[next] == nullptr) ++next;
  if (data.ok() && next < kNumTiers && !b.in[next]) {
    if (next == 2 && b.hits < c_.ssd_min_hits) {
      ++stats_.dropped_cold;
    } else if (next == 2) {
      to_ssd->push_back(Outgoing{hash, std::move(*data)});
      return;  // homeless until the batch is written
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
  return GetLocked(hash, nullptr, nullptr);
}

std::vector<TieredStore::Found> TieredStore::GetPrefix(std::span<const uint64_t> hashes,
                                                       absl::Status* stop) {
  absl::MutexLock l(&mu_);
  *stop = absl::OkStatus();
  // The leading run the index knows, and its blocks whose fastest copy is on SSD: those are
  // read in one batch first.
  size_t run = 0;
  std::vector<uint64_t> ssd_hashes;
  for (; run < hashes.size(); ++run) {
    auto it = blocks_.find(hashes[run]);
    const int top = it == blocks_.end() ? -1 : Top(it->second);
    if (top < 0) break;
    if (top == 2) ssd_hashes.push_back(hashes[run]);
  }
  std::vector<absl::StatusOr<std::vector<uint8_t>>> ssd;
  if (!ssd_hashes.empty()) ssd = tiers_[2]->GetMany(ssd_hashes);
  std::vector<Found> out;
  size_t k = 0;
  for (size_t i = 0; i < hashes.size(); ++i) {
    // Promoting an earlier block can push a later one out of a tier; GetLocked looks again.
    absl::StatusOr<std::vector<uint8_t>>* copy =
        k < ssd_hashes.size() && ssd_hashes[k] == hashes[i] ? &ssd[k++] : nullptr;
    TierKind where = TierKind::kDevice;
    absl::StatusOr<std::vector<uint8_t>> data = GetLocked(hashes[i], copy, &where);
    if (!data.ok()) {
      *stop = data.status();
      break;
    }
    out.push_back(Found{std::move(*data), where});
  }
  return out;
}

absl::StatusOr<std::vector<uint8_t>> TieredStore::GetLocked(
    uint64_t hash, absl::StatusOr<std::vector<uint8_t>>* ssd_copy, TierKind* where) {
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
    absl::StatusOr<std::vector<uint8_t>> data =
        top == 2 && ssd_copy != nullptr ? std::move(*ssd_copy) : tiers_[top]->Get(hash);
    ssd_copy = nullptr;  // read once
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
    if (where != nullptr) *where = static_cast<TierKind>(top);
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
