#include "services/decode/decode_worker.h"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <optional>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "common/util/status_util.h"
#include "engine/runtime/draft_proposer.h"
#include "services/common/kv_layout.h"
#include "services/common/kv_pool.h"
#include "services/common/sampling_convert.h"

namespace tandem::decode {
namespace {

// TPOT admission waits for a fit of this many engine steps: before, it admits everything.
constexpr int64_t kTpotMinFittedSteps = 20;

// A request as TPOT admission counts it: its prompt plus, on average over its life, half of
// what it may generate.
engine::DecodeMember MemberOf(int64_t prompt_tokens, int64_t max_tokens, double tpot_target_s) {
  engine::DecodeMember m;
  m.context_tokens = prompt_tokens + std::max<int64_t>(max_tokens, 0) / 2;
  m.tpot_target_s = tpot_target_s;
  return m;
}

// request_success_total's finished_reason for a request's final event.
std::string FinishLabel(const engine::TokenEvent& ev) {
  if (ev.status.code() == absl::StatusCode::kCancelled) return "cancelled";
  if (!ev.status.ok()) return "error";
  switch (ev.reason) {
    case engine::FinishReason::kStop:
      return "stop";
    case engine::FinishReason::kLength:
      return "length";
    case engine::FinishReason::kNone:
      break;
  }
  return "unknown";
}

double Seconds(absl::Duration d) {
  return absl::ToDoubleSeconds(std::max(d, absl::ZeroDuration()));
}

}  // namespace

bool TokenStream::Next(absl::Time deadline, engine::TokenEvent* ev) {
  absl::MutexLock l(&mu_);
  auto has_event = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !events_.empty(); };
  if (!mu_.AwaitWithDeadline(absl::Condition(&has_event), deadline)) return false;
  *ev = std::move(events_.front());
  events_.pop_front();
  return true;
}

void TokenStream::Push(const engine::TokenEvent& ev) {
  absl::MutexLock l(&mu_);
  events_.push_back(ev);
}

absl::StatusOr<std::unique_ptr<DecodeWorker>> DecodeWorker::Create(const DecodeWorkerOptions& o) {
  if (o.model == nullptr) return absl::InvalidArgumentError("decode worker needs a model");
  if (o.default_lease <= absl::ZeroDuration() || o.max_lease < o.default_lease) {
    return absl::InvalidArgumentError("leases: need 0 < default_lease <= max_lease");
  }
  if (o.quarantine < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("quarantine must be >= 0");
  }
  TANDEM_RETURN_IF_ERROR(services::CheckWorkerKvPlacement(o.engine, o.transport));
  // The whole pool is one region, registered once (kv_pool.h).
  TANDEM_ASSIGN_OR_RETURN(services::EngineInRegion e, services::CreateEngineInRegion(o.model, o.engine, o.transport));
  // A draft model (--speculative self:TYPE or draft:PATH) loads here, beside the target. When
  // prefill sends its prompt K/V, its pool is a region of its own, set up as the target's.
  std::optional<transfer::RegionDescriptor> draft_region;
  bool draft_in_transport_memory = false;
  engine::DraftModelProposer::EngineFactory draft_engine;
  if (o.transport != nullptr && o.draft_kv_from_prefill) {
    draft_engine = [&](std::shared_ptr<const engine::Model> m, const engine::EngineOptions& eo)
        -> absl::StatusOr<std::unique_ptr<engine::Engine>> {
      TANDEM_ASSIGN_OR_RETURN(services::EngineInRegion d,
                              services::CreateEngineInRegion(std::move(m), eo, o.transport));
      draft_region = d.region;
      draft_in_transport_memory = d.in_transport_memory;
      return std::move(d.engine);
    };
  }
  absl::StatusOr<std::shared_ptr<engine::Proposer>> proposer =
      engine::MakeSpecProposer(o.speculative, *e.engine, draft_engine);
  if (!proposer.ok()) {
    if (e.region) (void)o.transport->DeregisterRegion(e.region->region_id);
    return proposer.status();
  }
  std::unique_ptr<DecodeWorker> w(new DecodeWorker(o, std::move(e.engine), *proposer));
  if (e.region) {
    w->region_bytes_ = e.region->Serialize();
    w->region_id_ = e.region->region_id;
    w->region_registered_ = true;
    w->pool_in_transport_memory_ = e.in_transport_memory;
  }
  if (draft_region) {
    w->draft_region_bytes_ = draft_region->Serialize();
    w->draft_region_id_ = draft_region->region_id;
    w->draft_region_registered_ = true;
    w->draft_in_transport_memory_ = draft_in_transport_memory;
  }
  if (o.measure_peaks) w->step_report_.MeasurePeaksInBackground(o.engine.threads);
  w->PublishStats();
  w->thread_ = std::thread([p = w.get()] { p->Loop(); });
  return w;
}

