#include "services/prefill/prefill_worker.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"
#include "engine/kv/block_pool.h"
#include "engine/runtime/draft_proposer.h"
#include "engine/sampling/constraint.h"
#include "engine/sampling/sampler.h"
#include "services/common/grpc_status.h"
#include "services/common/kv_layout.h"
#include "services/common/kv_pool.h"
#include "services/common/sampling_convert.h"

namespace tandem::prefill {
namespace {

// Whether `dst` can take the K/V of `blocks` blocks in `kv`'s layout: the same shape, a region
// that parses, enough block ids, none negative, and every byte inside the region. `what` names
// the destination in errors.
absl::Status CheckDestination(const v1::KvDestination& dst, const engine::KvCache& kv,
                              int64_t blocks, const std::string& what,
                              transfer::RegionDescriptor* region) {
  TANDEM_RETURN_IF_ERROR(services::CheckSameKvShape(dst, kv));
  absl::StatusOr<transfer::RegionDescriptor> r =
      transfer::RegionDescriptor::Parse(std::string_view(dst.region()));
  if (!r.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " region: ", r.status().message()));
  }
  if (dst.block_ids_size() < blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", dst.block_ids_size(), " blocks; the prompt fills ", blocks));
  }
  // Every byte this request writes must fall inside the destination region; catching it here
  // gives the caller a clear answer before any compute is spent.
  int64_t max_block = 0;
  for (int64_t i = 0; i < blocks; ++i) {
    const int32_t b = dst.block_ids(static_cast<int>(i));
    if (b < 0) return absl::InvalidArgumentError(absl::StrCat("block id ", b, " is negative"));
    max_block = std::max<int64_t>(max_block, b);
  }
  const uint64_t end = (uint64_t(dst.num_layers()) - 1) * dst.layer_stride() + dst.kv_stride() +
                       uint64_t(max_block + 1) * dst.block_bytes();
  if (end > r->length) {
    return absl::InvalidArgumentError(absl::StrCat(what, " block ", max_block,
                                                   " lies outside the ", r->length,
                                                   "-byte region"));
  }
  *region = std::move(*r);
  return absl::OkStatus();
}

}  // namespace

// Where one model's K/V of a request go: the target's, or the draft's.
struct PrefillWorker::KvSend {
  std::vector<int32_t> dst_blocks;
  transfer::RegionDescriptor region;
  uint64_t layer_stride = 0;
  uint64_t kv_stride = 0;
  std::vector<int32_t> local_blocks;  // engine thread only
};

struct PrefillWorker::Job {
  // Fixed once queued.
  std::string id;
  std::vector<int32_t> prompt;
  engine::SamplingParams sampling;
  std::vector<int32_t> dst_blocks;
  int32_t held_blocks = 0;  // leading blocks decode already holds: not written
  transfer::RegionDescriptor region;
  uint64_t layer_stride = 0;
  uint64_t kv_stride = 0;
  absl::Time deadline;
  std::chrono::steady_clock::time_point write_deadline;
  absl::Time arrived;  // when Prefill was called
  uint64_t salt = 0;
  std::vector<uint64_t> hashes;  // chained hashes of the prompt's full blocks
  int32_t usable = 0;            // leading blocks that may be reused (never the last token's)
  int32_t store_matched = 0;     // leading blocks the kvstore said it holds
  std::vector<int> store_tiers;  // v1::KvTier of each of them
  double lookup_seconds = 0;

  std::atomic<bool> cancelled{false};

  // The draft's prompt K/V, sent when the destination asks and this worker has a draft.
  bool with_draft = false;  // cleared by the engine thread when the draft cannot run
  KvSend draft;

  // Engine thread only.
  std::vector<int32_t> local_blocks;
  int64_t n_done = 0;
  int64_t draft_done = 0;  // prompt positions whose draft K/V are computed
  std::vector<uint64_t> draft_checksums;
  double draft_seconds = 0;
  absl::Time compute_start;
  absl::Time compute_end;
  int32_t first_token = -1;
  std::optional<engine::TokenLogprobs> first_logprobs;  // sampling.logprobs >= 0
  std::vector<uint64_t> checksums;
  absl::Status compute_status;
  int32_t local_cached_blocks = 0;  // reused from the own prefix cache
  int32_t kvstore_blocks = 0;       // read from the kvstore
  double onboard_seconds = 0;
  std::string onboard_tier;
  int32_t published_blocks = 0;

  // Shared by the engine thread (posting writes) and the transport's callbacks.
  absl::Mutex mu;
  int64_t writes_in_flight ABSL_GUARDED_BY(mu) = 0;
  bool compute_over ABSL_GUARDED_BY(mu) = false;  // no more writes will be posted
  absl::Status write_status ABSL_GUARDED_BY(mu);
  uint64_t bytes ABSL_GUARDED_BY(mu) = 0;
  absl::Time first_write ABSL_GUARDED_BY(mu);  // for the trace
  absl::Time writes_done ABSL_GUARDED_BY(mu);

  // The outcome, set once.
  absl::Mutex result_mu;
  bool done ABSL_GUARDED_BY(result_mu) = false;
  absl::StatusOr<v1::PrefillResponse> result ABSL_GUARDED_BY(result_mu) =
      absl::InternalError("not finished");
};

