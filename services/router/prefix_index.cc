#include "services/router/prefix_index.h"

#include <algorithm>

namespace tandem::router {

PrefixIndex::PrefixIndex(PrefixIndexOptions o) : o_(o), capacity_(o.max_blocks) {}

int PrefixIndex::FindSlotLocked(const std::string& worker_id) const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i] == worker_id) return static_cast<int>(i);
  }
  return -1;
}

int PrefixIndex::SlotLocked(const std::string& worker_id, bool create) {
  const int found = FindSlotLocked(worker_id);
  if (found >= 0 || !create || worker_id.empty()) return found;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].empty()) {
      slots_[i] = worker_id;
      return static_cast<int>(i);
    }
  }
  if (slots_.size() >= 64) return -1;
  slots_.push_back(worker_id);
  return static_cast<int>(slots_.size() - 1);
}

PrefixIndex::Entry& PrefixIndex::TouchLocked(uint64_t hash) {
  auto [it, inserted] = blocks_.try_emplace(hash);
  if (!inserted) lru_.erase(it->second.lru);
  it->second.lru = lru_.insert(lru_.end(), hash);
  EvictLocked();
  return blocks_.at(hash);
}

void PrefixIndex::EvictLocked() {
  // Never the newest entry: TouchLocked returns it (a capacity of 0 still keeps one).
  while (blocks_.size() > std::max<size_t>(capacity_, 1)) {
    const uint64_t old = lru_.front();
    lru_.pop_front();
    blocks_.erase(old);
  }
}

void PrefixIndex::RecordWorker(const std::string& worker_id, std::span<const uint64_t> hashes) {
  absl::MutexLock l(&mu_);
  const int slot = SlotLocked(worker_id, /*create=*/true);
  if (slot < 0) return;
  for (uint64_t h : hashes) TouchLocked(h).workers |= uint64_t{1} << slot;
}

void PrefixIndex::RecordStore(std::span<const uint64_t> hashes) {
  absl::MutexLock l(&mu_);
  for (uint64_t h : hashes) TouchLocked(h).in_store = true;
}

void PrefixIndex::ForgetWorker(const std::string& worker_id) {
  absl::MutexLock l(&mu_);
  const int slot = FindSlotLocked(worker_id);
  if (slot >= 0) ForgetSlotLocked(slot);
}

void PrefixIndex::SetWorkers(std::span<const PrefixWorker> workers) {
  absl::MutexLock l(&mu_);
  for (size_t i = 0; i < slots_.size(); ++i) {
    const std::string& id = slots_[i];
    if (id.empty()) continue;
    const bool listed = std::any_of(workers.begin(), workers.end(),
                                    [&id](const PrefixWorker& w) { return w.worker_id == id; });
    if (!listed) ForgetSlotLocked(static_cast<int>(i));
  }
  double blocks = 0;
  for (const PrefixWorker& w : workers) {
    blocks += static_cast<double>(std::max<int64_t>(0, w.kv_blocks));
  }
  const double want = blocks * o_.blocks_per_worker_block;
  capacity_ = std::clamp(
      want >= static_cast<double>(o_.max_blocks) ? o_.max_blocks : static_cast<size_t>(want),
      std::min(o_.min_blocks, o_.max_blocks), o_.max_blocks);
  EvictLocked();
}

void PrefixIndex::ForgetSlotLocked(int slot) {
  const uint64_t mask = ~(uint64_t{1} << slot);
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    it->second.workers &= mask;
    if (it->second.workers == 0 && !it->second.in_store) {
      lru_.erase(it->second.lru);
      blocks_.erase(it++);
    } else {
      ++it;
    }
  }
  slots_[slot].clear();
}

int32_t PrefixIndex::WorkerOverlap(const std::string& worker_id,
                                   std::span<const uint64_t> hashes) const {
  absl::MutexLock l(&mu_);
  const int slot = FindSlotLocked(worker_id);
  if (slot < 0) return 0;
  int32_t n = 0;
  for (uint64_t h : hashes) {
    auto it = blocks_.find(h);
    if (it == blocks_.end() || !(it->second.workers >> slot & 1)) break;
    ++n;
  }
  return n;
}

double PrefixIndex::ScoreLocked(const PrefixCandidate& c, std::span<const uint64_t> hashes) const {
  const int slot = FindSlotLocked(c.worker_id);
  double own = 0, store = 0;
  bool own_run = slot >= 0;
  for (uint64_t h : hashes) {
    auto it = blocks_.find(h);
    if (it == blocks_.end()) break;
    if (own_run && (it->second.workers >> slot & 1)) {
      own += 1;
      continue;
    }
    own_run = false;  // past the worker's own run, only the store can serve (the prefix chain)
    if (!it->second.in_store) break;
    store += 1;
  }
  return o_.overlap_weight * (own + o_.store_weight * store) - c.load;
}

double PrefixIndex::Score(const PrefixCandidate& c, std::span<const uint64_t> hashes) const {
  absl::MutexLock l(&mu_);
  return ScoreLocked(c, hashes);
}

int PrefixIndex::Choose(std::span<const PrefixCandidate> candidates,
                        std::span<const uint64_t> hashes) const {
  absl::MutexLock l(&mu_);
  int best = -1;
  double best_score = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const double s = ScoreLocked(candidates[i], hashes);
    if (best < 0 || s > best_score) {
      best = static_cast<int>(i);
      best_score = s;
    }
  }
  return best;
}

size_t PrefixIndex::size() const {
  absl::MutexLock l(&mu_);
  return blocks_.size();
}

size_t PrefixIndex::capacity() const {
  absl::MutexLock l(&mu_);
  return capacity_;
}

}  // namespace tandem::router
