// An in-process continuous-batching loop over Engine::Step.
//
// Requests queue in arrival order. A request is admitted when the KV pool can hold its whole
// prompt plus max_tokens (reserving up front means no preemption is ever needed). Every
// iteration packs one decode token for each running sequence and fills the rest of the token
// budget with prefill chunks (chunked prefill), runs one Step, samples, and reports tokens
// through the request's callback. Finished sequences free their blocks at once.
//
// With the prefix cache on (SchedulerOptions::prefix_cache), admission reuses the longest run
// of cached full blocks of the prompt under the request's salt (never the whole prompt: the
// last prompt token is always computed, for its logits) and prefill starts after them; a
// sequence that finishes or is cancelled hands its full blocks (prompt and generated) to the
// cache instead of freeing them. Cached blocks nobody uses count as used in the pool until an
// allocation needs them (see PrefixCache).
//
// With speculation on (SchedulerOptions::speculative), a decoding sequence may feed its pending
// token plus k draft tokens from the proposer in one chunk with k+1 logit rows; Sampler::Verify
// keeps the longest agreeing prefix and one token more. K/V written for rejected drafts lie past
// n_cached, where nothing reads them and the next step overwrites them: the blocks were reserved
// at admission, so rolling back is moving n_cached, and block hashes only ever cover positions
// below it. Output (greedy, and seeded sampling) is the same as without speculation.
//
// Threading: single-threaded; callbacks run on the thread that calls Run/Iterate.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/kv/prefix_cache.h"
#include "engine/runtime/engine.h"
#include "engine/sampling/sampler.h"
#include "engine/spec/proposer.h"
#include "engine/tokenizer/tokenizer.h"

namespace tandem::engine {

// One sequence's speculation so far: verify steps, draft tokens checked, and those kept.
struct SpecUsage {
  int32_t verify_steps = 0;
  int32_t draft_tokens = 0;
  int32_t accepted_tokens = 0;
};

struct TokenEvent {
  int32_t token = -1;  // -1 on the final event when no token accompanies it
  std::string text;    // newly completed text (stop strings held back and removed)
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  absl::Status status;  // non-OK if the request failed
  SpecUsage spec;       // on the final event: the request's speculation (zeros without any)
  // With sampling.logprobs >= 0, on every event that carries a token.
  std::optional<TokenLogprobs> logprobs;
};

struct GenerationRequest {
  std::string id;
  std::vector<int32_t> prompt;  // already tokenised, BOS included where the model wants it
  SamplingParams sampling;
  std::function<void(const TokenEvent&)> on_event;
  // Prefix-cache namespace (the tenant): requests share cached blocks only with the same salt.
  uint64_t salt = 0;
  // SubmitPrefilled with sampling.logprobs >= 0: the first token's, from the remote sampler.
  std::optional<TokenLogprobs> first_token_logprobs;
};

struct SchedulerStats {
  int64_t steps = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // prompt tokens served from the prefix cache
  // Speculation: draft tokens checked, and those kept. accepted_hist[n] counts verify steps
  // that kept n drafts (0 .. max_draft).
  int64_t spec_steps = 0;
  int64_t spec_draft_tokens = 0;
  int64_t spec_accepted_tokens = 0;
  std::vector<int64_t> accepted_hist;
  // Steps whose proposal failed (a draft model's engine step): they decoded without drafts.
  int64_t spec_proposer_failures = 0;
  // The price of one draft token (verification, then proposing) relative to a plain step, as
  // SpecCostModel put it for the last step that asked, and that step's number of decoding
  // sequences.
  double spec_verify_cost = 0;
  double spec_draft_cost = 0;
  int32_t spec_cost_batch = 0;
};

struct SchedulerOptions {
  // Off by default: callers that account for every pool block (the decode worker, tests that
  // expect an empty pool after a run) see no change unless they ask for it.
  bool prefix_cache = false;
  // Off unless speculative.method says otherwise.
  SpeculativeOptions speculative;
  // The proposer to use (MakeSpecProposer, engine/runtime/draft_proposer.h); required for the
  // model proposers (self, draft), made from `speculative` for the others when null. One
  // scheduler per proposer: it keys per-sequence state by the scheduler's sequence ids.
  std::shared_ptr<Proposer> proposer;
};

class Scheduler {
 public:
  explicit Scheduler(Engine* engine, SchedulerOptions options = {});
  ~Scheduler();

