#include "engine/runtime/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/util/status_util.h"
#include "engine/sampling/constraint.h"

namespace tandem::engine {

struct Scheduler::Sequence {
  GenerationRequest req;
  std::vector<int32_t> tokens;  // prompt then generated
  int64_t n_cached = 0;         // positions whose K/V are in the cache
  std::vector<int32_t> blocks;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StopChecker> stop;
  std::unique_ptr<StreamingDecoder> decoder;
  // With speculation: the acceptance tracker, and while a verify chunk is in flight its tokens
  // (the pending token, then the drafts).
  std::unique_ptr<DraftLength> draft_len;
  std::vector<int32_t> verify;
  std::vector<int32_t> proposed;
  SpecUsage spec;
  uint64_t key = 0;  // names the sequence to the proposer
  bool done = false;
};

Scheduler::Scheduler(Engine* engine, SchedulerOptions options)
    : engine_(engine), options_(options) {
  if (options_.prefix_cache) cache_ = std::make_unique<PrefixCache>(&engine_->kv().pool());
  proposer_ = options_.proposer;
  if (proposer_ == nullptr) proposer_ = MakeProposer(options_.speculative);
  if (proposer_ != nullptr) {
    options_.speculative.draft_cost = proposer_->draft_cost();
    options_.speculative.prior_acceptance = proposer_->prior_acceptance();
    cost_ = std::make_unique<SpecCostModel>(options_.speculative);
    stats_.accepted_hist.assign(std::max(0, options_.speculative.max_draft) + 1, 0);
  }
}

Scheduler::~Scheduler() {
  for (auto& s : running_) Release(*s, /*keep=*/false);
}

absl::Status Scheduler::Validate(const GenerationRequest& req) const {
  const int32_t vocab = engine_->model().config().n_vocab;
  if (req.prompt.empty()) {
    return absl::InvalidArgumentError("prompt is empty (and the model adds no BOS token)");
  }
  for (int32_t t : req.prompt) {
    if (t < 0 || t >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt token id ", t, " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  TANDEM_RETURN_IF_ERROR(ValidateSamplingParams(req.sampling, vocab));
  // A constraint compiles (cached) and the output it already covers must follow it.
  TANDEM_RETURN_IF_ERROR(
      MakeSampler(req.sampling, engine_->model().tokenizer(), req.prompt).status());
  const int64_t ctx = engine_->ctx_size();
  const int64_t need = static_cast<int64_t>(req.prompt.size()) + req.sampling.max_tokens;
  if (static_cast<int64_t>(req.prompt.size()) >= ctx) {
    return absl::InvalidArgumentError(absl::StrCat("prompt has ", req.prompt.size(),
                                                   " tokens; the context holds ", ctx));
  }
  if (need > ctx) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt (", req.prompt.size(), " tokens) plus max_tokens (", req.sampling.max_tokens,
        ") exceeds the context size ", ctx));
  }
  const int64_t bs = engine_->kv().block_size();
  if ((need + bs - 1) / bs > engine_->kv().pool().num_blocks()) {
    return absl::InvalidArgumentError("request needs more KV blocks than the whole pool holds");
  }
  return absl::OkStatus();
}

std::unique_ptr<Scheduler::Sequence> Scheduler::NewSequence(GenerationRequest req) {
  const Tokenizer& tok = engine_->model().tokenizer();
  auto s = std::make_unique<Sequence>();
  s->tokens = req.prompt;
  // Validate made one already: this cannot fail.
  s->sampler = std::move(*MakeSampler(req.sampling, tok, req.prompt));
  s->stop = std::make_unique<StopChecker>(req.sampling);
  // A completion continues prompt text already shown, so its first token keeps its leading
  // space; after a bare BOS the stream starts fresh and the space goes (as llama2.c prints).
  const bool continuation = std::any_of(req.prompt.begin(), req.prompt.end(),
                                        [&](int32_t t) { return t != tok.bos_id(); });
  s->decoder = std::make_unique<StreamingDecoder>(tok, /*special=*/false, continuation);
  s->key = next_key_++;
  // A constrained sequence does not speculate: drafts would each need the grammar's state.
  if (proposer_ != nullptr && req.sampling.speculative &&
      req.sampling.constraint.kind == Constraint::Kind::kNone) {
    s->draft_len = std::make_unique<DraftLength>(options_.speculative);
  }
  s->req = std::move(req);
  return s;
}

absl::Status Scheduler::Submit(GenerationRequest req) {
  TANDEM_RETURN_IF_ERROR(Validate(req));
  waiting_.push_back(NewSequence(std::move(req)));
  return absl::OkStatus();
}

absl::Status Scheduler::SubmitPrefilled(GenerationRequest req, std::vector<int32_t> blocks,
                                        int32_t first_token, std::vector<int32_t> draft_blocks) {
  TANDEM_RETURN_IF_ERROR(Validate(req));
  if (!draft_blocks.empty() && proposer_ == nullptr) {
    return absl::InvalidArgumentError("draft K/V blocks given, but this scheduler has no proposer");
  }
  const int64_t bs = engine_->kv().block_size();
  const int64_t need = static_cast<int64_t>(req.prompt.size()) + req.sampling.max_tokens;
  if (static_cast<int64_t>(blocks.size()) < (need + bs - 1) / bs) {
    return absl::InvalidArgumentError(absl::StrCat("prefilled request holds ", blocks.size(),
                                                   " blocks; it needs ", (need + bs - 1) / bs));
  }
  if (first_token < 0 || first_token >= engine_->model().config().n_vocab) {
    return absl::InvalidArgumentError(absl::StrCat("first token id ", first_token,
                                                   " is outside the vocabulary"));
  }
  std::unique_ptr<Sequence> s = NewSequence(std::move(req));
  TANDEM_RETURN_IF_ERROR(s->sampler->Observe(first_token));
  s->blocks = std::move(blocks);
  s->n_cached = static_cast<int64_t>(s->tokens.size());
  // Before the first token is emitted: if it ends the sequence, Release hands them back.
  if (!draft_blocks.empty()) proposer_->Adopt(s->key, s->tokens, std::move(draft_blocks));
  s->sampler->SkipSamples(1);
  s->tokens.push_back(first_token);
  ++stats_.generated_tokens;
  Emit(*s, first_token,
       s->req.sampling.logprobs >= 0 && s->req.first_token_logprobs
           ? &*s->req.first_token_logprobs
           : nullptr);
  if (!s->done) running_.push_back(std::move(s));
  return absl::OkStatus();
}

void Scheduler::Release(Sequence& s, bool keep) {
  s.done = true;
  if (proposer_ != nullptr) proposer_->Forget(s.key);
  if (cache_ == nullptr) {
    engine_->kv().pool().UnrefAll(s.blocks).IgnoreError();
    s.blocks.clear();
    return;
  }
  // Only positions below n_cached hold K/V (the last sampled token was never fed back).
  const int64_t bs = engine_->kv().block_size();
  const int64_t full = keep ? s.n_cached / bs : 0;
  const std::vector<uint64_t> hashes = ComputeBlockHashes(
      std::span<const int32_t>(s.tokens).first(full * bs), static_cast<int32_t>(bs), s.req.salt);
  // Tail first, so the LRU evicts a chain's end before its start.
  for (int64_t i = static_cast<int64_t>(s.blocks.size()) - 1; i >= 0; --i) {
    if (i < full) {
      cache_->Insert(hashes[i], s.blocks[i]);
    } else {
      cache_->Release(s.blocks[i]);
    }
  }
  s.blocks.clear();
}

void Scheduler::Emit(Sequence& s, int32_t token, const TokenLogprobs* logprobs) {
  const bool eog = engine_->model().tokenizer().IsEog(token);
  std::string piece = eog ? std::string() : s.decoder->Push(token);
  TokenEvent ev;
  ev.token = token;
  if (logprobs != nullptr) ev.logprobs = *logprobs;
  ev.text = s.stop->Push(token, piece, eog);
  if (s.stop->reason() != FinishReason::kNone) {
    ev.text += s.stop->Flush();
    ev.finished = true;
    ev.reason = s.stop->reason();
    ev.spec = s.spec;
    Release(s);
  }
  if (s.req.on_event) s.req.on_event(ev);
}

void Scheduler::Finish(Sequence& s, FinishReason reason, absl::Status status) {
  if (s.done) return;
  // After a failed step the blocks may hold partial writes: cache nothing from them.
  Release(s, /*keep=*/status.ok() || absl::IsCancelled(status));
  TokenEvent ev;
  ev.finished = true;
  ev.reason = reason;
  ev.status = std::move(status);
  ev.spec = s.spec;
  if (ev.status.ok()) ev.text = s.stop->Flush() + s.decoder->Flush();
  if (s.req.on_event) s.req.on_event(ev);
}

void Scheduler::Cancel(const std::string& id) {
  for (auto& s : running_) {
    if (s->req.id == id) Finish(*s, FinishReason::kNone, absl::CancelledError("cancelled"));
  }
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if ((*it)->req.id == id) {
      Finish(**it, FinishReason::kNone, absl::CancelledError("cancelled"));
      waiting_.erase(it);
      break;
    }
  }
  std::erase_if(running_, [](const auto& s) { return s->done; });
}