absl::StatusOr<std::unique_ptr<PrefillWorker>> PrefillWorker::Create(
    const PrefillWorkerOptions& o) {
  if (o.model == nullptr) return absl::InvalidArgumentError("prefill worker needs a model");
  if (o.transport == nullptr) return absl::InvalidArgumentError("prefill worker needs a transport");
  TANDEM_RETURN_IF_ERROR(services::CheckWorkerKvPlacement(o.engine, o.transport));
  // With a kvstore the local pool is a registered region (the store writes onboarded blocks
  // into it): transport-allocated memory where the transport offers it, as decode does.
  const bool with_store = !o.kvstore.address.empty();
  const bool device_pool = o.engine.device != engine::Device::kCpu;
  transfer::KvTransport* store_t =
      o.kvstore_transport != nullptr ? o.kvstore_transport : o.transport;
  // A host pool is itself the region the store writes into; a GPU pool is not (the store's
  // transport serves host memory): onboarding goes through pinned staging then.
  TANDEM_ASSIGN_OR_RETURN(services::EngineInRegion e,
                          services::CreateEngineInRegion(
                              o.model, o.engine, with_store && !device_pool ? store_t : nullptr));
  // A draft model's prompt K/V are computed here when decode asks for them.
  std::shared_ptr<const engine::Model> draft;
  if (o.draft_kv) {
    TANDEM_ASSIGN_OR_RETURN(draft, engine::LoadDraftModel(o.speculative, *e.engine));
  }
  std::unique_ptr<engine::Engine> draft_engine;
  if (draft != nullptr) {
    TANDEM_ASSIGN_OR_RETURN(draft_engine,
                            engine::Engine::Create(draft, engine::DraftEngineOptions(*e.engine)));
  }
  std::unique_ptr<PrefillWorker> w(new PrefillWorker(o, std::move(e.engine)));
  w->draft_engine_ = std::move(draft_engine);
  w->store_transport_ = store_t;
  if (e.region) {
    w->region_bytes_ = e.region->Serialize();
    w->region_id_ = e.region->region_id;
    w->region_registered_ = true;
    w->pool_in_transport_memory_ = e.in_transport_memory;
  }
  if (with_store && device_pool) {
    const engine::KvCache& kv = w->engine_->kv();
    // Room for one sequence's longest prefix: a Read never asks for more.
    w->staging_blocks_ =
        static_cast<int32_t>(services::BlocksFor(w->engine_->ctx_size(), kv.block_size()));
    const uint64_t bytes =
        2 * uint64_t(kv.options().num_layers) * kv.block_bytes() * uint64_t(w->staging_blocks_);
    TANDEM_ASSIGN_OR_RETURN(w->onboard_staging_, services::KvStaging::Create(bytes));
    TANDEM_ASSIGN_OR_RETURN(w->publish_staging_, services::KvStaging::Create(0));
    TANDEM_ASSIGN_OR_RETURN(transfer::RegionDescriptor d,
                            store_t->RegisterRegion(w->onboard_staging_->data(), bytes));
    w->region_bytes_ = d.Serialize();
    w->region_id_ = d.region_id;
    w->region_registered_ = true;
  }
  if (with_store) {
    TANDEM_ASSIGN_OR_RETURN(w->kvstore_, KvStoreClient::Create(o.kvstore, store_t));
  }
  if (o.measure_peaks) w->step_report_.MeasurePeaksInBackground(o.engine.threads);
  w->PublishStats();
  w->thread_ = std::thread([p = w.get()] { p->Loop(); });
  return w;
}

PrefillWorker::PrefillWorker(const PrefillWorkerOptions& o, std::unique_ptr<engine::Engine> engine)
    : o_(o),
      engine_(std::move(engine)),
      kv_blocks_total_(engine_->kv().pool().num_blocks()),
      step_report_(o.peaks, engine::DeviceName(o.engine.device), o.util_metrics, o.tracer) {
  const transfer::Capabilities caps = o_.transport->capabilities();
  transport_name_ = caps.detail.empty() ? caps.name : absl::StrCat(caps.name, ":", caps.detail);
  if (o_.prefix_cache) cache_ = std::make_unique<engine::PrefixCache>(&engine_->kv().pool());
}

PrefillWorker::~PrefillWorker() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
    cv_.Signal();
  }
  if (thread_.joinable()) thread_.join();
  kvstore_.reset();
  cache_.reset();
  quarantine_.clear();
  if (region_registered_ && !pool_in_transport_memory_) {
    (void)store_transport_->DeregisterRegion(region_id_);
  }
  engine_.reset();
  // Transport-allocated pool memory is freed by the deregistration, after the engine is gone.
  if (region_registered_ && pool_in_transport_memory_) {
    (void)store_transport_->DeregisterRegion(region_id_);
  }
}

const std::string& PrefillWorker::model_name() const {
  const engine::ModelConfig& c = engine_->model().config();
  return c.name.empty() ? c.arch_name : c.name;
}

absl::StatusOr<std::shared_ptr<PrefillWorker::Job>> PrefillWorker::MakeJob(
    const v1::PrefillRequest& req, absl::Time deadline) const {
  const engine::KvCache& kv = engine_->kv();
  const int32_t vocab = engine_->model().config().n_vocab;
  if (req.request_id().empty()) return absl::InvalidArgumentError("request_id is empty");
  const int64_t n = req.prompt_token_ids_size();
  if (n == 0) return absl::InvalidArgumentError("prompt is empty");
  if (n >= engine_->ctx_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt has ", n, " tokens; the context holds ", engine_->ctx_size()));
  }
  for (int32_t t : req.prompt_token_ids()) {
    if (t < 0 || t >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt token id ", t, " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  auto job = std::make_shared<Job>();
  job->sampling = services::SamplingFromProto(req.sampling());
  TANDEM_RETURN_IF_ERROR(engine::ValidateSamplingParams(job->sampling, vocab));
  // A constraint compiles (cached) here, before any work, and the sampler that draws the
  // first token is the one the decode side would make.
  TANDEM_RETURN_IF_ERROR(engine::MakeSampler(
                             job->sampling, engine_->model().tokenizer(),
                             std::span<const int32_t>(req.prompt_token_ids().data(),
                                                      static_cast<size_t>(n)))
                             .status());

  const v1::KvDestination& dst = req.destination();
  // The reserve handshake: what decode speculates with must be what this worker prepares for.
  const std::string ours = engine::SpecHandshake(o_.speculative);
  const std::string theirs = dst.speculative().empty() ? "off" : dst.speculative();
  if (theirs != ours) {
    return absl::FailedPreconditionError(absl::StrCat(
        "speculative configuration differs: prefill worker ", o_.worker_id, " runs --speculative ",
        ours, ", decode worker ", dst.decode_worker(), " runs --speculative ", theirs,
        "; start both pools with the same setting"));
  }
  const int64_t blocks = services::BlocksFor(n, kv.block_size());
  TANDEM_RETURN_IF_ERROR(CheckDestination(dst, kv, blocks, "KV destination", &job->region));
  if (blocks > kv.pool().num_blocks()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt needs ", blocks, " KV blocks; this worker's pool holds ", kv.pool().num_blocks()));
  }
  // A worker started with --draft-kv decode has no draft: decode then computes its K/V.
  if (dst.has_draft() && draft_engine_ != nullptr) {
    const engine::KvCache& dkv = draft_engine_->kv();
    const v1::KvDestination& dd = dst.draft();
    const int64_t draft_blocks = services::BlocksFor(n, dkv.block_size());
    TANDEM_RETURN_IF_ERROR(
        CheckDestination(dd, dkv, draft_blocks, "draft KV destination", &job->draft.region));
    job->with_draft = true;
    job->draft.dst_blocks.assign(dd.block_ids().begin(), dd.block_ids().begin() + draft_blocks);
    job->draft.layer_stride = dd.layer_stride();
    job->draft.kv_stride = dd.kv_stride();
  }
  job->id = req.request_id();
  job->prompt.assign(req.prompt_token_ids().begin(), req.prompt_token_ids().end());
  job->salt = req.salt();
  if (cache_ != nullptr || kvstore_ != nullptr) {
    job->hashes = engine::ComputeBlockHashes(job->prompt, kv.block_size(), job->salt);
    // The last prompt token is always computed: its logits give the first token.
    job->usable = static_cast<int32_t>(
        std::min<int64_t>(job->hashes.size(), (n - 1) / kv.block_size()));
  }
  if (dst.held_blocks() < 0 || dst.held_blocks() >= blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV destination holds ", dst.held_blocks(), " of the prompt's ", blocks,
        " blocks; it must hold fewer (the last prompt token's block is always written)"));
  }
  job->held_blocks = dst.held_blocks();
  job->dst_blocks.assign(dst.block_ids().begin(), dst.block_ids().begin() + blocks);
  job->layer_stride = dst.layer_stride();
  job->kv_stride = dst.kv_stride();
  job->deadline = deadline;
  absl::Duration left =
      std::min(o_.max_transfer_time, std::max(deadline - absl::Now(), absl::ZeroDuration()));
  if (dst.lease_expires_unix_ms() > 0) {
    // No write may land after the reservation's lease: decode then quarantines the blocks and
    // will hand them to another request.
    const absl::Duration lease_left =
        absl::FromUnixMillis(static_cast<int64_t>(dst.lease_expires_unix_ms())) - absl::Now();
    if (lease_left <= absl::ZeroDuration()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the KV reservation for request ", req.request_id(), " on ", dst.decode_worker(),
          " expired before prefill started"));
    }
    left = std::min(left, lease_left);
  }
  job->write_deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(left);
  return job;
}

