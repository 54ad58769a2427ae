// The decode worker's core: one engine, one continuous-batching scheduler, the KV reservations
// remote prefills write into, all driven by ONE engine thread.
//
// Request path (disaggregated): Reserve allocates blocks for prompt + max_tokens under a lease
// and returns where a prefill worker must write the prompt's K/V (the transport region of the
// whole KV pool, registered once at start, plus block ids and layout facts). Decode later claims
// the reservation, verifies the prefill's per-block checksums against its own blocks, and only
// then admits the sequence (Scheduler::SubmitPrefilled); tokens then stream through a
// TokenStream. An unclaimed reservation expires, so a dead router or prefill worker never leaks
// KV memory.
// Quarantine: blocks of a reservation that ends without being decoded from (lease expired,
// cancelled, or refused at Decode) are not free at once: a slow or cancelled prefill may still
// have one-sided writes in flight into them, which the decode side cannot observe or stop. They
// sit in a quarantine for `quarantine` and only then return to the pool, so no other request
// can be handed a block a late write still lands in. A Decode for such a reservation is refused
// with NOT_FOUND naming why, without reading or touching its blocks.
// Colocated path: a DecodeRequest with prefill_locally needs no reservation; the scheduler
// prefills the prompt itself, in chunks batched with the running decodes.
// Sessions (DecodeWorkerOptions::prefix_cache): finished sequences leave their full blocks in
// the scheduler's prefix cache. A Reserve that sends the prompt's tokens holds the longest run
// of them that starts the prompt (never the block of its last token) and says so in the
// destination (held_blocks): prefill writes and checksums only the blocks after them. Held
// blocks are shared and never written; a reservation that ends undecoded gives them back to
// the cache, and only its own blocks go to quarantine.
//
// Threading: every public method is thread-safe and never runs model compute: each hands a
// closure to the engine thread through a mutex-protected inbox and waits for its answer. The
// engine thread owns the Engine, the Scheduler, the block pool and the reservation table; it
// sleeps on a condition variable when there is nothing to do (waking for new work or the next
// lease expiry) and never spins.
// Ownership: the transport (optional: without one only colocated requests work) and the model
// are the caller's and must outlive the worker.
// Metrics (optional, DecodeWorkerOptions::metrics): recorded on the engine thread. Queue time
// is the wait in the scheduler's queue (0 for a prefilled request, admitted at once); TTFT only
// for prefill_locally requests (a remote prefill's first token is not this worker's to time);
// inter-token latency, e2e (Decode call to the last event) and request_success_total by finish
// reason for every request; running, waiting and KV usage after every turn; kv_transfer_* from
// what the DecodeRequest passes on of the prefill's report; integrity failures as they happen.
// Errors: NOT_FOUND (no such reservation, or it expired or was cancelled), DATA_LOSS (a block's
// checksum differs: the blocks are quarantined and kv_integrity_failures counts it),
// RESOURCE_EXHAUSTED (no room for a reservation), INVALID_ARGUMENT (bad request), UNAVAILABLE
// (shutting down).
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
#include "engine/runtime/engine.h"
#include "engine/runtime/scheduler.h"
#include "engine/runtime/draft_proposer.h"
#include "services/common/liveness.h"
#include "services/common/metrics.h"
#include "services/common/step_report.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::decode {

struct DecodeWorkerOptions {
  std::shared_ptr<const engine::Model> model;
  engine::EngineOptions engine;
  std::string worker_id = "decode";
  transfer::KvTransport* transport = nullptr;        // not owned; null: colocated requests only
  absl::Duration default_lease = absl::Seconds(10);  // for a ReserveRequest with lease_ms 0
  absl::Duration max_lease = absl::Minutes(10);
  // How long blocks of an expired, cancelled or refused reservation stay out of the pool: it
  // must cover any write a prefill worker posted before it learned the request was over.
  absl::Duration quarantine = absl::Seconds(5);
  // Test twin hook: runs on the engine thread before every scheduler iteration that has work.
  // Tests slow the loop with it (to cancel mid-stream deterministically) or count steps.
  std::function<void()> before_step;
  // Prefix cache: a finished sequence's full blocks (prompt and generated) stay in the pool,
  // LRU, until an allocation needs them; a Reserve whose prompt starts with them (the next
  // turn of a conversation, under the same salt) holds them, so prefill sends only the rest.
  bool prefix_cache = true;
  // Where this worker's series go (labelled with its model and role); not owned, may be null.
  services::ServingMetrics* metrics = nullptr;
  // Speculative decoding of this worker's scheduler (off by default), and its series (may be
  // null). Its SpecHandshake goes into every reservation's destination.
  engine::SpeculativeOptions speculative;
  services::SpecMetrics* spec_metrics = nullptr;
  // With a draft model and a transport: reservations hand prefill draft blocks too, and the
  // draft's prompt K/V arrive with the target's (--draft-kv prefill). False: the draft computes
  // them here, on the sequence's first proposal (--draft-kv decode).
  bool draft_kv_from_prefill = true;
  // What engine utilisation is measured against, and its series (may be null).
  engine::DevicePeaks peaks;
  bool measure_peaks = false;  // measure the peaks left at 0, in the background
  services::UtilizationMetrics* util_metrics = nullptr;
  // Spans of RPCs, engine steps and KV transfers (common/trace/trace.h); null: none. Not owned.
  trace::Tracer* tracer = nullptr;
};