void Scheduler::Admit() {
  const int64_t bs = engine_->kv().block_size();
  BlockPool& pool = engine_->kv().pool();
  while (!waiting_.empty() &&
         static_cast<int>(running_.size()) < engine_->options().max_seqs) {
    Sequence& s = *waiting_.front();
    const int64_t need = static_cast<int64_t>(s.tokens.size()) + s.req.sampling.max_tokens;
    const int64_t total = (need + bs - 1) / bs;
    std::vector<int32_t> matched;
    int64_t queried = 0;
    if (cache_ != nullptr) {
      // At most the full blocks before the last prompt token, whose logits must be computed.
      queried = (static_cast<int64_t>(s.tokens.size()) - 1) / bs;
      const std::vector<uint64_t> hashes = ComputeBlockHashes(
          std::span<const int32_t>(s.tokens).first(queried * bs), static_cast<int32_t>(bs),
          s.req.salt);
      // Referenced before allocating, so the allocation cannot evict them.
      matched = cache_->Acquire(hashes);
    }
    auto blocks = pool.AllocateN(static_cast<int32_t>(total - matched.size()));
    if (!blocks.ok()) {
      for (auto it = matched.rbegin(); it != matched.rend(); ++it) cache_->Release(*it);
      break;  // FIFO: wait for blocks to free up
    }
    if (cache_ != nullptr) {
      cache_->RecordLookup(queried, static_cast<int64_t>(matched.size()));
      s.n_cached = static_cast<int64_t>(matched.size()) * bs;
      stats_.cached_prompt_tokens += s.n_cached;
    }
    s.blocks = std::move(matched);
    s.blocks.insert(s.blocks.end(), blocks->begin(), blocks->end());
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

void Scheduler::Draft(int64_t budget, int32_t decoding) {
  std::vector<DraftSlot> slots;
  std::vector<Sequence*> seqs;
  int64_t left = budget;
  stats_.spec_verify_cost = cost_->verify_cost(decoding);
  stats_.spec_draft_cost = cost_->draft_cost(decoding);
  stats_.spec_cost_batch = decoding;
  const double price = stats_.spec_verify_cost + stats_.spec_draft_cost;
  for (auto& sp : running_) {
    Sequence& s = *sp;
    if (static_cast<int64_t>(s.tokens.size()) - s.n_cached != 1) continue;
    --left;  // its pending token
    if (s.draft_len == nullptr) continue;
    // k drafts yield up to k + 1 tokens: stay within max_tokens (and so within the blocks
    // reserved at admission) and within the step's token budget.
    const int64_t generated =
        static_cast<int64_t>(s.tokens.size()) - static_cast<int64_t>(s.req.prompt.size());
    const int64_t want = std::min<int64_t>(
        {s.draft_len->Next(price), left, int64_t{s.req.sampling.max_tokens} - generated - 1});
    if (want <= 0) continue;
    left -= want;
    slots.push_back({s.key, s.tokens, static_cast<int32_t>(want), &s.proposed});
    seqs.push_back(&s);
  }
  if (slots.empty()) return;
  if (!proposer_->ProposeBatch(slots).ok()) {
    ++stats_.spec_proposer_failures;
    return;
  }
  cost_->ObserveDraftStep(decoding, proposer_->last_step_seconds());
  for (Sequence* s : seqs) {
    if (s->proposed.empty()) continue;
    s->verify.reserve(s->proposed.size() + 1);
    s->verify.push_back(s->tokens.back());
    s->verify.insert(s->verify.end(), s->proposed.begin(), s->proposed.end());
  }
}

void Scheduler::Accept(Sequence& s, float* rows) {
  const int32_t vocab = engine_->model().config().n_vocab;
  const int32_t k = static_cast<int32_t>(s.verify.size()) - 1;
  ++s.n_cached;  // the pending token
  int32_t kept = 0;
  // Counted before any Emit: the step may end the sequence, and its final event reports them.
  ++s.spec.verify_steps;
  s.spec.draft_tokens += k;
  for (int32_t j = 0; j <= k; ++j) {
    std::span<float> lg(rows + int64_t{j} * vocab, vocab);
    bool accepted = false;
    const int32_t next = j < k ? s.sampler->Verify(lg, s.tokens, s.verify[j + 1], &accepted)
                               : s.sampler->Sample(lg, s.tokens);
    s.tokens.push_back(next);
    // An accepted draft's K/V were written in this step; count them before Emit, which may
    // hand the blocks to the prefix cache up to n_cached.
    if (accepted) {
      ++s.n_cached;
      ++kept;
      ++s.spec.accepted_tokens;
    }
    ++stats_.generated_tokens;
    Emit(s, next, s.sampler->logprobs());
    if (!accepted || s.done) break;
  }
  s.draft_len->Record(k, kept);
  ++stats_.spec_steps;
  stats_.spec_draft_tokens += k;
  stats_.spec_accepted_tokens += kept;
  if (kept < static_cast<int32_t>(stats_.accepted_hist.size())) ++stats_.accepted_hist[kept];
  s.verify.clear();
}

std::vector<std::string> Scheduler::RunningIds() const {
  std::vector<std::string> ids;
  ids.reserve(running_.size());
  for (const auto& s : running_) ids.push_back(s->req.id);
  return ids;
}

absl::StatusOr<bool> Scheduler::Iterate() {
  Admit();
  if (running_.empty()) return false;
  const int64_t budget = engine_->options().max_batch_tokens;
  std::vector<SeqChunk> chunks;
  std::vector<Sequence*> chunk_seq;
  int64_t used = 0;
  // Speculate only while the step stays small: past max_batch decoding sequences a step is no
  // longer bound by reading the weights, and every verified token costs nearly a full one.
  int n_decoding = 0;
  for (const auto& sp : running_) {
    n_decoding += static_cast<int64_t>(sp->tokens.size()) - sp->n_cached == 1;
  }
  for (auto& sp : running_) sp->verify.clear();
  if (proposer_ != nullptr && n_decoding <= options_.speculative.max_batch &&
      !cost_->WantsPlainStep(n_decoding)) {
    Draft(budget, n_decoding);
  }
  int32_t drafts = 0;  // in this step, for the cost model
  bool prefill_rows = false;
  // Decode tokens first (one each), so running streams keep their pace; then prefill chunks.
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& sp : running_) {
      Sequence& s = *sp;
      const int64_t pending = static_cast<int64_t>(s.tokens.size()) - s.n_cached;
      const bool decoding = pending == 1;
      if ((pass == 0) != decoding || pending <= 0) continue;
      const int64_t n = std::min(pending, budget - used);
      if (n <= 0) continue;
      if (decoding && !s.verify.empty()) {
        const int32_t k = static_cast<int32_t>(s.verify.size()) - 1;
        SeqChunk ch;
        ch.tokens = s.verify;
        ch.start_pos = static_cast<int32_t>(s.n_cached);
        ch.block_table = s.blocks;
        ch.want_logits = true;
        ch.n_logits = k + 1;
        chunks.push_back(ch);
        chunk_seq.push_back(&s);
        used += k + 1;
        drafts += k;
        continue;
      }
      prefill_rows = prefill_rows || !decoding;
      SeqChunk ch;
      ch.tokens = std::span<const int32_t>(s.tokens).subspan(s.n_cached, n);
      ch.start_pos = static_cast<int32_t>(s.n_cached);
      ch.block_table = s.blocks;
      ch.want_logits = (s.n_cached + n == static_cast<int64_t>(s.tokens.size()));
      chunks.push_back(ch);
      chunk_seq.push_back(&s);
      used += n;
    }
  }
  if (chunks.empty()) return false;
  const absl::Time t0 = absl::Now();
  absl::Status st = engine_->Step(chunks, &logits_);
  ++stats_.steps;
  // Decode-only steps teach the cost model what a draft token costs at this batch size.
  if (st.ok() && cost_ != nullptr && !prefill_rows && n_decoding <= options_.speculative.max_batch) {
    cost_->ObserveStep(n_decoding, drafts, absl::ToDoubleSeconds(absl::Now() - t0));
  }
  if (!st.ok()) {
    for (Sequence* s : chunk_seq) Finish(*s, FinishReason::kNone, st);
    std::erase_if(running_, [](const auto& s) { return s->done; });
    return st;
  }
  const int32_t vocab = engine_->model().config().n_vocab;
  int64_t out = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    Sequence& s = *chunk_seq[i];
    if (!s.verify.empty()) {
      Accept(s, logits_.data() + out * vocab);
      out += chunks[i].n_logits;
      continue;
    }
    if (s.n_cached < static_cast<int64_t>(s.req.prompt.size())) {
      stats_.prompt_tokens += static_cast<int64_t>(chunks[i].tokens.size());
    }
    s.n_cached += static_cast<int64_t>(chunks[i].tokens.size());
    if (!chunks[i].want_logits) continue;
    std::span<float> lg(logits_.data() + out * vocab, vocab);
    ++out;
    const int32_t next = s.sampler->Sample(lg, s.tokens);
    s.tokens.push_back(next);
    ++stats_.generated_tokens;
    Emit(s, next, s.sampler->logprobs());
  }
  std::erase_if(running_, [](const auto& s) { return s->done; });
  return true;
}

absl::Status Scheduler::RunUntilIdle() {
  for (;;) {
    TANDEM_ASSIGN_OR_RETURN(bool progressed, Iterate());
    if (!progressed && waiting_.empty()) return absl::OkStatus();
    if (!progressed && running_.empty()) {
      return absl::ResourceExhaustedError("requests waiting but none can be admitted");
    }
  }
}

}  // namespace tandem::engine