  // Validates (prompt non-empty and in vocab, prompt + max_tokens within the context and the
  // KV pool, sampling params) and queues. INVALID_ARGUMENT with the reason otherwise.
  absl::Status Submit(GenerationRequest req);
  // Adopts a sequence whose prompt K/V are already in `blocks` (written by a remote prefill) and
  // whose first token was sampled there. The blocks (covering prompt plus max_tokens) pass to
  // the scheduler, which frees them when the sequence ends. The first token is reported at once
  // through the callback; the sequence then decodes with the others. Same validation as Submit.
  // With a draft model, `draft_blocks` (blocks of the proposer's pool, non-empty) hold the
  // draft's K/V of every prompt position, also written by the remote prefill: they pass to the
  // proposer (Proposer::Adopt), which then only feeds the draft what follows the prompt. On an
  // error nothing is taken: the caller still owns both sets of blocks.
  absl::Status SubmitPrefilled(GenerationRequest req, std::vector<int32_t> blocks,
                               int32_t first_token, std::vector<int32_t> draft_blocks = {});
  // Cancels a queued or running request: its callback gets a final event with CANCELLED.
  void Cancel(const std::string& id);

  // One iteration: admit, step, sample. Returns false when there is nothing to do.
  absl::StatusOr<bool> Iterate();
  // Iterates until every request has finished.
  absl::Status RunUntilIdle();

  int num_running() const { return static_cast<int>(running_.size()); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  // The ids of the running requests, in batch order.
  std::vector<std::string> RunningIds() const;
  const SchedulerStats& stats() const { return stats_; }
  // Null when the prefix cache is off.
  PrefixCache* prefix_cache() { return cache_.get(); }
  const PrefixCache* prefix_cache() const { return cache_.get(); }

 private:
  struct Sequence;
  absl::Status Validate(const GenerationRequest& req) const;
  std::unique_ptr<Sequence> NewSequence(GenerationRequest req);
  // Feeds a sampled token through decoding and stop checks and reports it.
  // Reports a sampled token (with its log-probabilities when asked for; null otherwise).
  void Emit(Sequence& s, int32_t token, const TokenLogprobs* logprobs);
  // Gives the sequence's blocks back; with the cache on and `keep` set, its full blocks are
  // cached rather than freed.
  void Release(Sequence& s, bool keep = true);
  void Finish(Sequence& s, FinishReason reason, absl::Status status);
  void Admit();
  // Asks the proposer, for every decoding sequence at once, for drafts within the step's token
  // budget; a sequence with a draft gets s.verify = its pending token, then the draft. Each
  // sequence's draft length prices a draft token as cost_ says for `decoding` sequences.
  void Draft(int64_t budget, int32_t decoding);
  // Takes the logit rows of a verify chunk (s.verify.size() rows at `rows`): keeps the accepted
  // drafts and one token from the target, and reports each.
  void Accept(Sequence& s, float* rows);

  Engine* engine_;
  SchedulerOptions options_;
  std::unique_ptr<PrefixCache> cache_;
  std::shared_ptr<Proposer> proposer_;  // null with speculation off
  std::unique_ptr<SpecCostModel> cost_;  // with proposer_
  uint64_t next_key_ = 0;               // Sequence::key, for the proposer's per-sequence state
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  SchedulerStats stats_;
  std::vector<float> logits_;
};

}  // namespace tandem::engine