absl::StatusOr<v1::PrefillResponse> PrefillWorker::Prefill(
    const v1::PrefillRequest& req, absl::Time deadline, const std::function<bool()>& caller_gone) {
  const absl::Time arrived = absl::Now();
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, MakeJob(req, deadline));
  job->arrived = arrived;
  if (kvstore_ != nullptr && job->usable > 0) {
    // On the caller's thread, so a slow or dead store never holds up the engine thread. Any
    // error is a miss: the request runs cold.
    const absl::Time t0 = absl::Now();
    trace::Span span(o_.tracer, "kvstore Lookup", "rpc", job->id);
    absl::StatusOr<v1::KvLookupResponse> m =
        kvstore_->Lookup(std::span<const uint64_t>(job->hashes).first(job->usable));
    if (m.ok()) span.Arg("matched", m->matched());
    job->lookup_seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    if (m.ok()) {
      job->store_matched = std::min(m->matched(), job->usable);
      for (int i = 0; i < job->store_matched && i < m->tiers_size(); ++i) {
        job->store_tiers.push_back(m->tiers(i));
      }
      job->store_matched = static_cast<int32_t>(job->store_tiers.size());
    }
  }
  {
    absl::MutexLock l(&mu_);
    if (stop_) return absl::UnavailableError("prefill worker is shutting down");
    if (!by_id_.emplace(job->id, job).second) {
      return absl::AlreadyExistsError(absl::StrCat("request ", job->id, " is already in flight"));
    }
    pending_.push_back(job);
    cv_.Signal();
  }
  for (;;) {
    {
      absl::MutexLock l(&job->result_mu);
      auto done = [j = job.get()] {
        j->result_mu.AssertHeld();  // Await calls it under result_mu
        return j->done;
      };
      if (job->result_mu.AwaitWithDeadline(absl::Condition(&done),
                                           std::min(deadline, absl::Now() + o_.poll))) {
        return job->result;
      }
    }
    const bool gone = caller_gone && caller_gone();
    if (gone || absl::Now() >= deadline) {
      // The engine thread frees the request's blocks once no write reads them any more.
      job->cancelled.store(true);
      {
        absl::MutexLock l(&mu_);
        wake_ = true;
        cv_.Signal();
      }
      if (gone) return absl::CancelledError("prefill cancelled: the caller went away");
      return absl::DeadlineExceededError("prefill did not finish before the deadline");
    }
  }
}

bool PrefillWorker::Cancel(const std::string& request_id) {
  absl::MutexLock l(&mu_);
  auto it = by_id_.find(request_id);
  if (it == by_id_.end()) return false;
  it->second->cancelled.store(true);
  wake_ = true;
  cv_.Signal();
  return true;
}

v1::WorkerStats PrefillWorker::Stats() const {
  v1::WorkerStats s;
  {
    absl::MutexLock l(&mu_);
    s = snapshot_;
  }
  const transfer::TransportStats ts = o_.transport->stats();
  s.set_transport_bytes_written(ts.bytes_written);
  s.set_transport_bytes_received(ts.bytes_received);
  *s.mutable_step_cost() = step_report_.Snapshot();
  if (kvstore_ != nullptr) {
    const KvStoreClientStats ks = kvstore_->stats();
    s.set_kvstore_published_blocks(ks.published_blocks);
    s.set_kvstore_publish_dropped(ks.dropped_blocks);
  }
  return s;
}

bool PrefillWorker::WaitForPublishing(absl::Duration timeout) {
  return kvstore_ == nullptr || kvstore_->WaitIdle(timeout);
}

void PrefillWorker::PublishStats() {
  const engine::BlockPool& pool = engine_->kv().pool();
  if (draft_engine_ != nullptr) {
    const engine::BlockPool& dp = draft_engine_->kv().pool();
    draft_blocks_in_use_.store(dp.num_blocks() - dp.num_free());
  }
  absl::MutexLock l(&mu_);
  snapshot_.set_running(static_cast<int32_t>(active_.size()));
  snapshot_.set_waiting(static_cast<int32_t>(queue_.size() + pending_.size()));
  snapshot_.set_kv_blocks_total(pool.num_blocks());
  // Cached blocks nobody uses are free for allocation (the cache gives them back on demand).
  snapshot_.set_kv_blocks_free(pool.num_available());
  snapshot_.set_prefix_cache_query_blocks(query_blocks_);
  snapshot_.set_prefix_cache_hit_blocks(hit_blocks_);
  if (o_.metrics != nullptr) {
    services::ServingMetrics& m = *o_.metrics;
    m.num_requests_running.Set(snapshot_.running());
    m.num_requests_waiting.Set(snapshot_.waiting());
    const int32_t total = pool.num_blocks();
    m.kv_cache_usage_perc.Set(total > 0 ? 1.0 - double(pool.num_available()) / total : 0.0);
  }
  services::ReportKvInvariants(absl::StrCat("prefill worker ", o_.worker_id), pool,
                               draft_engine_ != nullptr ? &draft_engine_->kv().pool() : nullptr,
                               &invariant_violations_seen_, o_.metrics);
}

