// WorkerRegistry: the router's table of prefill, decode and colocated workers.
//
// Workers Register (role, address, KV pool size) and then Heartbeat with their stats; each
// registration holds a lease that every heartbeat renews. A worker whose lease runs out is
// dropped (lazily: an expired worker is never picked, and ExpireLeases removes it for good), so
// a crashed worker needs no restart of anything. A draining worker (it said so in a heartbeat,
// typically on SIGTERM) keeps its in-flight work but is never picked again; Deregister removes
// it at once.
//
// Selection. The router accounts for its own routing between heartbeats: every Pick counts one
// request in flight on the chosen worker until its Assignment is destroyed, and for decode also
// the KV blocks it will hold, subtracted from the free count of the last heartbeat until the
// next one reports it. Policies:
// - kLeastLoad: decode -> most (estimated) free KV blocks, then fewest requests in flight, then
//   least recently picked; prefill -> fewest requests in flight, then least reported
//   running + waiting, then least recently picked.
// - kRoundRobin: least recently picked among the eligible (i.e. a rotation).
// - kKvAware: decode as kLeastLoad; prefill through PickScored with the router's prefix index
//   (services/router/prefix_index.h); plain Pick of a prefill worker is kLeastLoad.
// Only workers of the exact role are candidates for a pool; colocated (BOTH) workers form their
// own pool, used when either disaggregated pool is empty (see Plan()).
//
// Threading: all methods are thread-safe (one mutex). The clock is injectable for tests.
// Errors: Register returns INVALID_ARGUMENT for a request missing an id, address or role, and
// FAILED_PRECONDITION for a worker serving another model.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::router {

enum class Policy { kLeastLoad, kRoundRobin, kKvAware };

// "least-load" / "round-robin" / "kv-aware"; INVALID_ARGUMENT otherwise.
absl::Status ParsePolicy(const std::string& name, Policy* out);
const char* PolicyName(Policy p);

struct RegistryOptions {
  absl::Duration lease = absl::Seconds(3);
  Policy policy = Policy::kLeastLoad;
  // Names the router's model answers to (id, path, file name). A worker that reports a model
  // must report one of them, compared by file stem; an empty report is accepted.
  std::vector<std::string> model_names;
  std::function<absl::Time()> clock;  // default absl::Now
  // The router's own stalls (a stopped, swapped or CPU-starved process). When set, the owner
  // calls Tick() more often than this; a longer gap between two ticks is a stall, during which
  // the router could read no heartbeat, so it judges no lease on it: a worker that held its
  // lease at the last tick before the stall holds it until the tick after, which gives it a
  // fresh one. Infinite (the default): no stall detection.
  absl::Duration stall_after = absl::InfiniteDuration();
};

enum class Pool { kPrefill, kDecode, kColocated };

// How the router should serve the next request, given who is registered.
enum class PlanKind {
  kDisaggregated,  // a decode worker reserves, a prefill worker prefills
  kColocated,      // one BOTH worker prefills locally and decodes
  kNone,           // nobody can serve
};

class WorkerRegistry;

// One request counted against one worker; destroying it (or Release) ends the count. Movable.
class Assignment {
 public:
  Assignment() = default;
  Assignment(Assignment&& o) noexcept { *this = std::move(o); }
  Assignment& operator=(Assignment&& o) noexcept;
  ~Assignment() { Release(); }
  void Release();

  explicit operator bool() const { return registry_ != nullptr; }
  const std::string& worker_id() const { return worker_id_; }
  const std::string& address() const { return address_; }
  v1::WorkerRole role() const { return role_; }

  // Prefill work on the worker that this request has started and not finished: `tokens` prompt
  // tokens (WorkerRegistry::Loads' backlog, for the TTFT prediction). EndBacklog (or Release)
  // takes it off again; a second StartBacklog replaces the first.
  void StartBacklog(int64_t tokens);
  void EndBacklog();

 private:
  friend class WorkerRegistry;
  WorkerRegistry* registry_ = nullptr;
  int64_t backlog_ = -1;  // tokens counted on the worker; -1: none
  std::string worker_id_;
  std::string address_;
  v1::WorkerRole role_ = v1::WORKER_ROLE_UNSPECIFIED;
  uint64_t generation_ = 0;  // the registration it counts against
};

class WorkerRegistry {
 public:
  explicit WorkerRegistry(RegistryOptions o);
  WorkerRegistry(const WorkerRegistry&) = delete;
  WorkerRegistry& operator=(const WorkerRegistry&) = delete;

