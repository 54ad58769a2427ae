#include "services/router/worker_registry.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tandem::router {
namespace {

// "dir/stories260K.gguf" -> "stories260K"; a bare id stays as it is.
std::string Stem(const std::string& name) {
  std::string s = name;
  if (auto slash = s.find_last_of('/'); slash != std::string::npos) s = s.substr(slash + 1);
  if (s.size() > 5 && s.compare(s.size() - 5, 5, ".gguf") == 0) s.resize(s.size() - 5);
  return s;
}

int PoolOf(v1::WorkerRole role) {
  switch (role) {
    case v1::WORKER_ROLE_PREFILL:
      return static_cast<int>(Pool::kPrefill);
    case v1::WORKER_ROLE_DECODE:
      return static_cast<int>(Pool::kDecode);
    default:
      return static_cast<int>(Pool::kColocated);
  }
}

bool RoleInPool(v1::WorkerRole role, Pool pool) {
  switch (pool) {
    case Pool::kPrefill:
      return role == v1::WORKER_ROLE_PREFILL;
    case Pool::kDecode:
      return role == v1::WORKER_ROLE_DECODE;
    case Pool::kColocated:
      return role == v1::WORKER_ROLE_BOTH;
  }
  return false;
}

}  // namespace

absl::Status ParsePolicy(const std::string& name, Policy* out) {
  if (name == "least-load") {
    *out = Policy::kLeastLoad;
  } else if (name == "round-robin") {
    *out = Policy::kRoundRobin;
  } else if (name == "kv-aware") {
    *out = Policy::kKvAware;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("policy must be least-load, round-robin or kv-aware, got '", name, "'"));
  }
  return absl::OkStatus();
}

const char* PolicyName(Policy p) {
  switch (p) {
    case Policy::kLeastLoad:
      return "least-load";
    case Policy::kRoundRobin:
      return "round-robin";
    case Policy::kKvAware:
      return "kv-aware";
  }
  return "least-load";
}

Assignment& Assignment::operator=(Assignment&& o) noexcept {
  if (this != &o) {
    Release();
    registry_ = o.registry_;
    worker_id_ = std::move(o.worker_id_);
    address_ = std::move(o.address_);
    role_ = o.role_;
    generation_ = o.generation_;
    backlog_ = o.backlog_;
    o.registry_ = nullptr;
    o.backlog_ = -1;
  }
  return *this;
}

void Assignment::Release() {
  if (registry_ == nullptr) return;
  EndBacklog();
  registry_->Unassign(worker_id_, generation_);
  registry_ = nullptr;
}

void Assignment::StartBacklog(int64_t tokens) {
  if (registry_ == nullptr) return;
  EndBacklog();
  backlog_ = std::max<int64_t>(0, tokens);
  registry_->AddBacklog(worker_id_, generation_, backlog_, 1);
}

void Assignment::EndBacklog() {
  if (registry_ == nullptr || backlog_ < 0) return;
  registry_->AddBacklog(worker_id_, generation_, -backlog_, -1);
  backlog_ = -1;
}

WorkerRegistry::WorkerRegistry(RegistryOptions o) : o_(std::move(o)) {
  absl::MutexLock lock(&mu_);
  last_tick_ = Now();
}

absl::Status WorkerRegistry::Register(const v1::RegisterRequest& req) {
  if (req.worker_id().empty()) return absl::InvalidArgumentError("worker_id is empty");
  if (req.address().empty()) return absl::InvalidArgumentError("address is empty");
  if (req.role() != v1::WORKER_ROLE_PREFILL && req.role() != v1::WORKER_ROLE_DECODE &&
      req.role() != v1::WORKER_ROLE_BOTH) {
    return absl::InvalidArgumentError(absl::StrCat("role must be PREFILL, DECODE or BOTH, got ",
                                                   v1::WorkerRole_Name(req.role())));
  }
  if (req.kv_blocks_total() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_blocks_total must be >= 0, got ", req.kv_blocks_total()));
  }
  if (!req.model().empty() && !o_.model_names.empty()) {
    const std::string stem = Stem(req.model());
    const bool match = std::any_of(o_.model_names.begin(), o_.model_names.end(),
                                   [&](const std::string& n) { return Stem(n) == stem; });
    if (!match) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", req.worker_id(), " serves model '", req.model(),
                       "' but this router serves '", absl::StrJoin(o_.model_names, "' / '"), "'"));
    }
  }
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  Worker& w = workers_[req.worker_id()];
  Unindex(w);
  w = Worker{};
  w.reg = req;
  w.lease_expiry = now + o_.lease;
  w.last_heartbeat = now;
  w.generation = next_generation_++;
  Reindex(w);
  return absl::OkStatus();
}

