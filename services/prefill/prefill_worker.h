// The prefill worker's core: computes a prompt's KV with chunked prefill and writes it, layer by
// layer as layers finish, straight into a decode worker's reserved blocks over the KvTransport.
//
// One Prefill: allocate local blocks; run the prompt through Engine::Step in chunks (several
// requests' chunks share a step when they are in flight together); after each layer of a step
// post one transport write per request for exactly the bytes of that chunk's positions in the
// layer's K and V, so the transfer of layer l overlaps the compute of layers l+1...; sample the
// first token from the last logits with the request's sampling params; wait until every write
// is visible at the destination; checksum each block of the local copy (kv_layout.h); free the
// local blocks; answer. The decode worker verifies those checksums before decoding.
//
// Threading: Prefill blocks its caller (a gRPC handler thread) until the request completes,
// fails, is cancelled or its deadline passes; it never computes. ONE engine thread owns the
// Engine and its block pool and sleeps on a condition variable when idle. Transport callbacks
// only count completions and wake the engine thread. Local blocks stay allocated until every
// write that reads them has completed, even when the request was cancelled.
// Ownership: model and transport belong to the caller and must outlive the worker.
// Prefix onboarding (PrefillWorkerOptions::prefix_cache, ::kvstore): a request's prompt is cut
// into full blocks named by chained hashes seeded with the request's salt (the tenant, set by
// the router). At admission the worker reuses the longest run of them in its own prefix cache
// (engine::PrefixCache over the local pool), then asks the kvstore for more: the Lookup runs on
// the caller's thread before the request queues; the Read (the store writes the blocks into
// this worker's registered pool over the transport) runs at admission under a deadline, and
// every block read is checked against the store's checksum. Only the rest of the prompt is
// computed (never its last token, whose logits give the first token). The onboarded prefix is
// sent to decode like computed KV (written for every layer at admission). What decode already
// holds (the destination's held_blocks: an earlier turn's blocks in its own prefix cache) is
// computed or onboarded here as needed for attention but never written, and its checksums are
// not sent. When the request succeeds its full blocks enter the prefix cache, and
// the ones the store did not have are copied out and published to the store off the critical
// path (KvStoreClient's bounded queue). A store that is down, slow or wrong costs a request
// at most the lookup and read deadlines: it then runs cold. Blocks a failed Read may still be
// written into are quarantined (kept out of the pool) for `read_quarantine` before reuse.
// Metrics (optional, PrefillWorkerOptions::metrics): queue time (Prefill call to admission,
// when local blocks are allocated), e2e (Prefill call to its answer, any outcome), the KV
// transfer of each successful request (its bytes, and the transfer time compute did not hide:
// PrefillResponse.transfer_seconds), running, waiting and local KV usage after every turn, and
// the prefix cache's queries and hits (in blocks, own cache and kvstore together).
// A draft model (--speculative self:TYPE or draft:PATH) is loaded here too. When a destination
// asks for the draft's prompt K/V (KvDestination.draft), the draft runs over the whole prompt
// in its own engine and pool, in the same engine turns as the target's chunks, and its K/V go to
// the decode worker's draft blocks layer by layer, under the same deadline and lease; the answer
// waits for both and carries the draft blocks' checksums. A draft that cannot run (no local
// draft blocks free, a failed draft step) leaves them unsent: decode then computes them.
// Errors: INVALID_ARGUMENT (bad prompt, sampling or destination), FAILED_PRECONDITION (the
// destination's KV layout differs from this worker's), ALREADY_EXISTS (id in flight),
// CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE (peer unreachable, or shutting down).
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/trace/trace.h"
#include "common/transfer/transfer.h"
#include "engine/kv/prefix_cache.h"
#include "engine/runtime/engine.h"
#include "engine/spec/proposer.h"
#include "services/common/kv_device.h"
#include "services/common/liveness.h"
#include "services/common/metrics.h"
#include "services/common/step_report.h"
#include "services/prefill/kvstore_client.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::prefill {