void PrefillWorker::Loop() {
  if (o_.tracer != nullptr) o_.tracer->NameThread("engine");
  bool computing = false;
  bool stop_seen = false;
  for (;;) {
    std::vector<std::shared_ptr<Job>> ready;
    bool stopping;
    {
      absl::MutexLock l(&mu_);
      // Sleep unless there is compute to do, a request that may be admitted, drained writes to
      // finish, a cancel to look at, or shutdown to begin or complete. While shutting down,
      // requests whose writes are in flight are waited for, not polled.
      auto must_act = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (!ready_.empty() || wake_ || !pending_.empty() || computing) return true;
        if (!queue_.empty() && (!admit_blocked_ || stop_)) return true;
        return stop_ && (!stop_seen || (queue_.empty() && active_.empty()));
      };
      if (!must_act()) liveness_.Idle();
      while (!must_act()) {
        if (quarantine_.empty()) {
          cv_.Wait(&mu_);
        } else if (cv_.WaitWithTimeout(&mu_, absl::Milliseconds(100))) {
          break;  // quarantined blocks may be due: a blocked admission may now fit
        }
      }
      liveness_.Working();
      wake_ = false;
      stopping = stop_;
      while (!pending_.empty()) {
        queue_.push_back(std::move(pending_.front()));
        pending_.pop_front();
      }
      ready.swap(ready_);
    }
    for (auto& j : ready) Finalize(j);
    if (!quarantine_.empty()) {
      ReleaseQuarantine(false);
      admit_blocked_ = false;
    }
    stop_seen = stopping;
    shutting_down_ = stopping;
    if (stopping) {
      for (auto& j : queue_) j->cancelled.store(true);
      for (auto& j : active_) j->cancelled.store(true);
    }
    // Cancelled or expired requests that hold no blocks end here.
    const absl::Time now = absl::Now();
    for (auto it = queue_.begin(); it != queue_.end();) {
      Job& j = **it;
      if (j.cancelled.load() || now >= j.deadline) {
        Complete(j, stopping             ? absl::UnavailableError("prefill worker is shutting down")
                    : j.cancelled.load() ? absl::CancelledError("prefill cancelled")
                                         : absl::DeadlineExceededError("deadline passed"));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    // Running requests that were cancelled stop computing; their blocks free once their
    // writes drain.
    const std::vector<std::shared_ptr<Job>> running = active_;
    for (const std::shared_ptr<Job>& j : running) {
      const int64_t n = static_cast<int64_t>(j->prompt.size());
      if ((j->n_done < n || (j->with_draft && j->draft_done < n)) && j->compute_status.ok() &&
          j->cancelled.load()) {
        EndCompute(j, absl::CancelledError("prefill cancelled"));
      }
    }
    if (stopping && queue_.empty() && active_.empty()) break;
    if (!stopping) Admit();
    computing = ComputeStep();
    step_report_.Update(*engine_, [this] {
      std::vector<std::string> ids;
      for (const std::shared_ptr<Job>& j : active_) ids.push_back(j->id);
      return ids;
    });
    PublishStats();
  }
  PublishStats();
}

void PrefillWorker::Admit() {
  engine::BlockPool& pool = engine_->kv().pool();
  admit_blocked_ = false;
  while (!queue_.empty()) {
    Job& j = *queue_.front();
    const int64_t n =
        services::BlocksFor(static_cast<int64_t>(j.prompt.size()), engine_->kv().block_size());
    std::vector<int32_t> reused;
    if (cache_ != nullptr && j.usable > 0) {
      reused = cache_->Acquire(std::span<const uint64_t>(j.hashes).first(j.usable));
    }
    absl::StatusOr<std::vector<int32_t>> blocks =
        pool.AllocateN(static_cast<int32_t>(n - static_cast<int64_t>(reused.size())));
    if (!blocks.ok()) {
      for (auto it = reused.rbegin(); it != reused.rend(); ++it) cache_->Release(*it);
      admit_blocked_ = true;  // FIFO: the head waits for blocks to free up
      return;
    }
    j.local_cached_blocks = static_cast<int32_t>(reused.size());
    j.local_blocks = std::move(reused);
    j.local_blocks.insert(j.local_blocks.end(), blocks->begin(), blocks->end());
    if (j.local_cached_blocks > 0) j.onboard_tier = "local";
    const absl::Time onboard_start = absl::Now();
    Onboard(j, j.usable);
    if (!j.compute_status.ok()) {  // no blocks to replace those a failed read may still get
      std::shared_ptr<Job> keep = std::move(queue_.front());
      queue_.pop_front();
      Complete(*keep, keep->compute_status);
      continue;
    }
    if (j.with_draft) {
      // No room in the draft's pool now: the draft's K/V are not sent, and decode computes them.
      absl::StatusOr<std::vector<int32_t>> d = draft_engine_->kv().pool().AllocateN(
          static_cast<int32_t>(j.draft.dst_blocks.size()));
      if (d.ok()) {
        j.draft.local_blocks = std::move(*d);
      } else {
        j.with_draft = false;
      }
    }
    const int32_t onboarded = j.local_cached_blocks + j.kvstore_blocks;
    if (j.usable > 0) {
      query_blocks_ += j.usable;
      hit_blocks_ += onboarded;
      if (cache_ != nullptr) cache_->RecordLookup(j.usable, onboarded);
      if (o_.metrics != nullptr) {
        o_.metrics->prefix_cache_queries.Increment(j.usable);
        o_.metrics->prefix_cache_hits.Increment(onboarded);
      }
    }
    if (j.kvstore_blocks > 0 || j.store_matched > 0) {
      j.onboard_seconds = j.lookup_seconds + absl::ToDoubleSeconds(absl::Now() - onboard_start);
    }
    j.n_done = int64_t{onboarded} * engine_->kv().block_size();
    j.compute_start = absl::Now();
    if (o_.metrics != nullptr) {
      o_.metrics->request_queue_time.Observe(
          absl::ToDoubleSeconds(std::max(j.compute_start - j.arrived, absl::ZeroDuration())));
    }
    std::shared_ptr<Job> job = std::move(queue_.front());
    queue_.pop_front();
    active_.push_back(job);
    // The onboarded prefix goes to decode like computed KV: every layer of it, now.
    if (job->n_done > 0) {
      for (int32_t l = 0; l < engine_->model().config().n_layer; ++l) {
        PostLayerWrites(job, /*draft=*/false, 0, job->n_done, l);
      }
    }
  }
}

void PrefillWorker::Onboard(Job& j, int32_t usable) {
  const int32_t from = static_cast<int32_t>(j.local_cached_blocks);
  const int32_t to = std::min(j.store_matched, usable);
  if (kvstore_ == nullptr || !region_registered_ || to <= from) return;
  trace::Span span(o_.tracer, "onboard", "kv", j.id);
  span.Arg("blocks", to - from);
  if (onboard_staging_ != nullptr) {
    OnboardThroughStaging(j, from, std::min(to, from + staging_blocks_));
    return;
  }
  engine::KvCache& kv = engine_->kv();
  v1::KvReadRequest req;
  req.mutable_block_hashes()->Add(j.hashes.begin() + from, j.hashes.begin() + to);
  req.mutable_block_ids()->Add(j.local_blocks.begin() + from, j.local_blocks.begin() + to);
  v1::KvRegionLayout* d = req.mutable_destination();
  d->set_region(region_bytes_);
  d->set_num_layers(engine_->model().config().n_layer);
  d->set_layer_stride(2 * kv.layer_bytes());
  d->set_kv_stride(kv.layer_bytes());
  d->set_segment_bytes(kv.block_bytes());
  absl::StatusOr<v1::KvReadResponse> r = kvstore_->Read(req);
  if (!r.ok()) {
    // The store may still write into these blocks (a timed-out call's writes are bounded by its
    // deadline, not stopped): keep them out of use for a while and compute into fresh ones.
    absl::StatusOr<std::vector<int32_t>> fresh = kv.pool().AllocateN(to - from);
    std::vector<int32_t> held(j.local_blocks.begin() + from, j.local_blocks.begin() + to);
    quarantine_.push_back(
        {absl::Now() + kvstore_->options().read_timeout + o_.read_quarantine, std::move(held)});
    if (!fresh.ok()) {
      // Drop them from the job (they are quarantined) and give back the rest.
      j.local_blocks.erase(j.local_blocks.begin() + from, j.local_blocks.begin() + to);
      ReleaseBlocks(j, /*cache_them=*/false);
      j.compute_status = absl::ResourceExhaustedError(absl::StrCat(
          "kvstore read failed (", r.status().message(),
          ") and no free KV blocks are left to compute the prefix instead"));
      return;
    }
    std::copy(fresh->begin(), fresh->end(), j.local_blocks.begin() + from);
    return;
  }
  // Only blocks whose bytes here match the store's checksum are used; the rest is computed.
  int32_t good = 0;
  int worst = 0;
  for (int i = 0; i < r->read() && i < r->checksums_size() && from + i < to; ++i) {
    const int32_t b = j.local_blocks[from + i];
    if (services::BlockChecksum(kv, b, kv.block_size()) != r->checksums(i)) break;
    if (i < r->tiers_size()) worst = std::max(worst, static_cast<int>(r->tiers(i)));
    ++good;
  }
  j.kvstore_blocks = good;
  if (good > 0) {
    j.onboard_tier = worst == v1::KV_TIER_SSD    ? "ssd"
                     : worst == v1::KV_TIER_HOST ? "host"
                                                 : "device";
  }
}

void PrefillWorker::OnboardThroughStaging(Job& j, int32_t from, int32_t to) {
  // The store may still be writing into the staging after a failed Read: leave it alone until
  // that Read's deadline and the quarantine have passed (the prefix is computed meanwhile).
  if (to <= from || absl::Now() < staging_quarantined_until_) return;
  engine::KvCache& kv = engine_->kv();
  const int32_t n = to - from;
  const uint64_t seg = kv.block_bytes();
  const uint64_t kv_stride = uint64_t(staging_blocks_) * seg;
  v1::KvReadRequest req;
  req.mutable_block_hashes()->Add(j.hashes.begin() + from, j.hashes.begin() + to);
  for (int32_t i = 0; i < n; ++i) req.add_block_ids(i);  // staging blocks 0..n-1
  v1::KvRegionLayout* d = req.mutable_destination();
  d->set_region(region_bytes_);
  d->set_num_layers(engine_->model().config().n_layer);
  d->set_layer_stride(2 * kv_stride);
  d->set_kv_stride(kv_stride);
  d->set_segment_bytes(seg);
  absl::StatusOr<v1::KvReadResponse> r = kvstore_->Read(req);
  if (!r.ok()) {
    staging_quarantined_until_ =
        absl::Now() + kvstore_->options().read_timeout + o_.read_quarantine;
    return;  // the local blocks were not touched: compute the prefix into them
  }
  // Verified on the host, in the staging, before anything reaches the device pool.
  services::KvBufferLayout b;
  b.base = onboard_staging_->data();
  b.layer_stride = 2 * kv_stride;
  b.kv_stride = kv_stride;
  b.num_layers = kv.options().num_layers;
  b.block_bytes = seg;
  b.slot_bytes = kv.slot_bytes();
  int32_t good = 0;
  int worst = 0;
  for (int i = 0; i < r->read() && i < r->checksums_size() && i < n; ++i) {
    if (services::RawBlockChecksum(b, i, kv.block_size()) != r->checksums(i)) break;
    if (i < r->tiers_size()) worst = std::max(worst, static_cast<int>(r->tiers(i)));
    ++good;
  }
  std::vector<services::KvHostCopy> copies;
  copies.reserve(2 * size_t(good) * b.num_layers);
  for (int32_t i = 0; i < good; ++i) {
    const uint64_t at = uint64_t(j.local_blocks[from + i]) * seg;
    for (int32_t l = 0; l < b.num_layers; ++l) {
      uint8_t* k = onboard_staging_->data() + l * b.layer_stride + uint64_t(i) * seg;
      copies.push_back({uint64_t(kv.k_layer(l) - kv.k_layer(0)) + at, k, seg});
      copies.push_back({uint64_t(kv.v_layer(l) - kv.k_layer(0)) + at, k + kv_stride, seg});
    }
  }
  if (absl::Status st = onboard_staging_->FromHost(kv, copies); !st.ok()) {
    std::fprintf(stderr,
                 "request %s: onboarding %d kvstore blocks to the device failed, "
                 "computing them: %s\n",
                 j.id.c_str(), good, st.ToString().c_str());
    return;
  }
  j.kvstore_blocks = good;
  if (good > 0) {
    j.onboard_tier = worst == v1::KV_TIER_SSD    ? "ssd"
                     : worst == v1::KV_TIER_HOST ? "host"
                                                 : "device";
  }
}

void PrefillWorker::QueuePublish(const Job& j) {
  if (kvstore_ == nullptr) return;
  const int32_t from = j.store_matched;
  const int32_t to = static_cast<int32_t>(j.hashes.size());
  if (to <= from) return;
  const engine::KvCache& kv = engine_->kv();
  const int32_t layers = engine_->model().config().n_layer;
  const uint64_t seg = kv.block_bytes();
  PublishBatch b;
  b.block_bytes = 2 * uint64_t(layers) * seg;
  b.bytes.resize(b.block_bytes * (to - from));
  if (kv.on_device()) {
    // Device to host through pinned staging, in the batch's layout, then into the batch.
    const uint64_t total = b.bytes.size();
    std::vector<services::KvHostCopy> copies;
    absl::Status st = publish_staging_ == nullptr
                          ? absl::FailedPreconditionError("no publish staging")
                          : publish_staging_->Reserve(total);
    if (st.ok()) {
      uint8_t* out = publish_staging_->data();
      for (int32_t i = from; i < to; ++i) {
        const uint64_t at = uint64_t(j.local_blocks[i]) * seg;
        for (int32_t l = 0; l < layers; ++l) {
          copies.push_back({uint64_t(kv.k_layer(l) - kv.k_layer(0)) + at, out, seg});
          copies.push_back({uint64_t(kv.v_layer(l) - kv.k_layer(0)) + at, out + seg, seg});
          out += 2 * seg;
        }
      }
      st = publish_staging_->ToHost(kv, copies);
    }
    if (!st.ok()) {
      std::fprintf(stderr, "request %s: not publishing to the kvstore: %s\n", j.id.c_str(),
                   st.ToString().c_str());
      return;
    }
    std::memcpy(b.bytes.data(), publish_staging_->data(), total);
  } else {
    uint8_t* out = b.bytes.data();
    for (int32_t i = from; i < to; ++i) {
      const uint64_t at = uint64_t(j.local_blocks[i]) * seg;
      for (int32_t l = 0; l < layers; ++l) {
        std::memcpy(out, kv.k_layer(l) + at, seg);
        std::memcpy(out + seg, kv.v_layer(l) + at, seg);
        out += 2 * seg;
      }
    }
  }
  for (int32_t i = from; i < to; ++i) {
    b.hashes.push_back(j.hashes[i]);
    b.checksums.push_back(j.checksums[i]);
  }
  if (kvstore_->Publish(std::move(b))) published_blocks_ += to - from;
}

void PrefillWorker::ReleaseBlocks(Job& j, bool cache_them) {
  if (!j.draft.local_blocks.empty()) {
    draft_engine_->kv().pool().UnrefAll(j.draft.local_blocks).IgnoreError();
    j.draft.local_blocks.clear();
  }
  if (cache_ == nullptr) {
    engine_->kv().pool().UnrefAll(j.local_blocks).IgnoreError();
  } else {
    // Tail first, so the cache's LRU evicts a chain's last blocks before its first ones.
    for (int64_t i = static_cast<int64_t>(j.local_blocks.size()) - 1; i >= 0; --i) {
      if (cache_them && i < static_cast<int64_t>(j.hashes.size())) {
        cache_->Insert(j.hashes[i], j.local_blocks[i]);
      } else {
        cache_->Release(j.local_blocks[i]);
      }
    }
  }
  j.local_blocks.clear();
}

void PrefillWorker::ReleaseQuarantine(bool all) {
  const absl::Time now = absl::Now();
  for (auto it = quarantine_.begin(); it != quarantine_.end();) {
    if (all || it->until <= now) {
      engine_->kv().pool().UnrefAll(it->blocks).IgnoreError();
      it = quarantine_.erase(it);
    } else {
      ++it;
    }
  }
}

bool PrefillWorker::ComputeStep() {
  // The draft's chunks run in the same turn as the target's, in a step of their own.
  const bool drafted = draft_engine_ != nullptr && DraftStep();
  const int64_t budget = engine_->options().max_batch_tokens;
  std::vector<engine::SeqChunk> chunks;
  std::vector<std::shared_ptr<Job>> jobs;
  int64_t used = 0;
  // A copy: EndCompute may finish (and unlist) a request.
  const std::vector<std::shared_ptr<Job>> candidates = active_;
  for (const std::shared_ptr<Job>& j : candidates) {
    if (used >= budget) break;
    const int64_t left = static_cast<int64_t>(j->prompt.size()) - j->n_done;
    if (left <= 0 || !j->compute_status.ok() || EndIfDestinationGone(j)) continue;
    const int64_t n = std::min(left, budget - used);
    engine::SeqChunk ch;
    ch.tokens = std::span<const int32_t>(j->prompt).subspan(j->n_done, n);
    ch.start_pos = static_cast<int32_t>(j->n_done);
    ch.block_table = j->local_blocks;
    ch.want_logits = j->n_done + n == static_cast<int64_t>(j->prompt.size());
    chunks.push_back(ch);
    jobs.push_back(j);
    used += n;
  }
  if (chunks.empty()) return drafted;
  if (o_.before_step) o_.before_step();

  absl::Status st = engine_->Step(chunks, &logits_, [&](int32_t layer) {
    for (size_t i = 0; i < chunks.size(); ++i) {
      PostLayerWrites(jobs[i], /*draft=*/false, chunks[i].start_pos,
                      static_cast<int64_t>(chunks[i].tokens.size()), layer);
    }
  });
  if (!st.ok()) {
    for (auto& j : jobs) EndCompute(j, st);
    return true;
  }
  const int32_t vocab = engine_->model().config().n_vocab;
  int64_t out = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    Job& j = *jobs[i];
    j.n_done += static_cast<int64_t>(chunks[i].tokens.size());
    if (!chunks[i].want_logits) continue;
    std::span<float> lg(logits_.data() + out * vocab, vocab);
    ++out;
    // The same sampler, seed and history the decode side (and a single-process run) uses.
    absl::StatusOr<std::unique_ptr<engine::Sampler>> sampler =
        engine::MakeSampler(j.sampling, engine_->model().tokenizer(), j.prompt);
    if (!sampler.ok()) {  // checked at arrival; a compiled constraint is cached
      EndCompute(jobs[i], sampler.status());
      continue;
    }
    j.first_token = (*sampler)->Sample(lg, j.prompt);
    if (const engine::TokenLogprobs* l = (*sampler)->logprobs()) j.first_logprobs = *l;
    j.compute_end = absl::Now();
    // The local copy no longer changes: checksum it while the last writes are in flight.
    // On the device for a GPU pool (the kernel and the CPU agree bit for bit, kv_layout.h).
    absl::StatusOr<std::vector<uint64_t>> sums = services::PoolChecksums(
        engine_->kv(), j.local_blocks, static_cast<int64_t>(j.prompt.size()));
    if (!sums.ok()) {
      EndCompute(jobs[i], sums.status());
      continue;
    }
    j.checksums = std::move(*sums);
    j.published_blocks = 0;
    const uint64_t before = published_blocks_;
    QueuePublish(j);
    j.published_blocks = static_cast<int32_t>(published_blocks_ - before);
    // With the draft's K/V still to compute, DraftStep ends the compute.
    if (!j.with_draft || j.draft_done >= static_cast<int64_t>(j.prompt.size())) {
      EndCompute(jobs[i], absl::OkStatus());
    }
  }
  return true;
}

