// Speculative decoding: proposers and the options that turn it on.
//
// A proposer guesses the tokens that follow a sequence; the scheduler checks k guesses in one
// engine step (k+1 logit rows) and keeps the longest prefix the target model agrees with
// (Sampler::Verify), so the output is the target's whatever the proposer says. Proposers are
// deterministic: each guess is a point mass (a draft model proposes its greedy tokens), which is
// what Sampler::Verify's rule assumes.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/kernels/dtype.h"

namespace tandem::engine {

enum class SpecMethod {
  kOff,
  kNgram,  // prompt lookup: continue the latest earlier occurrence of the sequence's suffix
  kSelf,   // the target's own weights converted to self_type (self:TYPE)
  kDraft,  // another GGUF model with the target's vocabulary (draft:PATH)
};

struct SpeculativeOptions {
  SpecMethod method = SpecMethod::kOff;
  // Most draft tokens checked per step (--spec-tokens).
  int32_t max_draft = 4;
  // n-gram proposer: suffix lengths tried, longest first.
  int32_t ngram_min = 1;
  int32_t ngram_max = 3;
  // Speculation is skipped in a step with more decoding sequences than this: verification is
  // nearly free only while a step is bound by reading the weights (docs/perf/speculative.md).
  int32_t max_batch = 8;
  // Adaptive draft length: each sequence picks k maximising its expected tokens per unit of
  // step time, (1 - a^(k+1)) / (1 - a) / (1 + (verify_cost + draft_cost) * k), from its running
  // acceptance a.
  // Off: always max_draft.
  bool adaptive = true;
  // Step time of one more verified token, relative to a one-token decode step.
  double verify_cost = 0.1;
  // Step time of proposing one draft token, relative to a one-token decode step of the target:
  // 0 for the n-gram proposer; a draft model's proposer sets it (Proposer::draft_cost).
  double draft_cost = 0.0;
  // The acceptance a sequence starts with, before any of its drafts is judged (a draft model's
  // proposer raises it: Proposer::prior_acceptance).
  double prior_acceptance = 0.5;
  // kSelf: the type the target's matrices are converted to; kDraft: the draft model's file.
  kernels::DType self_type = kernels::DType::kQ4_0;
  std::string draft_path;
};

std::string_view SpecMethodName(SpecMethod m);
// What prefill and decode must agree on, exchanged in the reserve handshake: the method and,
// for a model proposer, which model ("self:q4_0", "draft:<file name>"), not the draft length or
// the gate, which are decode's own.
std::string SpecHandshake(const SpeculativeOptions& o);

// "off", "ngram", "self:TYPE" or "draft:PATH" with k draft tokens. INVALID_ARGUMENT for anything
// else, a TYPE that is not a weight type (kWeightTypes), an empty PATH or k outside [1, 16]. The
// draft file itself is opened only where the proposer is made (engine/runtime/draft_proposer.h).
absl::StatusOr<SpeculativeOptions> ParseSpeculative(std::string_view spec, int32_t k);

// One sequence's request in a batched proposal.
struct DraftSlot {
  uint64_t seq = 0;                 // the caller's id for the sequence, stable over its life
  std::span<const int32_t> tokens;  // prompt and output so far; only ever grows for one seq
  int32_t max_draft = 0;
  std::vector<int32_t>* draft = nullptr;  // replaced with at most max_draft tokens
};

class Proposer {
 public:
  virtual ~Proposer() = default;
  virtual std::string_view name() const = 0;
  // Replaces *draft with at most max_draft tokens guessed to follow `tokens` (prompt and output
  // so far); empty when it has no guess.
  virtual void Propose(std::span<const int32_t> tokens, int32_t max_draft,
                       std::vector<int32_t>* draft) = 0;
  // Every slot at once, so a draft model runs one step per draft position for the whole batch.
  // A proposer that keeps per-sequence state (a draft model's K/V) keys it by DraftSlot::seq
  // until Forget. An error leaves every slot's draft empty; the caller decodes without drafts.
  virtual absl::Status ProposeBatch(std::span<const DraftSlot> slots);
  // The sequence ended: drop what is kept for it. Called for every sequence of a scheduler
  // with a proposer, whether it speculated or not.
  virtual void Forget(uint64_t /*seq*/) {}
  // A draft model's proposer only: takes `blocks` of its own KV pool, which already hold the
  // draft's K/V of `tokens` (positions 0 .. tokens.size()-1, computed elsewhere: the prefill
  // worker), as sequence `seq`'s state; they go back to the pool at Forget.
  virtual void Adopt(uint64_t /*seq*/, std::span<const int32_t> /*tokens*/,
                     std::vector<int32_t> /*blocks*/) {}
  // Cost of one draft token relative to one decode step of the target, and the acceptance to
  // assume before any is judged (SpeculativeOptions).
  virtual double draft_cost() const { return 0.0; }
  virtual double prior_acceptance() const { return 0.5; }
  // Wall seconds per draft position of the last ProposeBatch (one draft step for the whole
  // batch), catching up excluded; 0 when it ran none or costs nothing worth measuring.
  virtual double last_step_seconds() const { return 0.0; }
};

// Prompt lookup: for n = ngram_max down to ngram_min, finds the latest earlier occurrence of the
// last n tokens and proposes the tokens that followed it. Costs O(length * n) per call.
class NgramProposer final : public Proposer {
 public:
  NgramProposer(int32_t ngram_min, int32_t ngram_max);
  std::string_view name() const override { return "ngram"; }
  void Propose(std::span<const int32_t> tokens, int32_t max_draft,
               std::vector<int32_t>* draft) override;