struct PrefillWorkerOptions {
  std::shared_ptr<const engine::Model> model;
  engine::EngineOptions engine;
  std::string worker_id = "prefill";
  transfer::KvTransport* transport = nullptr;  // not owned; required
  // The transport the kvstore writes onboarded blocks over (it serves host memory); not owned.
  // Null: `transport`. A GPU worker needs one here when `transport` is device-only (cuda_ipc).
  transfer::KvTransport* kvstore_transport = nullptr;
  // Bounds the transfer of a request whose RPC has no deadline.
  absl::Duration max_transfer_time = absl::Minutes(2);
  // How often a waiting Prefill checks whether its caller gave up.
  absl::Duration poll = absl::Milliseconds(20);
  // Test twin hook: runs on the engine thread before every engine step. Tests hold the engine
  // with it to cancel queued or running prefills deterministically.
  std::function<void()> before_step;
  // Where this worker's series go (labelled with its model and role); not owned, may be null.
  services::ServingMetrics* metrics = nullptr;
  // Keep computed full blocks in a prefix cache over the local pool and reuse them.
  bool prefix_cache = true;
  // The tiered KV store to onboard from and publish to; an empty address means none. Needs the
  // local pool registered with the transport, which Create then does.
  // With a GPU pool (engine.device kCuda) the store writes into a pinned host staging region
  // instead, registered with kvstore_transport, and verified blocks are copied to the device;
  // publishing copies device to host through pinned staging too (services/common/kv_device.h).
  KvStoreClientOptions kvstore;
  // How long blocks stay out of the pool after a kvstore Read into them failed (the store may
  // still be writing); on top of the read's own timeout.
  absl::Duration read_quarantine = absl::Seconds(2);
  // Must agree with the decode workers' (the destination's speculative field), checked on
  // every Prefill. With a draft model, Create loads it to compute drafts' prompt K/V, unless
  // draft_kv is off (--draft-kv decode: decode workers compute them).
  engine::SpeculativeOptions speculative;
  bool draft_kv = true;
  // What engine utilisation is measured against, and its series (may be null).
  engine::DevicePeaks peaks;
  bool measure_peaks = false;  // measure the peaks left at 0, in the background
  services::UtilizationMetrics* util_metrics = nullptr;
  // Spans of RPCs, engine steps and KV transfers (common/trace/trace.h); null: none. Not owned.
  trace::Tracer* tracer = nullptr;
};

class PrefillWorker {
 public:
  static absl::StatusOr<std::unique_ptr<PrefillWorker>> Create(const PrefillWorkerOptions& o);
  // Fails queued requests with UNAVAILABLE, cancels running ones and waits for their writes.
  ~PrefillWorker();
  PrefillWorker(const PrefillWorker&) = delete;
  PrefillWorker& operator=(const PrefillWorker&) = delete;

  // Blocks until done. `caller_gone` (may be empty) is polled; when it returns true the request
  // is cancelled. PrefillResponse.compute_seconds is the wall time from the first to the last
  // chunk; transfer_seconds the time writes took after the last chunk (the part compute did not
  // hide).
  absl::StatusOr<v1::PrefillResponse> Prefill(const v1::PrefillRequest& req, absl::Time deadline,
                                              const std::function<bool()>& caller_gone = {});
  // Cancels a queued or running request; false when the id is unknown.
  bool Cancel(const std::string& request_id);
  v1::WorkerStats Stats() const;
  // Waits until blocks queued for the kvstore are published (or dropped); true at once without
  // a kvstore. For tests and benchmarks.
  bool WaitForPublishing(absl::Duration timeout);

  // Blocks of the draft model's local pool in use, as of the engine thread's last turn; 0
  // without a draft. For tests: at rest it must be 0.
  int32_t draft_blocks_in_use() const { return draft_blocks_in_use_.load(); }

  const std::string& worker_id() const { return o_.worker_id; }
  trace::Tracer* tracer() const { return o_.tracer; }
  int32_t kv_blocks_total() const { return kv_blocks_total_; }
  const std::string& model_name() const;
  // How long the engine loop has been on its current turn of work (zero while it sleeps): the
  // liveness watchdog's input (services/common/liveness.h). Thread-safe.
  absl::Duration EngineBusyFor() const { return liveness_.BusyFor(absl::Now()); }