bool PrefillWorker::DraftStep() {
  const int64_t budget = draft_engine_->options().max_batch_tokens;
  std::vector<engine::SeqChunk> chunks;
  std::vector<std::shared_ptr<Job>> jobs;
  int64_t used = 0;
  const std::vector<std::shared_ptr<Job>> candidates = active_;
  for (const std::shared_ptr<Job>& j : candidates) {
    if (used >= budget) break;
    const int64_t left = static_cast<int64_t>(j->prompt.size()) - j->draft_done;
    if (!j->with_draft || left <= 0 || !j->compute_status.ok() || EndIfDestinationGone(j)) {
      continue;
    }
    const int64_t n = std::min(left, budget - used);
    engine::SeqChunk ch;
    ch.tokens = std::span<const int32_t>(j->prompt).subspan(j->draft_done, n);
    ch.start_pos = static_cast<int32_t>(j->draft_done);
    ch.block_table = j->draft.local_blocks;
    chunks.push_back(ch);
    jobs.push_back(j);
    used += n;
  }
  if (chunks.empty()) return false;
  const absl::Time t0 = absl::Now();
  absl::Status st = draft_engine_->Step(chunks, &draft_logits_, [&](int32_t layer) {
    for (size_t i = 0; i < chunks.size(); ++i) {
      PostLayerWrites(jobs[i], /*draft=*/true, chunks[i].start_pos,
                      static_cast<int64_t>(chunks[i].tokens.size()), layer);
    }
  });
  const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  for (size_t i = 0; i < chunks.size(); ++i) {
    Job& j = *jobs[i];
    const int64_t n = static_cast<int64_t>(j.prompt.size());
    j.draft_seconds += seconds;
    if (!st.ok()) {
      // The target's K/V are unaffected: send them without the draft's, which decode computes.
      std::fprintf(stderr, "request %s: the draft's prefill failed, decode computes it: %s\n",
                   j.id.c_str(), st.ToString().c_str());
      j.with_draft = false;
    } else {
      j.draft_done += static_cast<int64_t>(chunks[i].tokens.size());
      if (j.draft_done < n) continue;
      absl::StatusOr<std::vector<uint64_t>> sums =
          services::PoolChecksums(draft_engine_->kv(), j.draft.local_blocks, n);
      if (sums.ok()) {
        j.draft_checksums = std::move(*sums);
      } else {
        j.with_draft = false;
      }
    }
    // The target finished first: the compute ends with the draft's.
    if (j.first_token >= 0 && j.n_done >= n) {
      j.compute_end = std::max(j.compute_end, absl::Now());
      EndCompute(jobs[i], absl::OkStatus());
    }
  }
  return true;
}