DecodeWorker::DecodeWorker(const DecodeWorkerOptions& o, std::unique_ptr<engine::Engine> engine,
                           std::shared_ptr<engine::Proposer> proposer)
    : o_(o),
      engine_(std::move(engine)),
      scheduler_(std::make_unique<engine::Scheduler>(
          engine_.get(), engine::SchedulerOptions{.prefix_cache = o.prefix_cache,
                                                  .speculative = o.speculative,
                                                  .proposer = proposer})),
      proposer_(std::move(proposer)),
      draft_(dynamic_cast<engine::DraftModelProposer*>(proposer_.get())),
      kv_blocks_total_(engine_->kv().pool().num_blocks()),
      step_report_(o.peaks, engine::DeviceName(o.engine.device), o.util_metrics, o.tracer) {}

DecodeWorker::~DecodeWorker() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  // Transport memory is freed by deregistering it: the engine goes first. Our own mapping
  // outlives the registration, so no peer write can land in unmapped memory. The same for the
  // draft's pool, which the proposer's engine owns.
  if (draft_region_registered_ && !draft_in_transport_memory_) {
    (void)o_.transport->DeregisterRegion(draft_region_id_);
  }
  scheduler_.reset();
  draft_ = nullptr;
  proposer_.reset();
  if (draft_region_registered_ && draft_in_transport_memory_) {
    (void)o_.transport->DeregisterRegion(draft_region_id_);
  }
  if (pool_in_transport_memory_) {
    scheduler_.reset();
    engine_.reset();
  }
  if (region_registered_) (void)o_.transport->DeregisterRegion(region_id_);
}

const std::string& DecodeWorker::model_name() const {
  const engine::ModelConfig& c = engine_->model().config();
  return c.name.empty() ? c.arch_name : c.name;
}

absl::Status DecodeWorker::Call(std::function<void()> fn) {
  auto done = std::make_shared<absl::Notification>();
  {
    absl::MutexLock l(&mu_);
    if (stop_) return absl::UnavailableError("decode worker is shutting down");
    inbox_.push_back([this, fn = std::move(fn), done] {
      fn();
      // Callers read Stats() right after; publish what this command changed first.
      PublishStats();
      done->Notify();
    });
  }
  done->WaitForNotification();
  return absl::OkStatus();
}

absl::StatusOr<int32_t> DecodeWorker::DraftBlocksInUse() {
  int32_t used = 0;
  TANDEM_RETURN_IF_ERROR(Call([&] {
    if (draft_ == nullptr) return;
    const engine::BlockPool& pool = draft_->engine().kv().pool();
    used = pool.num_blocks() - pool.num_free();
  }));
  return used;
}

absl::Status DecodeWorker::RunOnEngineThread(std::function<void(engine::Engine&)> fn) {
  return Call([&] { fn(*engine_); });
}