  // Adds the worker, or replaces a registration with the same id (a restarted worker). The
  // router's in-flight counts of a replaced registration are not carried over.
  absl::Status Register(const v1::RegisterRequest& req);
  // Renews the lease and records stats and draining. False when the id is unknown (never
  // registered, deregistered or expired): the worker must register again.
  bool Heartbeat(const v1::HeartbeatRequest& req);
  bool Deregister(const std::string& worker_id);
  // Removes workers whose lease has run out; returns their ids.
  std::vector<std::string> ExpireLeases();
  // Records that the router runs (see RegistryOptions::stall_after). Returns the stall that
  // ended with this tick (zero when there was none); the workers that held a lease when it
  // began have a fresh lease now.
  absl::Duration Tick();

  PlanKind Plan() const;
  // Chooses a worker of `pool` by the policy, skipping ids in `exclude`, and counts the request
  // (plus `kv_blocks` blocks for decode pools) against it. Empty when no worker is eligible.
  Assignment Pick(Pool pool, int64_t kv_blocks,
                  const absl::flat_hash_set<std::string>& exclude = {});

  // Like Pick, but the eligible worker with the highest score(worker_id, load) wins, where load
  // is the router's in-flight count plus the reported running + waiting; ties go to the least
  // recently picked. `score` runs under the registry's lock: it must not call back into it.
  Assignment PickScored(Pool pool, int64_t kv_blocks,
                        const absl::flat_hash_set<std::string>& exclude,
                        const std::function<double(const std::string&, double)>& score);

  // The eligible workers of `pool` with the prefill work the router has in flight on each and
  // each one's fitted step cost (zeros until its first heartbeat with stats), sorted by id.
  struct Load {
    std::string worker_id;
    int64_t backlog_tokens = 0;
    int32_t backlog_requests = 0;
    v1::StepCost cost;
  };
  std::vector<Load> Loads(Pool pool) const;

  std::vector<v1::WorkerInfo> List() const;  // sorted by id
  size_t size() const;
  const RegistryOptions& options() const { return o_; }

 private:
  friend class Assignment;
  // Pick's order within a pool: the smallest key wins (see Pick), ties to the smallest id.
  using PickKey = std::tuple<int64_t, int64_t, int64_t, uint64_t>;
  struct Worker {
    v1::RegisterRequest reg;
    v1::WorkerStats stats;
    bool have_stats = false;
    bool draining = false;
    absl::Time lease_expiry;
    absl::Time last_heartbeat;
    uint64_t generation = 0;
    int32_t inflight = 0;
    int64_t pending_blocks = 0;  // picked since the last heartbeat's stats
    uint64_t routed = 0;
    uint64_t last_pick = 0;  // pick sequence number; 0 = never
    int64_t backlog_tokens = 0;  // Assignment::StartBacklog
    int32_t backlog_requests = 0;
    PickKey key{};  // its place in index_, valid while indexed
    bool indexed = false;
  };
  struct ByKey {
    bool operator()(const std::pair<PickKey, Worker*>& a,
                    const std::pair<PickKey, Worker*>& b) const {
      if (a.first != b.first) return a.first < b.first;
      return a.second->reg.worker_id() < b.second->reg.worker_id();
    }
  };
  using Index = std::set<std::pair<PickKey, Worker*>, ByKey>;
  absl::Time Now() const { return o_.clock ? o_.clock() : absl::Now(); }
  bool Eligible(const Worker& w, Pool pool, absl::Time now) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Holds its lease at `now`: before its expiry, or, while the router is stalled (no Tick for
  // longer than stall_after), if it held it at the last tick.
  bool Leased(const Worker& w, absl::Time now) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void Unassign(const std::string& id, uint64_t generation);
  void AddBacklog(const std::string& id, uint64_t generation, int64_t tokens, int32_t requests);
  Assignment AssignLocked(Worker* w, bool kv_pool, int64_t kv_blocks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PickKey KeyOf(const Worker& w) const;
  // Takes the worker out of its pool's order; Reindex puts it back under its current key
  // (not when draining: it is never picked again).
  void Unindex(Worker& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Reindex(Worker& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases a worker, and from the index first.
  std::map<std::string, Worker>::iterator Erase(std::map<std::string, Worker>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RegistryOptions o_;
  mutable absl::Mutex mu_;
  std::map<std::string, Worker> workers_ ABSL_GUARDED_BY(mu_);
  // Per pool (Pool's value), its workers that are not draining, in pick order. Workers whose
  // lease ran out stay until ExpireLeases or a late heartbeat; Pick passes over them.
  std::array<Index, 3> index_ ABSL_GUARDED_BY(mu_);
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Time last_tick_ ABSL_GUARDED_BY(mu_);
  uint64_t pick_seq_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tandem::router