void PrefillWorker::PostLayerWrites(const std::shared_ptr<Job>& keep, bool draft, int64_t start,
                                    int64_t n, int32_t layer) {
  Job& job = *keep;
  engine::KvCache& kv = draft ? draft_engine_->kv() : engine_->kv();
  const std::vector<int32_t>& local_blocks = draft ? job.draft.local_blocks : job.local_blocks;
  const std::vector<int32_t>& dst_blocks = draft ? job.draft.dst_blocks : job.dst_blocks;
  const uint64_t layer_stride = draft ? job.draft.layer_stride : job.layer_stride;
  const uint64_t kv_stride = draft ? job.draft.kv_stride : job.kv_stride;
  const int64_t bs = kv.block_size();
  if (!draft) {
    // The blocks decode holds already have these K/V: nothing goes into them.
    const int64_t held = int64_t{job.held_blocks} * bs;
    if (start + n <= held) return;
    if (start < held) {
      n -= held - start;
      start = held;
    }
  }
  const uint64_t block_bytes = kv.block_bytes();
  const uint64_t slot_bytes = kv.slot_bytes();  // quantised slots carry their scales
  const uint8_t* k = kv.k_layer(layer);
  const uint8_t* v = kv.v_layer(layer);
  std::vector<transfer::WriteOp> ops;
  for (int64_t pos = start; pos < start + n;) {
    const int64_t bi = pos / bs;
    const int64_t s0 = pos - bi * bs;
    const int64_t s1 = std::min(bs, start + n - bi * bs);
    const uint64_t len = uint64_t(s1 - s0) * slot_bytes;
    const uint64_t local = uint64_t(local_blocks[bi]) * block_bytes + s0 * slot_bytes;
    const uint64_t remote = uint64_t(layer) * layer_stride +
                            uint64_t(dst_blocks[bi]) * block_bytes + s0 * slot_bytes;
    ops.push_back({k + local, len, remote});
    ops.push_back({v + local, len, remote + kv_stride});
    pos = bi * bs + s1;
  }
  uint64_t bytes = 0;
  for (const auto& op : ops) bytes += op.length;
  if (std::chrono::steady_clock::now() >= job.write_deadline) {
    // Past the deadline or the reservation's lease: these blocks may no longer be ours.
    absl::MutexLock l(&job.mu);
    if (job.write_status.ok()) {
      job.write_status = absl::DeadlineExceededError(
          "KV write deadline (request deadline or the reservation's lease) passed; no more "
          "writes into the decode worker's blocks");
    }
    return;
  }
  {
    absl::MutexLock l(&job.mu);
    if (job.first_write == absl::Time()) job.first_write = absl::Now();
    ++job.writes_in_flight;
  }
  // The callback may run inline or on the transport's thread; it holds the job alive.
  o_.transport->WriteAsync(draft ? job.draft.region : job.region, std::move(ops),
                           job.write_deadline,
                           [this, keep, bytes](absl::Status s) {
                             bool ready = false;
                             {
                               absl::MutexLock l(&keep->mu);
                               if (s.ok()) {
                                 keep->bytes += bytes;
                               } else if (keep->write_status.ok()) {
                                 keep->write_status = std::move(s);
                               }
                               ready = --keep->writes_in_flight == 0 && keep->compute_over;
                               if (ready) keep->writes_done = absl::Now();
                             }
                             if (ready) PostReady(keep);
                           });
}