void DecodeWorker::Loop() {
  if (o_.tracer != nullptr) o_.tracer->NameThread("engine");
  bool busy = false;
  for (;;) {
    std::deque<std::function<void()>> cmds;
    bool stopping;
    {
      absl::MutexLock l(&mu_);
      if (!busy) {
        // Idle: sleep until a command arrives, a lease runs out or a quarantine ends.
        liveness_.Idle();
        auto ready = [this]()
                         ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !inbox_.empty(); };
        mu_.AwaitWithDeadline(absl::Condition(&ready), NextWake());
      }
      cmds.swap(inbox_);
      stopping = stop_;
    }
    liveness_.Working();
    for (auto& c : cmds) c();
    if (stopping) break;
    const absl::Time now = absl::Now();
    ReapExpired(now);
    ReleaseQuarantine(now);
    if (o_.before_step && (scheduler_->num_running() > 0 || scheduler_->num_waiting() > 0)) {
      o_.before_step();
    }
    iterate_start_ = absl::Now();
    // For the trace: the step carries the requests running before it and those it admitted.
    std::vector<std::string> stepped;
    if (o_.tracer != nullptr) stepped = scheduler_->RunningIds();
    absl::StatusOr<bool> progressed = scheduler_->Iterate();
    step_report_.Update(*engine_, [&] {
      for (std::string& id : scheduler_->RunningIds()) {
        if (std::find(stepped.begin(), stepped.end(), id) == stepped.end()) {
          stepped.push_back(std::move(id));
        }
      }
      return stepped;
    });
    if (o_.metrics != nullptr) NoteAdmitted(iterate_start_);
    // A failed step already finished the sequences it carried; keep serving the others.
    busy = progressed.ok() ? *progressed : scheduler_->num_running() > 0;
    PublishStats();
  }
  // Shutdown: end every stream and return every block.
  std::vector<std::string> ids;
  for (const auto& [id, unused] : active_) ids.push_back(id);
  for (const std::string& id : ids) scheduler_->Cancel(id);
  // Quarantined blocks too: the pool goes away with the worker, so no later request can be
  // handed one.
  for (auto& [id, r] : reservations_) {
    ReleaseHeld(r);
    FreeBlocks(r.blocks);
    FreeDraftBlocks(r.draft_blocks);
  }
  reservations_.clear();
  for (Quarantined& q : quarantine_) {
    FreeBlocks(q.blocks);
    FreeDraftBlocks(q.draft_blocks);
  }
  quarantine_.clear();
  PublishStats();
}

void DecodeWorker::FreeBlocks(const std::vector<int32_t>& blocks) {
  engine_->kv().pool().UnrefAll(blocks).IgnoreError();
}

void DecodeWorker::ReleaseHeld(Reservation& r) {
  if (r.held == 0) return;
  engine::PrefixCache* cache = scheduler_->prefix_cache();
  // Tail first, as the scheduler hands blocks back, so the LRU keeps a chain's start longest.
  for (int32_t i = r.held - 1; i >= 0; --i) cache->Release(r.blocks[i]);
  r.blocks.erase(r.blocks.begin(), r.blocks.begin() + r.held);
  r.held = 0;
}

void DecodeWorker::FreeDraftBlocks(const std::vector<int32_t>& blocks) {
  if (!blocks.empty()) draft_->engine().kv().pool().UnrefAll(blocks).IgnoreError();
}

void DecodeWorker::ReapExpired(absl::Time now) {
  for (auto it = reservations_.begin(); it != reservations_.end();) {
    if (it->second.expires <= now) {
      // The prefill writing into these blocks may be slow rather than dead.
      Reservation& r = it->second;
      const absl::Time expires = r.expires;
      const absl::Duration lease = r.lease;
      Quarantine(
          it->first, std::move(r),
          absl::StrCat("expired at ", absl::FormatTime(expires, absl::UTCTimeZone()), " (lease ",
                       absl::ToInt64Milliseconds(lease), " ms) before Decode claimed it"));
      reservations_.erase(it++);
    } else {
      ++it;
    }
  }
}

void DecodeWorker::Quarantine(std::string request_id, Reservation&& r, std::string why) {
  ReleaseHeld(r);
  Quarantine(std::move(request_id), std::move(r.blocks), std::move(why),
             std::move(r.draft_blocks));
}

void DecodeWorker::Quarantine(std::string request_id, std::vector<int32_t> blocks,
                              std::string why, std::vector<int32_t> draft_blocks) {
  Quarantined q;
  q.request_id = std::move(request_id);
  q.blocks = std::move(blocks);
  q.draft_blocks = std::move(draft_blocks);
  q.why = std::move(why);
  q.release = absl::Now() + o_.quarantine;
  // A reservation's blocks are its own: shared ones would stay in use through the quarantine.
  engine_->kv().pool().CheckSoleHolder(q.blocks, "a quarantine").IgnoreError();
  quarantine_.push_back(std::move(q));
}

void DecodeWorker::ReleaseQuarantine(absl::Time now) {
  while (!quarantine_.empty() && quarantine_.front().release <= now) {
    // Nothing may have touched a quarantined block: one that gained a reference meanwhile was
    // handed to a sequence (counted as a violation; the release below drops only ours).
    engine_->kv().pool().CheckSoleHolder(quarantine_.front().blocks, "a quarantine").IgnoreError();
    FreeBlocks(quarantine_.front().blocks);
    FreeDraftBlocks(quarantine_.front().draft_blocks);
    quarantine_.pop_front();
  }
}