 private:
  struct Job;
  struct KvSend;
  PrefillWorker(const PrefillWorkerOptions& o, std::unique_ptr<engine::Engine> engine);
  absl::StatusOr<std::shared_ptr<Job>> MakeJob(const v1::PrefillRequest& req,
                                               absl::Time deadline) const;
  void Loop();
  // Engine-thread helpers.
  void Admit();
  bool ComputeStep();
  // Runs the draft over the prompts of jobs that send its K/V; true if it computed anything.
  bool DraftStep();
  // The target's, or with `draft` the draft's, K/V of positions [start, start + n) of layer
  // `layer`, written to the destination.
  void PostLayerWrites(const std::shared_ptr<Job>& job, bool draft, int64_t start, int64_t n,
                       int32_t layer);
  void EndCompute(const std::shared_ptr<Job>& job, absl::Status status);
  // A write to the job's destination failed: ends its compute with that error (true).
  bool EndIfDestinationGone(const std::shared_ptr<Job>& job);
  void Finalize(const std::shared_ptr<Job>& job);
  void Complete(Job& job, absl::StatusOr<v1::PrefillResponse> result);
  void PublishStats();
  // Engine-thread helpers of prefix onboarding.
  void Onboard(Job& job, int32_t usable);
  void QueuePublish(const Job& job);
  // Onboard for a GPU pool: the store writes blocks [from, to) into the pinned staging, which
  // are verified there and copied to the device.
  void OnboardThroughStaging(Job& j, int32_t from, int32_t to);
  void ReleaseBlocks(Job& job, bool cache_them);
  void ReleaseQuarantine(bool all);
  // Transport-callback side: the job's last write completed after its compute ended.
  void PostReady(std::shared_ptr<Job> job);

  PrefillWorkerOptions o_;
  std::unique_ptr<engine::Engine> engine_;
  // The draft model's engine (its own pool), with --speculative self:TYPE or draft:PATH.
  std::unique_ptr<engine::Engine> draft_engine_;
  int32_t kv_blocks_total_ = 0;
  std::string transport_name_;
  std::unique_ptr<engine::PrefixCache> cache_;  // engine thread only; null when off
  std::unique_ptr<KvStoreClient> kvstore_;      // null without a store
  transfer::KvTransport* store_transport_ = nullptr;  // the kvstore's: o_.kvstore_transport or
                                                      // o_.transport
  // The local pool (host pool) or the onboarding staging (GPU pool) as registered with
  // store_transport_: what kvstore Reads write into.
  std::string region_bytes_;
  uint64_t region_id_ = 0;
  bool region_registered_ = false;
  bool pool_in_transport_memory_ = false;
  // GPU pool with a kvstore: pinned staging for onboarding (registered, staging_blocks_ blocks
  // per region) and for publishing (engine thread only). Null otherwise.
  std::unique_ptr<services::KvStaging> onboard_staging_;
  std::unique_ptr<services::KvStaging> publish_staging_;
  int32_t staging_blocks_ = 0;
  absl::Time staging_quarantined_until_ = absl::InfinitePast();  // after a failed Read
  uint64_t published_blocks_ = 0;  // engine thread only
  uint64_t query_blocks_ = 0;      // engine thread only
  uint64_t hit_blocks_ = 0;        // engine thread only
  struct Quarantined {
    absl::Time until;
    std::vector<int32_t> blocks;
  };
  std::vector<Quarantined> quarantine_;  // engine thread only

  // Engine-thread state.
  std::deque<std::shared_ptr<Job>> queue_;    // accepted, waiting for local blocks
  std::vector<std::shared_ptr<Job>> active_;  // holding local blocks
  bool admit_blocked_ = false;                // the queue head did not fit; wait for frees
  bool shutting_down_ = false;                // cancelled requests then answer UNAVAILABLE
  std::vector<float> logits_;
  std::vector<float> draft_logits_;  // none are asked for; Step's output argument
  std::atomic<int32_t> draft_blocks_in_use_{0};
  uint64_t invariant_violations_seen_ = 0;  // PublishStats (engine thread, or before it starts)
  services::StepReporter step_report_;
  services::LoopLiveness liveness_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<std::shared_ptr<Job>> pending_ ABSL_GUARDED_BY(mu_);  // new, for the engine thread
  std::vector<std::shared_ptr<Job>> ready_ ABSL_GUARDED_BY(mu_);   // writes drained
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> by_id_ ABSL_GUARDED_BY(mu_);
  bool wake_ ABSL_GUARDED_BY(mu_) = false;  // a cancel to look at
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  v1::WorkerStats snapshot_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace tandem::prefill
