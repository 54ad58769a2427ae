// PrefixIndex: the router's global view of which prefill workers hold which KV blocks, for
// KV-aware prefill routing (--policy kv-aware).
//
// Blocks are named by the engine's chained block hashes (engine::ComputeBlockHashes, seeded with
// the tenant's salt, auth.h TenantSalt), so "worker W holds block i of this prompt" implies it holds blocks 0..i-1
// too (as far as its own cache has not evicted them). The index learns from Prefill responses:
// each lists the prompt's full blocks the worker now holds (PrefillResponse.cached_block_hashes)
// and, where blocks were published to the kvstore, those are recorded as store-held (reachable
// by every worker, at a tier-dependent cost). It forgets the least recently recorded hashes past
// its capacity, and a worker's entries when the worker leaves (SetWorkers).
//
// Capacity. Without KV events from the workers the index cannot see their evictions, so it is
// sized from what they can hold: SetWorkers (the router calls it every sweep with the registered
// prefill workers) sets it to `blocks_per_worker_block` times their KV blocks in all (the other
// share covers blocks only the kvstore still holds), within [min_blocks, max_blocks]. Hashes
// recorded longer ago than that are gone from the workers' caches in any LRU order, so the index
// stays the size of the pool's caches instead of filling toward max_blocks (~70 B per hash).
//
// Choice (the cost function of NVIDIA Dynamo's KV router, in spirit): for each candidate,
//   score = overlap_weight * (own_blocks + store_weight * store_blocks) - load
// where own_blocks is the leading run of the prompt's blocks the worker holds itself,
// store_blocks the further leading blocks the kvstore holds, and load the worker's requests
// (router in-flight plus its reported running + waiting). The highest score wins; ties go to the
// first candidate (the registry passes them least recently picked first). Index entries are
// hints: a wrong one costs a recompute, never a wrong answer.
//
// Threading: thread-safe (one mutex). Errors: none.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace tandem::router {

struct PrefixIndexOptions {
  size_t max_blocks = 1 << 20;  // hashes tracked at most (also the capacity until SetWorkers)
  size_t min_blocks = 4096;     // ... and at least, once SetWorkers has sized it
  double blocks_per_worker_block = 2.0;
  double overlap_weight = 1.0;  // score per cached block, in requests of load
  double store_weight = 0.5;    // a kvstore block relative to a block the worker holds itself
};

struct PrefixWorker {
  std::string worker_id;
  int64_t kv_blocks = 0;  // the worker's KV pool, in blocks (RegisterRequest.kv_blocks_total)
};

struct PrefixCandidate {
  std::string worker_id;
  double load = 0;
};

class PrefixIndex {
 public:
  explicit PrefixIndex(PrefixIndexOptions o = {});

  // `worker_id` holds these blocks (a prompt's leading full blocks, in order).
  void RecordWorker(const std::string& worker_id, std::span<const uint64_t> hashes);
  // The kvstore holds these blocks.
  void RecordStore(std::span<const uint64_t> hashes);
  void ForgetWorker(const std::string& worker_id);
  // The prefill workers registered now: forgets every other worker's entries and sizes the
  // index from their KV pools (see Capacity above).
  void SetWorkers(std::span<const PrefixWorker> workers);

  // Leading blocks of `hashes` the worker holds itself.
  int32_t WorkerOverlap(const std::string& worker_id, std::span<const uint64_t> hashes) const;
  double Score(const PrefixCandidate& c, std::span<const uint64_t> hashes) const;
  // Index into `candidates` of the best one; -1 when there is none.
  int Choose(std::span<const PrefixCandidate> candidates, std::span<const uint64_t> hashes) const;

  size_t size() const;
  size_t capacity() const;

 private:
  struct Entry {
    uint64_t workers = 0;  // bit i: worker slot i holds the block
    bool in_store = false;
    std::list<uint64_t>::iterator lru;
  };
  // Worker slot of an id (at most 64 distinct workers are tracked; -1 beyond that).
  int SlotLocked(const std::string& worker_id, bool create) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int FindSlotLocked(const std::string& worker_id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  Entry& TouchLocked(uint64_t hash) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetSlotLocked(int slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  double ScoreLocked(const PrefixCandidate& c, std::span<const uint64_t> hashes) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const PrefixIndexOptions o_;
  mutable absl::Mutex mu_;
  size_t capacity_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Entry> blocks_ ABSL_GUARDED_BY(mu_);
  std::list<uint64_t> lru_ ABSL_GUARDED_BY(mu_);  // front: least recently recorded
  std::vector<std::string> slots_ ABSL_GUARDED_BY(mu_);  // worker id per slot ("" = free)
};

}  // namespace tandem::router