absl::Time DecodeWorker::NextWake() const {
  absl::Time t = absl::InfiniteFuture();
  for (const auto& [id, r] : reservations_) t = std::min(t, r.expires);
  if (!quarantine_.empty()) t = std::min(t, quarantine_.front().release);
  return t;
}

void DecodeWorker::PublishStats() {
  const engine::BlockPool& pool = engine_->kv().pool();
  absl::MutexLock l(&mu_);
  snapshot_.set_running(scheduler_->num_running());
  snapshot_.set_waiting(scheduler_->num_waiting());
  snapshot_.set_kv_blocks_total(pool.num_blocks());
  // Cached blocks no sequence uses are free for the asking (an allocation reclaims them).
  snapshot_.set_kv_blocks_free(pool.num_available());
  snapshot_.set_reservations(static_cast<int32_t>(reservations_.size()));
  if (o_.metrics != nullptr) {
    services::ServingMetrics& m = *o_.metrics;
    m.num_requests_running.Set(scheduler_->num_running());
    m.num_requests_waiting.Set(scheduler_->num_waiting());
    // Reservations and quarantined blocks count as used: no other request can have them.
    const int32_t total = pool.num_blocks();
    m.kv_cache_usage_perc.Set(total > 0 ? 1.0 - double(pool.num_available()) / total : 0.0);
  }
  if (const engine::PrefixCache* pc = scheduler_->prefix_cache(); pc != nullptr) {
    const engine::PrefixCacheStats ps = pc->stats();
    snapshot_.set_prefix_cache_query_blocks(static_cast<uint64_t>(ps.queries));
    snapshot_.set_prefix_cache_hit_blocks(static_cast<uint64_t>(ps.hits));
    if (o_.metrics != nullptr) {
      services::AdvanceCounterTo(o_.metrics->prefix_cache_queries,
                                 static_cast<double>(ps.queries));
      services::AdvanceCounterTo(o_.metrics->prefix_cache_hits, static_cast<double>(ps.hits));
    }
  }
  services::ReportKvInvariants(absl::StrCat("decode worker ", o_.worker_id), pool,
                               draft_ != nullptr ? &draft_->engine().kv().pool() : nullptr,
                               &invariant_violations_seen_, o_.metrics);
  if (o_.spec_metrics != nullptr) PublishSpecStats();
}

void DecodeWorker::PublishSpecStats() {
  const engine::SchedulerStats& st = scheduler_->stats();
  services::SpecMetrics& sm = *o_.spec_metrics;
  services::AdvanceCounterTo(sm.draft_tokens, static_cast<double>(st.spec_draft_tokens));
  services::AdvanceCounterTo(sm.accepted_tokens, static_cast<double>(st.spec_accepted_tokens));
  // The histogram's buckets are 0, 1, .., 16 and +Inf: verify steps that kept n drafts since
  // the last publish go to bucket n.
  spec_hist_published_.resize(st.accepted_hist.size(), 0);
  std::vector<double> increments(18, 0.0);
  double sum = 0;
  bool any = false;
  for (size_t n = 0; n < st.accepted_hist.size(); ++n) {
    const int64_t d = st.accepted_hist[n] - spec_hist_published_[n];
    if (d <= 0) continue;
    increments[std::min<size_t>(n, 17)] += static_cast<double>(d);
    sum += static_cast<double>(d) * static_cast<double>(n);
    spec_hist_published_[n] = st.accepted_hist[n];
    any = true;
  }
  if (any) sm.acceptance.ObserveMultiple(increments, sum);
}

void DecodeWorker::NoteAdmitted(absl::Time at) {
  while (queued_.size() > static_cast<size_t>(scheduler_->num_waiting())) {
    RequestClock& c = *queued_.front();
    c.queued = false;
    o_.metrics->request_queue_time.Observe(Seconds(at - c.arrived));
    queued_.pop_front();
  }
}