// The events of one request, in order; the last one has finished set. Filled by the engine
// thread, drained by one reader (the gRPC handler).
class TokenStream {
 public:
  // Waits until an event is available or `deadline` passes (then returns false).
  bool Next(absl::Time deadline, engine::TokenEvent* ev);

 private:
  friend class DecodeWorker;
  void Push(const engine::TokenEvent& ev);

  absl::Mutex mu_;
  std::deque<engine::TokenEvent> events_ ABSL_GUARDED_BY(mu_);
};

class DecodeWorker {
 public:
  // Creates the engine and the KV pool, registers the pool with the transport (when there is
  // one) and starts the engine thread.
  static absl::StatusOr<std::unique_ptr<DecodeWorker>> Create(const DecodeWorkerOptions& o);
  // Cancels every request (their streams end with CANCELLED), frees every block, stops the
  // engine thread and deregisters the KV pool.
  ~DecodeWorker();
  DecodeWorker(const DecodeWorker&) = delete;
  DecodeWorker& operator=(const DecodeWorker&) = delete;

  absl::StatusOr<v1::ReserveResponse> Reserve(const v1::ReserveRequest& req);
  // On success the stream's first event carries the first token.
  absl::StatusOr<std::shared_ptr<TokenStream>> StartDecode(const v1::DecodeRequest& req);
  // Cancels a reservation (its blocks go to quarantine) or a queued/running request; false
  // when the id is unknown.
  bool Cancel(const std::string& request_id);
  v1::WorkerStats Stats() const;

  // Runs `fn` on the engine thread and waits for it. Tests use it to look at or damage KV
  // memory without racing the engine.
  absl::Status RunOnEngineThread(std::function<void(engine::Engine&)> fn);

  // Blocks of the draft model's KV pool in use (by reservations, quarantine and sequences); 0
  // without a draft model. For tests: at rest it must be 0.
  absl::StatusOr<int32_t> DraftBlocksInUse();

  const std::string& worker_id() const { return o_.worker_id; }
  trace::Tracer* tracer() const { return o_.tracer; }
  int32_t kv_blocks_total() const { return kv_blocks_total_; }
  const std::string& model_name() const;
  // How long the engine loop has been on its current turn of work (zero while it sleeps): the
  // liveness watchdog's input (services/common/liveness.h). Thread-safe.
  absl::Duration EngineBusyFor() const { return liveness_.BusyFor(absl::Now()); }

 private:
  // One request's timestamps for the metrics; engine thread only.
  struct RequestClock {
    absl::Time arrived;
    absl::Time last_token = absl::InfinitePast();
    bool queued = false;        // in queued_: waiting in the scheduler's queue
    bool measure_ttft = false;  // this worker computes the first token
  };
  struct Reservation {
    std::vector<int32_t> blocks;        // prompt + max_tokens
    // Leading blocks taken from the prefix cache (shared, already holding the prompt's K/V;
    // prefill writes nothing into them). The others are the reservation's own.
    int32_t held = 0;
    std::vector<int32_t> draft_blocks;  // the draft's, for the prompt; empty: none asked for
    int32_t prompt_tokens = 0;
    int32_t max_tokens = 0;
    engine::DecodeMember member;  // counted in the batch from its Reserve on
    absl::Duration lease;
    absl::Time expires;
  };
  // Blocks of a reservation that ended undecoded, held until no late write can land in them.
  struct Quarantined {
    std::string request_id;
    std::vector<int32_t> blocks;
    std::vector<int32_t> draft_blocks;  // in the draft's pool
    std::string why;  // "expired at ...", "was cancelled", ...: what a late Decode is told
    absl::Time release;
  };