bool PrefillWorker::EndIfDestinationGone(const std::shared_ptr<Job>& job) {
  absl::Status write_status;
  {
    absl::MutexLock l(&job->mu);
    write_status = job->write_status;
  }
  if (write_status.ok()) return false;
  EndCompute(job, write_status);  // stop spending compute on a destination that is gone
  return true;
}

void PrefillWorker::PostReady(std::shared_ptr<Job> job) {
  absl::MutexLock l(&mu_);
  ready_.push_back(std::move(job));
  cv_.Signal();
}

void PrefillWorker::EndCompute(const std::shared_ptr<Job>& job, absl::Status status) {
  job->compute_status = std::move(status);
  job->n_done = static_cast<int64_t>(job->prompt.size());  // nothing more to compute
  job->draft_done = job->n_done;
  bool drained;
  {
    absl::MutexLock l(&job->mu);
    job->compute_over = true;
    drained = job->writes_in_flight == 0;
    if (drained) job->writes_done = absl::Now();
  }
  if (drained) Finalize(job);
}

void PrefillWorker::Finalize(const std::shared_ptr<Job>& job) {
  // Blocks of a prompt computed in full (or onboarded and verified) enter the prefix cache.
  const bool computed = job->compute_status.ok() && job->first_token >= 0;
  ReleaseBlocks(*job, computed && !job->cancelled.load());
  std::erase(active_, job);
  absl::Status write_status;
  uint64_t bytes;
  absl::Time first_write, writes_done;
  {
    absl::MutexLock l(&job->mu);
    write_status = job->write_status;
    bytes = job->bytes;
    first_write = job->first_write;
    writes_done = job->writes_done;
  }
  if (o_.tracer != nullptr) {
    // On tracks of their own per request: other requests' compute and transfers interleave.
    const absl::Time never;
    auto us = [](absl::Time t) { return absl::ToUnixMicros(t); };
    if (job->compute_start != never) {
      o_.tracer->Async("queued", "prefill", job->id, us(job->arrived), us(job->compute_start));
      if (job->compute_end != never) {
        o_.tracer->Async("compute", "prefill", job->id, us(job->compute_start),
                         us(job->compute_end),
                         {{"prompt_tokens", job->prompt.size()},
                          {"cached_tokens", (job->local_cached_blocks + job->kvstore_blocks) *
                                                engine_->kv().block_size()}});
      }
    }
    if (first_write != never) {
      o_.tracer->Async("kv_transfer", "kv", job->id, us(first_write), us(writes_done),
                       {{"bytes", bytes},
                        {"transport", transport_name_},
                        {"status", write_status.ToString()}});
    }
  }
  if (job->cancelled.load()) {
    Complete(*job, shutting_down_ ? absl::UnavailableError("prefill worker is shutting down")
                                  : absl::CancelledError("prefill cancelled"));
  } else if (!job->compute_status.ok()) {
    Complete(*job, job->compute_status);
  } else if (!write_status.ok()) {
    const absl::Status failed(
        write_status.code(),
        absl::StrCat("KV transfer to the decode worker failed: ", write_status.message()));
    Complete(*job, services::MarkDestinationFault(failed));
  } else {
    v1::PrefillResponse r;
    r.set_first_token_id(job->first_token);
    if (job->first_logprobs) {
      *r.mutable_first_token_logprobs() = services::LogprobsToProto(*job->first_logprobs);
    }
    // Of the blocks written: those after the ones decode holds.
    for (size_t i = static_cast<size_t>(job->held_blocks); i < job->checksums.size(); ++i) {
      r.add_block_checksums(job->checksums[i]);
    }
    r.set_bytes_transferred(bytes);
    r.set_compute_seconds(absl::ToDoubleSeconds(job->compute_end - job->compute_start));
    r.set_transfer_seconds(
        absl::ToDoubleSeconds(std::max(writes_done - job->compute_end, absl::ZeroDuration())));
    r.set_transport(transport_name_);
    const int32_t bs = engine_->kv().block_size();
    r.set_local_cached_tokens(job->local_cached_blocks * bs);
    r.set_kvstore_tokens(job->kvstore_blocks * bs);
    r.set_onboarded_tokens((job->local_cached_blocks + job->kvstore_blocks) * bs);
    r.set_onboard_seconds(job->onboard_seconds);
    r.set_onboard_tier(job->onboard_tier);
    r.set_published_blocks(job->published_blocks);
    if (job->with_draft && !job->draft_checksums.empty()) {
      for (uint64_t c : job->draft_checksums) r.add_draft_block_checksums(c);
      r.set_draft_compute_seconds(job->draft_seconds);
    }
    if (cache_ != nullptr) {
      for (uint64_t h : job->hashes) r.add_cached_block_hashes(h);
    }
    if (o_.metrics != nullptr) {
      o_.metrics->kv_transfer_bytes.Observe(static_cast<double>(bytes));
      o_.metrics->kv_transfer_seconds.Observe(r.transfer_seconds());
    }
    Complete(*job, std::move(r));
  }
}

void PrefillWorker::Complete(Job& job, absl::StatusOr<v1::PrefillResponse> result) {
  // Callers read Stats() right after their answer: publish what freeing this request changed.
  PublishStats();
  if (o_.metrics != nullptr) {
    o_.metrics->e2e_request_latency.Observe(
        absl::ToDoubleSeconds(std::max(absl::Now() - job.arrived, absl::ZeroDuration())));
  }
  {
    absl::MutexLock l(&mu_);
    auto it = by_id_.find(job.id);
    if (it != by_id_.end() && it->second.get() == &job) by_id_.erase(it);
  }
  absl::MutexLock l(&job.result_mu);
  job.result = std::move(result);
  job.done = true;
}

}  // namespace tandem::prefill