void DecodeWorker::RecordEvent(const std::shared_ptr<RequestClock>& clock,
                               const engine::TokenEvent& ev) {
  services::ServingMetrics& m = *o_.metrics;
  RequestClock& c = *clock;
  const absl::Time now = absl::Now();
  if (c.queued) {
    // Still listed as waiting: a token means this Iterate admitted it (admission comes first);
    // an end without one means it left the queue uncomputed (cancelled).
    if (ev.token >= 0) m.request_queue_time.Observe(Seconds(iterate_start_ - c.arrived));
    c.queued = false;
    std::erase(queued_, clock);
  }
  if (ev.token >= 0) {
    if (c.last_token == absl::InfinitePast()) {
      if (c.measure_ttft) m.time_to_first_token.Observe(Seconds(now - c.arrived));
    } else {
      m.inter_token_latency.Observe(Seconds(now - c.last_token));
    }
    c.last_token = now;
  }
  if (ev.finished) {
    m.e2e_request_latency.Observe(Seconds(now - c.arrived));
    m.RequestSuccess(FinishLabel(ev)).Increment();
  }
}

v1::WorkerStats DecodeWorker::Stats() const {
  v1::WorkerStats s;
  {
    absl::MutexLock l(&mu_);
    s = snapshot_;
  }
  if (o_.transport != nullptr) {
    const transfer::TransportStats ts = o_.transport->stats();
    s.set_transport_bytes_written(ts.bytes_written);
    s.set_transport_bytes_received(ts.bytes_received);
  }
  s.set_kv_integrity_failures(integrity_failures_.load());
  *s.mutable_step_cost() = step_report_.Snapshot();
  return s;
}

absl::StatusOr<v1::ReserveResponse> DecodeWorker::Reserve(const v1::ReserveRequest& req) {
  absl::StatusOr<v1::ReserveResponse> out = absl::InternalError("not run");
  TANDEM_RETURN_IF_ERROR(Call([&] { out = DoReserve(req); }));
  return out;
}

absl::Status DecodeWorker::AdmitByTpot(const std::string& id,
                                       const engine::DecodeMember& joining) const {
  std::vector<engine::DecodeMember> batch;
  batch.reserve(active_.size() + reservations_.size());
  for (const auto& [unused, m] : active_) batch.push_back(m);
  for (const auto& [unused, r] : reservations_) batch.push_back(r.member);
  const engine::TpotCheck check =
      engine::CheckDecodeTpot(engine_->step_cost(), kTpotMinFittedSteps, batch, joining);
  if (check.admit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "request %s: the decode batch of %d sequences with it added is predicted to take %.2f ms "
      "per output token, past the tightest target in it (%.2f ms)",
      id, static_cast<int>(batch.size()) + 1, check.predicted_s * 1e3, check.target_s * 1e3));
}