  DecodeWorker(const DecodeWorkerOptions& o, std::unique_ptr<engine::Engine> engine,
               std::shared_ptr<engine::Proposer> proposer);
  // Queues fn for the engine thread and waits until it ran; UNAVAILABLE after shutdown began.
  absl::Status Call(std::function<void()> fn);
  void Loop();
  // Engine-thread helpers.
  void ReapExpired(absl::Time now);
  // A reservation ends without decoding: its blocks go to quarantine for o_.quarantine.
  void Quarantine(std::string request_id, std::vector<int32_t> blocks, std::string why,
                  std::vector<int32_t> draft_blocks = {});
  void Quarantine(std::string request_id, Reservation&& r, std::string why);
  // The draft blocks of a claimed reservation, when the draft's K/V in them are what prefill
  // computed (its checksums match); empty otherwise, and then they are quarantined.
  std::vector<int32_t> TakeDraftBlocks(const std::string& id, const v1::DecodeRequest& req,
                                       std::vector<int32_t> draft_blocks);
  void ReleaseQuarantine(absl::Time now);
  // The next lease expiry or quarantine release: when the idle engine thread must wake.
  absl::Time NextWake() const;
  void PublishStats();
  void PublishSpecStats();
  absl::StatusOr<v1::ReserveResponse> DoReserve(const v1::ReserveRequest& req);
  // RESOURCE_EXHAUSTED when `joining` would take the batch (running, queued and reserved
  // sequences) past its tightest TPOT target (engine::CheckDecodeTpot).
  absl::Status AdmitByTpot(const std::string& id, const engine::DecodeMember& joining) const;
  absl::Status DoStartDecode(const v1::DecodeRequest& req, std::shared_ptr<TokenStream> stream,
                             absl::Time arrived);
  engine::GenerationRequest MakeRequest(const v1::DecodeRequest& req,
                                        std::shared_ptr<TokenStream> stream,
                                        std::shared_ptr<RequestClock> clock);
  // Metrics helpers (engine thread; only with o_.metrics).
  void RecordEvent(const std::shared_ptr<RequestClock>& clock, const engine::TokenEvent& ev);
  // Requests the last Iterate admitted (it admits first, at `at`) leave queued_.
  void NoteAdmitted(absl::Time at);
  void FreeBlocks(const std::vector<int32_t>& blocks);
  // Gives a reservation's held blocks back to the prefix cache and drops them from r.blocks,
  // leaving the blocks it owns alone (what a quarantine may hold).
  void ReleaseHeld(Reservation& r);
  void FreeDraftBlocks(const std::vector<int32_t>& blocks);

  DecodeWorkerOptions o_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<engine::Scheduler> scheduler_;
  // The scheduler's proposer, kept here for teardown order; draft_ is it as a draft model
  // (null for n-gram or off). The draft's KV pool is a region of its own when prefill sends it.
  std::shared_ptr<engine::Proposer> proposer_;
  engine::DraftModelProposer* draft_ = nullptr;
  std::string draft_region_bytes_;
  uint64_t draft_region_id_ = 0;
  bool draft_region_registered_ = false;
  bool draft_in_transport_memory_ = false;
  int32_t kv_blocks_total_ = 0;
  // accepted_hist as last added to spec_metrics (engine thread only).
  std::vector<int64_t> spec_hist_published_;
  uint64_t invariant_violations_seen_ = 0;  // services::ReportKvInvariants; engine thread
  std::string region_bytes_;  // serialised descriptor of the registered KV pool
  uint64_t region_id_ = 0;
  bool region_registered_ = false;
  bool pool_in_transport_memory_ = false;  // the KV pool lives in transport-allocated memory

  // Engine-thread state.
  absl::flat_hash_map<std::string, Reservation> reservations_;
  // Ids submitted and not yet finished, each as TPOT admission counts it.
  absl::flat_hash_map<std::string, engine::DecodeMember> active_;
  std::deque<Quarantined> quarantine_;             // in release order (the hold is fixed)
  // The colocated requests in the scheduler's queue, in its (FIFO) order, so queue time can be
  // measured without the scheduler reporting admissions: after an Iterate, those beyond
  // num_waiting() at the back were admitted by it. Only kept with o_.metrics.
  std::deque<std::shared_ptr<RequestClock>> queued_;
  absl::Time iterate_start_;  // when the current Iterate began (it admits first)

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> inbox_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Published by the engine thread after every turn, for Stats().
  v1::WorkerStats snapshot_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> integrity_failures_{0};
  services::StepReporter step_report_;
  services::LoopLiveness liveness_;
  std::thread thread_;
};

}  // namespace tandem::decode