bool WorkerRegistry::Heartbeat(const v1::HeartbeatRequest& req) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(req.worker_id());
  if (it == workers_.end()) return false;
  Worker& w = it->second;
  const absl::Time now = Now();
  if (!Leased(w, now)) {
    // Too late: the worker was already invisible to Pick. Forget it so it registers afresh.
    Erase(it);
    return false;
  }
  w.lease_expiry = now + o_.lease;
  w.last_heartbeat = now;
  if (req.has_stats()) {
    w.stats = req.stats();
    w.have_stats = true;
    w.pending_blocks = 0;  // the report now includes what was picked before it
  }
  w.draining = w.draining || req.draining();
  Reindex(w);
  return true;
}

bool WorkerRegistry::Deregister(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return false;
  Erase(it);
  return true;
}

std::vector<std::string> WorkerRegistry::ExpireLeases() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  std::vector<std::string> gone;
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (!Leased(it->second, now)) {
      gone.push_back(it->first);
      it = Erase(it);
    } else {
      ++it;
    }
  }
  return gone;
}

absl::Duration WorkerRegistry::Tick() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  const absl::Duration gap = now - last_tick_;
  absl::Duration stall = absl::ZeroDuration();
  if (gap > o_.stall_after) {
    // The heartbeats of the stall are still queued, or were refused by a deadline the worker
    // set: a fresh lease for whoever held one when it began, as a heartbeat would give.
    stall = gap;
    for (auto& [id, w] : workers_) {
      if (w.lease_expiry > last_tick_) w.lease_expiry = std::max(w.lease_expiry, now + o_.lease);
    }
  }
  last_tick_ = now;
  return stall;
}

bool WorkerRegistry::Leased(const Worker& w, absl::Time now) const {
  return now < w.lease_expiry || (now - last_tick_ > o_.stall_after && w.lease_expiry > last_tick_);
}

bool WorkerRegistry::Eligible(const Worker& w, Pool pool, absl::Time now) const {
  return !w.draining && Leased(w, now) && RoleInPool(w.reg.role(), pool);
}

WorkerRegistry::PickKey WorkerRegistry::KeyOf(const Worker& w) const {
  // Smaller key wins. Free blocks are negated so that more free sorts first.
  if (o_.policy == Policy::kRoundRobin) return {0, 0, 0, w.last_pick};
  if (w.reg.role() != v1::WORKER_ROLE_PREFILL) {
    const int64_t free =
        (w.have_stats ? w.stats.kv_blocks_free() : w.reg.kv_blocks_total()) - w.pending_blocks;
    return {-free, w.inflight, w.have_stats ? w.stats.running() : 0, w.last_pick};
  }
  const int64_t reported = w.have_stats ? w.stats.running() + w.stats.waiting() : 0;
  return {w.inflight, reported, 0, w.last_pick};
}

void WorkerRegistry::Unindex(Worker& w) {
  if (!w.indexed) return;
  index_[PoolOf(w.reg.role())].erase({w.key, &w});
  w.indexed = false;
}

void WorkerRegistry::Reindex(Worker& w) {
  Unindex(w);
  if (w.draining) return;
  w.key = KeyOf(w);
  index_[PoolOf(w.reg.role())].insert({w.key, &w});
  w.indexed = true;
}

std::map<std::string, WorkerRegistry::Worker>::iterator WorkerRegistry::Erase(
    std::map<std::string, Worker>::iterator it) {
  Unindex(it->second);
  return workers_.erase(it);
}

PlanKind WorkerRegistry::Plan() const {
  absl::ReaderMutexLock lock(&mu_);
  const absl::Time now = Now();
  // A pool can serve when one of its indexed (not draining) workers holds a lease.
  auto any = [&](Pool pool) {
    mu_.AssertReaderHeld();  // called right here, under the lock (the analysis cannot see it)
    for (const auto& [key, w] : index_[static_cast<int>(pool)]) {
      if (Leased(*w, now)) return true;
    }
    return false;
  };
  const bool prefill = any(Pool::kPrefill), decode = any(Pool::kDecode);
  const bool both = any(Pool::kColocated);
  if (prefill && decode) return PlanKind::kDisaggregated;
  if (both) return PlanKind::kColocated;
  return PlanKind::kNone;
}