absl::StatusOr<v1::ReserveResponse> DecodeWorker::DoReserve(const v1::ReserveRequest& req) {
  if (o_.transport == nullptr) {
    return absl::FailedPreconditionError(
        "this decode worker has no KV transport; it serves prefill_locally requests only");
  }
  const std::string& id = req.request_id();
  if (id.empty()) return absl::InvalidArgumentError("request_id is empty");
  if (reservations_.contains(id) || active_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("request ", id, " already exists here"));
  }
  if (req.prompt_tokens() < 1) return absl::InvalidArgumentError("prompt_tokens must be >= 1");
  if (req.max_tokens() < 1) return absl::InvalidArgumentError("max_tokens must be >= 1");
  const int64_t need = int64_t{req.prompt_tokens()} + req.max_tokens();
  if (need > engine_->ctx_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt_tokens + max_tokens = ", need, " exceeds the context size ", engine_->ctx_size()));
  }
  engine::KvCache& kv = engine_->kv();
  const int64_t n = services::BlocksFor(need, kv.block_size());
  if (n > kv.pool().num_blocks()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request needs ", n, " KV blocks; the whole pool holds ", kv.pool().num_blocks()));
  }
  if (!(req.tpot_target_s() >= 0)) {
    return absl::InvalidArgumentError("tpot_target_s must be >= 0");
  }
  if (req.prompt_token_ids_size() > 0 && req.prompt_token_ids_size() != req.prompt_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_token_ids has ",
                                                   req.prompt_token_ids_size(),
                                                   " tokens; prompt_tokens says ",
                                                   req.prompt_tokens()));
  }
  const engine::DecodeMember member = MemberOf(req.prompt_tokens(), req.max_tokens(),
                                               req.tpot_target_s());
  TANDEM_RETURN_IF_ERROR(AdmitByTpot(id, member));
  // The leading blocks an earlier sequence left in the cache, never the last prompt token's:
  // prefill computes that token (its logits give the first token) and writes its block.
  Reservation r;
  engine::PrefixCache* cache = scheduler_->prefix_cache();
  int32_t usable = 0;
  if (cache != nullptr && req.prompt_token_ids_size() > 0) {
    const std::span<const int32_t> prompt(req.prompt_token_ids().data(),
                                          static_cast<size_t>(req.prompt_token_ids_size()));
    const std::vector<uint64_t> hashes =
        engine::ComputeBlockHashes(prompt, kv.block_size(), req.salt());
    usable = static_cast<int32_t>(
        std::min<int64_t>(hashes.size(), (req.prompt_tokens() - 1) / kv.block_size()));
    r.blocks = cache->Acquire(std::span<const uint64_t>(hashes).first(usable));
    r.held = static_cast<int32_t>(r.blocks.size());
  }
  absl::StatusOr<std::vector<int32_t>> blocks =
      kv.pool().AllocateN(static_cast<int32_t>(n - r.held));
  if (!blocks.ok()) {
    ReleaseHeld(r);
    return absl::ResourceExhaustedError(absl::StrCat("request needs ", n, " KV blocks; ",
                                                     kv.pool().num_available(),
                                                     " are free right now"));
  }
  if (cache != nullptr && usable > 0) cache->RecordLookup(usable, r.held);
  r.blocks.insert(r.blocks.end(), blocks->begin(), blocks->end());
  absl::Duration lease = req.lease_ms() > 0 ? absl::Milliseconds(req.lease_ms()) : o_.default_lease;
  lease = std::min(lease, o_.max_lease);
  r.prompt_tokens = req.prompt_tokens();
  r.max_tokens = req.max_tokens();
  r.member = member;
  r.lease = lease;
  r.expires = absl::Now() + lease;

  v1::ReserveResponse resp;
  v1::KvDestination* dst = resp.mutable_destination();
  dst->set_decode_worker(o_.worker_id);
  dst->set_region(region_bytes_);
  const int64_t prompt_blocks = services::BlocksFor(req.prompt_tokens(), kv.block_size());
  for (int64_t i = 0; i < prompt_blocks; ++i) dst->add_block_ids(r.blocks[i]);
  dst->set_held_blocks(r.held);
  services::FillKvLayout(kv, dst);
  dst->set_speculative(engine::SpecHandshake(o_.speculative));
  if (draft_region_registered_) {
    // The draft's prompt K/V come with the target's when its pool has room for them now;
    // otherwise the draft computes them here (the output is the same either way).
    engine::KvCache& dkv = draft_->engine().kv();
    const int64_t n_draft = services::BlocksFor(req.prompt_tokens(), dkv.block_size());
    absl::StatusOr<std::vector<int32_t>> db = dkv.pool().AllocateN(static_cast<int32_t>(n_draft));
    if (db.ok()) {
      r.draft_blocks = std::move(*db);
      v1::KvDestination* dd = dst->mutable_draft();
      dd->set_decode_worker(o_.worker_id);
      dd->set_region(draft_region_bytes_);
      dd->mutable_block_ids()->Add(r.draft_blocks.begin(), r.draft_blocks.end());
      services::FillKvLayout(dkv, dd);
      dd->set_speculative(dst->speculative());
    }
  }
  resp.set_lease_expires_unix_ms(static_cast<uint64_t>(absl::ToUnixMillis(r.expires)));
  dst->set_lease_expires_unix_ms(resp.lease_expires_unix_ms());
  reservations_.emplace(id, std::move(r));
  return resp;
}

engine::GenerationRequest DecodeWorker::MakeRequest(const v1::DecodeRequest& req,
                                                    std::shared_ptr<TokenStream> stream,
                                                    std::shared_ptr<RequestClock> clock) {
  engine::GenerationRequest g;
  g.id = req.request_id();
  g.prompt.assign(req.prompt_token_ids().begin(), req.prompt_token_ids().end());
  g.sampling = services::SamplingFromProto(req.sampling());
  g.salt = req.salt();
  if (req.has_first_token_logprobs()) {
    g.first_token_logprobs = services::LogprobsFromProto(req.first_token_logprobs());
  }
  // Runs on the engine thread (inside Submit*, Iterate or Cancel).
  g.on_event = [this, stream = std::move(stream), id = g.id,
                clock = std::move(clock)](const engine::TokenEvent& ev) {
    if (o_.metrics != nullptr) RecordEvent(clock, ev);
    if (ev.finished) active_.erase(id);
    stream->Push(ev);
  };
  return g;
}

