// Token sampling: penalties, then greedy or temperature + top-k + top-p + min-p, with a
// per-request seed so runs are reproducible. Stop conditions (stop ids, stop strings, max
// tokens) live in StopChecker.
//
// A Sampler belongs to one sequence and is not thread-safe.
//
// Semantics (tests rely on them):
// - Penalties follow llama.cpp over the last penalty_last_n tokens of history: a positive logit
//   is divided by repetition_penalty, a non-positive one multiplied; then
//   count * frequency_penalty + presence_penalty is subtracted.
// - temperature 0: argmax, lowest id on ties.
// - Otherwise top-k on the logits, then top-p and min-p on softmax(logits / temperature) (the
//   distribution actually drawn from, as vLLM and HF do), then one draw from the survivors.
// - The draw is a function of (seed, number of earlier draws, logits) alone, identical on every
//   platform: raw mt19937_64 output turned into a 53-bit uniform double u, then the first
//   survivor, walked in id order, at which the running weight exceeds u * total weight.
// - Cost per token is linear in the vocabulary: no filter sorts the whole vocabulary.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "engine/sampling/grammar.h"

namespace tandem::engine {

// What the output must match (constraint.h, grammar.h). Sampler::Constrain applies it.
struct Constraint {
  enum class Kind { kNone, kJsonObject, kJsonSchema, kGrammar, kRegex };
  Kind kind = Kind::kNone;
  // kJsonSchema: the schema (JSON text); kGrammar: GBNF; kRegex: a regular expression
  // (engine/sampling/grammar_text.h).
  std::string text;
  // The prompt's last `generated` tokens are output already generated under the constraint
  // (a request that moved to another worker mid-generation): the matcher starts after them.
  int32_t generated = 0;
};

struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy
  int32_t top_k = 0;         // 0 or negative: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int32_t penalty_last_n = 64;  // window of past tokens the penalties look at (-1: all)
  uint64_t seed = 0;
  int32_t max_tokens = 16;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop_strings;
  bool ignore_eos = false;
  // false: this request never speculates (Scheduler); the output is the same either way.
  bool speculative = true;
  // -1: off. n in [0, kMaxTopLogprobs]: each sampled token's log-probability and the n most
  // likely tokens' (TokenLogprobs), from the model's own distribution: log-softmax of the raw
  // logits, before penalties and temperature (as vLLM reports them by default).
  int32_t logprobs = -1;
  Constraint constraint;
};

inline constexpr int32_t kMaxTopLogprobs = 20;

// A sampled token's log-probability and the top alternatives', most likely first (lower id on
// ties). `top` has SamplingParams::logprobs entries (fewer only for a smaller vocabulary).
struct TokenLogprobs {
  struct Entry {
    int32_t id = 0;
    float logprob = 0;
  };
  float logprob = 0;
  std::vector<Entry> top;
};

// INVALID_ARGUMENT naming the field for out-of-range values (temperature < 0, top_p outside
// (0, 1], min_p outside [0, 1], repetition_penalty <= 0, penalties outside [-2, 2],
// max_tokens < 1, ids outside the vocabulary, empty stop strings, logprobs outside
// [-1, kMaxTopLogprobs]).
absl::Status ValidateSamplingParams(const SamplingParams& p, int32_t vocab_size);

namespace sampling_internal {
struct Candidate {
  float logit;
  int32_t id;
};
}  // namespace sampling_internal

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // Picks the next token. logits (vocab_size floats) are modified in place. history holds the
  // prompt and generated tokens, for the penalties.
  int32_t Sample(std::span<float> logits, std::span<const int32_t> history);
  // Advances the random stream as if n tokens had been sampled here. A decode worker that
  // continues a sequence whose first token was sampled by a prefill worker skips that draw, so
  // a seeded request yields the same tokens disaggregated as in one process.
  void SkipSamples(int64_t n);
  // From now on only tokens `m` allows are drawn (their logits are masked before penalties,
  // after the log-probabilities are taken), and each drawn token advances it.
  void Constrain(std::unique_ptr<GrammarMatcher> m) { matcher_ = std::move(m); }
  // A token this sequence produced without this sampler drawing it (a prefill worker's first
  // token): advances the constraint as a draw would. INVALID_ARGUMENT when it breaks it.
  absl::Status Observe(int32_t token);
  const GrammarMatcher* matcher() const { return matcher_.get(); }
  // The last sampled token's log-probabilities; null unless SamplingParams::logprobs >= 0.
  const TokenLogprobs* logprobs() const { return p_.logprobs >= 0 ? &logprobs_ : nullptr; }
  // Speculative verification of a deterministic draft token (a point mass q at `draft`): the
  // standard rule accepts it with min(1, p/q) = p(draft) and otherwise draws from the residual
  // max(0, p - q), normalised, which is p without the draft. Drawing x from p with this
  // sampler's one uniform and accepting when x == draft realises exactly that rule, so Verify
  // returns Sample's token and sets *accepted when it equals the draft. Consequences: a seeded
  // request yields the same tokens with speculation as without it, whatever the batch, and
  // greedy accepts exactly when the draft is the argmax.
  int32_t Verify(std::span<float> logits, std::span<const int32_t> history, int32_t draft,
                 bool* accepted) {
    const int32_t t = Sample(logits, history);
    *accepted = t == draft;
    return t;
  }

 private:
  int32_t Pick(std::span<float> logits, std::span<const int32_t> history);
  // Fills logprobs_.top from the raw logits and returns their log-sum-exp.
  float RankForLogprobs(std::span<const float> logits);
  void ApplyPenalties(std::span<float> logits, std::span<const int32_t> history) const;
  // The worst-ranked member of the top-p nucleus of cands_ (whose weights_ are current).
  sampling_internal::Candidate NucleusEnd(double target, float max_logit, float inv_t);

  SamplingParams p_;
  std::mt19937_64 rng_;
  // Scratch reused across calls so a 150k-vocabulary step does not allocate.
  std::vector<sampling_internal::Candidate> cands_;
  std::vector<sampling_internal::Candidate> scratch_;
  std::vector<float> weights_;
  std::vector<double> bucket_mass_;
  std::vector<uint16_t> bucket_of_;
  mutable std::vector<int32_t> window_;
  TokenLogprobs logprobs_;
  std::unique_ptr<GrammarMatcher> matcher_;
  std::vector<float> raw_;  // the raw logits, kept while logprobs are asked for
};

enum class FinishReason { kNone, kStop, kLength };

// Watches generated text for stop strings and counts tokens. Text that might be the start of a
// stop string is held back, so the caller never streams text it must take back.
class StopChecker {
 public:
  explicit StopChecker(SamplingParams p) : p_(std::move(p)) {}
  // Feeds one generated token and its decoded text; returns the text now safe to emit.
  // After a finish, reason() says why, and the emitted text excludes the stop string.
  std::string Push(int32_t id, std::string_view text, bool is_eog);
  // Text still held back when generation ends for another reason.
  std::string Flush();
  FinishReason reason() const { return reason_; }
  int32_t generated() const { return generated_; }

 private:
  SamplingParams p_;
  std::string held_;
  FinishReason reason_ = FinishReason::kNone;
  int32_t generated_ = 0;
};

}  // namespace tandem::engine