Assignment WorkerRegistry::Pick(Pool pool, int64_t kv_blocks,
                                const absl::flat_hash_set<std::string>& exclude) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  // The first worker in the pool's order that holds a lease and is not excluded.
  for (const auto& [key, w] : index_[static_cast<int>(pool)]) {
    if (!Leased(*w, now) || exclude.contains(w->reg.worker_id())) continue;
    return AssignLocked(w, pool != Pool::kPrefill, kv_blocks);
  }
  return Assignment();
}

Assignment WorkerRegistry::AssignLocked(Worker* best, bool kv_pool, int64_t kv_blocks) {
  Assignment a;
  best->inflight++;
  best->routed++;
  best->last_pick = ++pick_seq_;
  if (kv_pool) best->pending_blocks += kv_blocks;
  Reindex(*best);
  a.registry_ = this;
  a.worker_id_ = best->reg.worker_id();
  a.address_ = best->reg.address();
  a.role_ = best->reg.role();
  a.generation_ = best->generation;
  return a;
}

Assignment WorkerRegistry::PickScored(
    Pool pool, int64_t kv_blocks, const absl::flat_hash_set<std::string>& exclude,
    const std::function<double(const std::string&, double)>& score) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  Worker* best = nullptr;
  double best_score = 0;
  for (auto& [id, w] : workers_) {
    if (!Eligible(w, pool, now) || exclude.contains(id)) continue;
    const double load =
        w.inflight + (w.have_stats ? w.stats.running() + w.stats.waiting() : 0);
    const double s = score(id, load);
    if (best == nullptr || s > best_score ||
        (s == best_score && w.last_pick < best->last_pick)) {
      best = &w;
      best_score = s;
    }
  }
  if (best == nullptr) return Assignment();
  return AssignLocked(best, pool != Pool::kPrefill, kv_blocks);
}

void WorkerRegistry::Unassign(const std::string& id, uint64_t generation) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(id);
  if (it == workers_.end() || it->second.generation != generation) return;
  if (it->second.inflight > 0) it->second.inflight--;
  if (it->second.indexed) Reindex(it->second);
}

void WorkerRegistry::AddBacklog(const std::string& id, uint64_t generation, int64_t tokens,
                                int32_t requests) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(id);
  if (it == workers_.end() || it->second.generation != generation) return;
  it->second.backlog_tokens = std::max<int64_t>(0, it->second.backlog_tokens + tokens);
  it->second.backlog_requests = std::max(0, it->second.backlog_requests + requests);
}

std::vector<WorkerRegistry::Load> WorkerRegistry::Loads(Pool pool) const {
  absl::ReaderMutexLock lock(&mu_);
  const absl::Time now = Now();
  std::vector<Load> out;
  for (const auto& [id, w] : workers_) {
    if (!Eligible(w, pool, now)) continue;
    Load& l = out.emplace_back();
    l.worker_id = id;
    l.backlog_tokens = w.backlog_tokens;
    l.backlog_requests = w.backlog_requests;
    if (w.have_stats) l.cost = w.stats.step_cost();
  }
  return out;
}

std::vector<v1::WorkerInfo> WorkerRegistry::List() const {
  absl::ReaderMutexLock lock(&mu_);
  const absl::Time now = Now();
  std::vector<v1::WorkerInfo> out;
  for (const auto& [id, w] : workers_) {
    v1::WorkerInfo& i = out.emplace_back();
    i.set_worker_id(id);
    i.set_role(w.reg.role());
    i.set_address(w.reg.address());
    i.set_model(w.reg.model());
    i.set_kv_blocks_total(w.reg.kv_blocks_total());
    i.set_max_seqs(w.reg.max_seqs());
    i.set_max_batch_tokens(w.reg.max_batch_tokens());
    i.set_kv_block_size(w.reg.kv_block_size());
    i.set_ctx_size(w.reg.ctx_size());
    i.set_draining(w.draining);
    if (w.have_stats) *i.mutable_stats() = w.stats;
    i.set_lease_remaining_ms(absl::ToInt64Milliseconds(w.lease_expiry - now));
    i.set_router_inflight(w.inflight);
    i.set_requests_routed(w.routed);
    i.set_last_heartbeat_age_ms(absl::ToInt64Milliseconds(now - w.last_heartbeat));
  }
  return out;
}

size_t WorkerRegistry::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return workers_.size();
}

}  // namespace tandem::router