absl::StatusOr<std::shared_ptr<TokenStream>> DecodeWorker::StartDecode(
    const v1::DecodeRequest& req) {
  auto stream = std::make_shared<TokenStream>();
  absl::Status st = absl::InternalError("not run");
  const absl::Time arrived = absl::Now();
  TANDEM_RETURN_IF_ERROR(Call([&] { st = DoStartDecode(req, stream, arrived); }));
  TANDEM_RETURN_IF_ERROR(st);
  return stream;
}

absl::Status DecodeWorker::DoStartDecode(const v1::DecodeRequest& req,
                                         std::shared_ptr<TokenStream> stream, absl::Time arrived) {
  const std::string& id = req.request_id();
  if (id.empty()) return absl::InvalidArgumentError("request_id is empty");
  if (active_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("request ", id, " is already decoding here"));
  }
  if (req.prefill_locally()) {
    // Colocated: the scheduler prefills the prompt itself, batched with the running decodes.
    if (reservations_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("request ", id, " holds a reservation"));
    }
    if (!(req.tpot_target_s() >= 0)) {
      return absl::InvalidArgumentError("tpot_target_s must be >= 0");
    }
    const engine::DecodeMember member =
        MemberOf(req.prompt_token_ids_size(), req.sampling().max_tokens(), req.tpot_target_s());
    TANDEM_RETURN_IF_ERROR(AdmitByTpot(id, member));
    active_[id] = member;
    auto clock = std::make_shared<RequestClock>();
    clock->arrived = arrived;
    clock->measure_ttft = true;
    absl::Status st = scheduler_->Submit(MakeRequest(req, std::move(stream), clock));
    if (!st.ok()) {
      active_.erase(id);
    } else if (o_.metrics != nullptr) {
      clock->queued = true;
      queued_.push_back(std::move(clock));
    }
    return st;
  }

  auto it = reservations_.find(id);
  if (it == reservations_.end()) {
    // A late completion: refuse it without reading or touching the quarantined blocks.
    for (auto q = quarantine_.rbegin(); q != quarantine_.rend(); ++q) {
      if (q->request_id != id) continue;
      return absl::NotFoundError(absl::StrCat(
          "the KV reservation for request ", id, " ", q->why,
          "; its blocks are quarantined against late writes and will not be decoded from "
          "(reserve again)"));
    }
    return absl::NotFoundError(
        absl::StrCat("no KV reservation for request ", id,
                     " (never made, already claimed, or its lease ran out)"));
  }
  Reservation r = std::move(it->second);
  reservations_.erase(it);
  engine::KvCache& kv = engine_->kv();
  const int64_t prompt = req.prompt_token_ids_size();
  // A refused claim quarantines the blocks: whoever sent it may not have stopped writing.
  if (prompt != r.prompt_tokens) {
    Quarantine(id, std::move(r), "was refused (prompt length mismatch)");
    return absl::InvalidArgumentError(
        absl::StrCat("prompt has ", prompt, " tokens; the reservation was for ", r.prompt_tokens));
  }
  // Checksums cover the blocks prefill wrote: those after the held ones.
  const int64_t written = services::BlocksFor(prompt, kv.block_size()) - r.held;
  if (req.block_checksums_size() != written) {
    Quarantine(id, std::move(r), "was refused (wrong number of block checksums)");
    return absl::InvalidArgumentError(absl::StrCat(
        "got ", req.block_checksums_size(), " block checksums; prefill wrote ", written,
        " blocks (the prompt's after the ", r.held, " this worker held)"));
  }
  // Verify before admitting: a sequence must never decode from KV that is not what prefill
  // computed (a torn or misdirected transfer, a reused block, memory corruption).
  // (On the device for a GPU pool, by the same algorithm prefill used, kv_layout.h.)
  const int64_t held_tokens = int64_t{r.held} * kv.block_size();
  absl::StatusOr<std::vector<uint64_t>> computed = services::PoolChecksums(
      kv, std::span<const int32_t>(r.blocks).subspan(r.held), prompt - held_tokens);
  if (!computed.ok()) {
    Quarantine(id, std::move(r), "was refused (its KV could not be checksummed)");
    return computed.status();
  }
  const std::vector<uint64_t>& sums = *computed;
  for (int64_t i = 0; i < written; ++i) {
    if (sums[i] != req.block_checksums(static_cast<int>(i))) {
      integrity_failures_.fetch_add(1);
      if (o_.metrics != nullptr) o_.metrics->kv_integrity_failures.Increment();
      const std::string msg = absl::StrFormat(
          "request %s: KV block %d (pool block %d) has checksum %016x, prefill sent %016x; "
          "the transferred KV is corrupt",
          id, r.held + i, r.blocks[r.held + i], sums[i],
          req.block_checksums(static_cast<int>(i)));
      Quarantine(id, std::move(r), "was refused (KV checksum mismatch)");
      return absl::DataLossError(msg);
    }
  }
  // Registered before submitting: the first event may already finish the request.
  active_[id] = r.member;
  auto clock = std::make_shared<RequestClock>();
  clock->arrived = arrived;
  std::vector<int32_t> draft_blocks = TakeDraftBlocks(id, req, std::move(r.draft_blocks));
  absl::Status st = scheduler_->SubmitPrefilled(MakeRequest(req, std::move(stream), clock),
                                                r.blocks, req.first_token_id(), draft_blocks);
  if (!st.ok()) {
    active_.erase(id);
    // Validation failed before the scheduler took the blocks.
    ReleaseHeld(r);
    Quarantine(id, std::move(r.blocks), absl::StrCat("was refused (", st.message(), ")"),
               std::move(draft_blocks));
  } else if (o_.metrics != nullptr) {
    // Admitted at once: the prefill already ran and the blocks are reserved.
    o_.metrics->request_queue_time.Observe(Seconds(absl::Now() - arrived));
    if (req.kv_transfer_bytes() > 0) {
      o_.metrics->kv_transfer_bytes.Observe(static_cast<double>(req.kv_transfer_bytes()));
      o_.metrics->kv_transfer_seconds.Observe(std::max(req.kv_transfer_seconds(), 0.0));
    }
  }
  return st;
}