 private:
  int32_t min_;
  int32_t max_;
};

// The proposer for o.method when it needs no model (kNgram); null for kOff and the model
// proposers, which MakeSpecProposer (engine/runtime/draft_proposer.h) makes.
std::unique_ptr<Proposer> MakeProposer(const SpeculativeOptions& o);

// What speculation costs on this engine, learned from the scheduler's own step timings, per
// number of decoding sequences B (1 .. max_batch): a decode step's time T(B, K) with K draft
// tokens in all is fitted as alpha + beta * K by least squares with old steps forgotten
// (weights decay by kForget a step), so verify_cost(B) = B * beta / alpha: one draft token for
// each sequence costs that share of a plain step. A draft model's step time per draft position
// over alpha gives draft_cost(B). Until a B has steps with different K (or any draft steps),
// the options' priors answer, verify_cost scaled by B. Single-threaded, as the scheduler.
class SpecCostModel {
 public:
  explicit SpecCostModel(const SpeculativeOptions& o);
  // A step of `decoding` sequences, with `drafts` draft tokens among them and no prefill rows.
  void ObserveStep(int32_t decoding, int32_t drafts, double seconds);
  // A proposal for `decoding` sequences whose draft steps took `step_seconds` each.
  void ObserveDraftStep(int32_t decoding, double step_seconds);
  double verify_cost(int32_t decoding) const;
  double draft_cost(int32_t decoding) const;
  // True when the next step at this batch size should not draft: the fit cannot tell alpha from
  // beta yet because the last kCalibrateEvery steps all drafted about as much (a model draft
  // proposing k to every sequence), so one plain step is taken to measure alpha.
  bool WantsPlainStep(int32_t decoding) const;

  static constexpr double kForget = 0.97;
  static constexpr double kMaxCost = 4.0;  // prices are capped: past 1 nothing drafts anyway
  static constexpr int32_t kCalibrateEvery = 16;
  static constexpr int32_t kMaxBatch = 256;  // B above this shares the last entry

 private:
  struct Fit {
    double w = 0, x = 0, y = 0, xx = 0, xy = 0;  // decayed sums of 1, K, T, K^2, K*T
    double draft_step = 0;                       // EWMA of a draft step's seconds; 0: none yet
    int32_t since_plain = 0;                     // steps since the last one without drafts
  };
  const Fit& at(int32_t decoding) const;
  Fit& at(int32_t decoding);
  // alpha and beta of a fit when K varied enough to tell them apart; false otherwise.
  static bool Solve(const Fit& f, double* alpha, double* beta);

  double prior_verify_;
  double prior_draft_;
  std::vector<Fit> fits_;
};

// Per-sequence acceptance tracking and the adaptive draft length.
class DraftLength {
 public:
  explicit DraftLength(const SpeculativeOptions& o)
      : o_(o), hits_(2.0 * o.prior_acceptance), trials_(2.0) {}
  // Draft tokens to ask for in the next step, 0..max_draft. With adaptive on, a sequence whose
  // acceptance makes speculation a loss still drafts one probe token now and then, so it can
  // recover when its text starts repeating: after kProbeEvery idle steps at first, twice as long
  // after each probe that is rejected (up to kMaxProbeEvery), and back to kProbeEvery once one
  // is kept. With a draft model (draft_cost > 0) there are no probes: the draft would first
  // catch up on every token it skipped, a prefill whose cost grows with the gap, so probing
  // costs about the same share of the time however rare it is.
  int32_t Next();
  // The same with the price of one draft token (verification plus proposing, relative to a
  // one-token step) given: what SpecCostModel measured for the step's batch.
  int32_t Next(double draft_token_cost);
  // `accepted` of `drafted` tokens were kept (drafted >= 1).
  void Record(int32_t drafted, int32_t accepted);
  // The running per-token acceptance estimate.
  double acceptance() const { return hits_ / trials_; }

  static constexpr int kProbeEvery = 8;
  static constexpr int kMaxProbeEvery = 128;

 private:
  SpeculativeOptions o_;
  // Discounted counts of accepted draft tokens and of draft tokens judged (the first rejected
  // one counts; those after it were never judged), from a prior of two drafts.
  double hits_;
  double trials_;
  int idle_steps_ = 0;
  int probe_every_ = kProbeEvery;
  bool probing_ = false;  // the last Next() was a probe
};

}  // namespace tandem::engine