std::vector<int32_t> DecodeWorker::TakeDraftBlocks(const std::string& id,
                                                   const v1::DecodeRequest& req,
                                                   std::vector<int32_t> draft_blocks) {
  if (draft_blocks.empty()) return {};
  const int64_t prompt = req.prompt_token_ids_size();
  const char* why = nullptr;
  if (req.draft_block_checksums_size() == 0) {
    why = "were not sent";  // the prefill had no draft blocks free: the draft computes them
  } else if (req.draft_block_checksums_size() != static_cast<int>(draft_blocks.size())) {
    why = "came with the wrong number of checksums";
  } else {
    absl::StatusOr<std::vector<uint64_t>> sums =
        services::PoolChecksums(draft_->engine().kv(), draft_blocks, prompt);
    if (!sums.ok()) {
      why = "could not be checksummed";
    } else {
      for (size_t i = 0; i < sums->size(); ++i) {
        if ((*sums)[i] == req.draft_block_checksums(static_cast<int>(i))) continue;
        integrity_failures_.fetch_add(1);
        if (o_.metrics != nullptr) o_.metrics->kv_integrity_failures.Increment();
        std::fprintf(stderr,
                     "request %s: draft KV block %zu has checksum %016lx, prefill sent %016lx; "
                     "the draft computes its prompt K/V itself\n",
                     id.c_str(), i, static_cast<unsigned long>((*sums)[i]),
                     static_cast<unsigned long>(req.draft_block_checksums(static_cast<int>(i))));
        why = "failed their checksum";
        break;
      }
    }
  }
  if (why == nullptr) return draft_blocks;
  // Not used, and whoever wrote them may not have stopped: held back like a refused claim.
  Quarantine(/*request_id=*/"", {}, absl::StrCat("draft blocks ", why), std::move(draft_blocks));
  return {};
}

bool DecodeWorker::Cancel(const std::string& request_id) {
  bool found = false;
  absl::Status st = Call([&] {
    auto it = reservations_.find(request_id);
    if (it != reservations_.end()) {
      // The prefill may still be writing (the router cancels both sides at once).
      Quarantine(request_id, std::move(it->second), "was cancelled before Decode claimed it");
      reservations_.erase(it);
      found = true;
    }
    if (active_.contains(request_id)) {
      found = true;
      scheduler_->Cancel(request_id);
    }
  });
  return st.ok() && found;
}

}  // namespace tandem::decode
