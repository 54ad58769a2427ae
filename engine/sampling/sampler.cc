#include "engine/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tandem::engine {
namespace {

absl::Status Invalid(const char* field, const char* rule, float got) {
  return absl::InvalidArgumentError(absl::StrCat(field, " must be ", rule, ", got ", got));
}

// Rank order: higher logit first, lower id on ties. It is a strict total order (NaN logits are
// turned into -inf before ranking), so each filter's cut-off candidate is unique and the kept
// set does not depend on how a standard library partitions or sorts.
using Cand = sampling_internal::Candidate;

bool Before(const Cand& a, const Cand& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

// Lowest id among the maximal logits. NaN never compares greater, so it is never picked
// unless every logit is NaN (then id 0). Eight independent running maxima (which the compiler
// turns into SIMD max) and a second scan for the first position holding the max: a single
// "best index" scan is a chain of dependent loads, several times slower at 150k tokens.
int32_t Argmax(std::span<const float> logits) {
  constexpr size_t kLanes = 8;
  float lane[kLanes];
  std::fill(lane, lane + kLanes, -std::numeric_limits<float>::infinity());
  size_t i = 0;
  for (; i + kLanes <= logits.size(); i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) {
      const float v = logits[i + j];
      lane[j] = v > lane[j] ? v : lane[j];
    }
  }
  float best = -std::numeric_limits<float>::infinity();
  for (; i < logits.size(); ++i) best = logits[i] > best ? logits[i] : best;
  for (float v : lane) best = v > best ? v : best;
  for (size_t k = 0; k < logits.size(); ++k) {
    if (logits[k] == best) return static_cast<int32_t>(k);
  }
  return 0;
}

// Uniform double in [0, 1) from the top 53 bits of one raw 64-bit draw. std::uniform_real_
// distribution's algorithm is implementation-defined; this one is the same everywhere.
double UniformDouble(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

// Adds c to `heap`, a max-heap under Before of the best k candidates seen so far (its front the
// worst of them), when it ranks among them.
void KeepIfBest(const Cand& c, size_t k, std::vector<Cand>& heap) {
  if (heap.size() < k) {
    heap.push_back(c);
    std::push_heap(heap.begin(), heap.end(), Before);
  } else if (Before(c, heap.front())) {
    std::pop_heap(heap.begin(), heap.end(), Before);
    heap.back() = c;
    std::push_heap(heap.begin(), heap.end(), Before);
  }
}

// The k-th best candidate (1-based k < cands.size()) in Before order. For the usual small k a
// bounded heap costs about one comparison per token; a large k uses nth_element on a copy.
Cand KthBest(const std::vector<Cand>& cands, size_t k, std::vector<Cand>& scratch) {
  scratch.clear();
  if (k <= 1024) {
    // Max-heap under Before: the front is the worst of the best k seen so far.
    for (const Cand& c : cands) KeepIfBest(c, k, scratch);
    return scratch.front();
  }
  scratch = cands;
  std::nth_element(scratch.begin(), scratch.begin() + static_cast<ptrdiff_t>(k - 1), scratch.end(),
                   Before);
  return scratch[k - 1];
}

// Keeps, in their current (id) order, the candidates ranked no worse than `last`.
void KeepUpTo(const Cand& last, std::vector<Cand>& cands) {
  cands.erase(std::remove_if(cands.begin(), cands.end(),
                             [&](const Cand& c) { return Before(last, c); }),
              cands.end());
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& p, int32_t vocab_size) {
  // Written as !(x ok) so NaN is rejected too.
  if (!(p.temperature >= 0.0f)) return Invalid("temperature", ">= 0", p.temperature);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return Invalid("top_p", "in (0, 1]", p.top_p);
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return Invalid("min_p", "in [0, 1]", p.min_p);
  if (!(p.repetition_penalty > 0.0f) || std::isinf(p.repetition_penalty)) {
    return Invalid("repetition_penalty", "> 0 and finite", p.repetition_penalty);
  }
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f)) {
    return Invalid("presence_penalty", "in [-2, 2]", p.presence_penalty);
  }
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f)) {
    return Invalid("frequency_penalty", "in [-2, 2]", p.frequency_penalty);
  }
  if (p.penalty_last_n < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("penalty_last_n must be >= -1, got ", p.penalty_last_n));
  }
  if (p.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ", p.max_tokens));
  }
  for (int32_t id : p.stop_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stop_token_ids must be in [0, ", vocab_size, "), got ", id));
    }
  }
  if (p.logprobs < -1 || p.logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("logprobs must be in [0, ", kMaxTopLogprobs,
                                                   "] (or -1: off), got ", p.logprobs));
  }
  for (size_t i = 0; i < p.stop_strings.size(); ++i) {
    if (p.stop_strings[i].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop_strings must not be empty, got \"\" at index ", i));
    }
  }
  return absl::OkStatus();
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}

void Sampler::ApplyPenalties(std::span<float> logits, std::span<const int32_t> history) const {
  const bool neutral = p_.repetition_penalty == 1.0f && p_.frequency_penalty == 0.0f &&
                       p_.presence_penalty == 0.0f;
  if (neutral || p_.penalty_last_n == 0 || history.empty()) return;
  size_t n = history.size();
  if (p_.penalty_last_n > 0) n = std::min(n, static_cast<size_t>(p_.penalty_last_n));
  // Counting by sorting a copy of the window: the window is small (64 by default), and this
  // needs no per-sampler state, so a Sampler can be re-pointed at any history.
  window_.assign(history.end() - static_cast<ptrdiff_t>(n), history.end());
  std::sort(window_.begin(), window_.end());
  const auto vocab = static_cast<int64_t>(logits.size());
  for (size_t i = 0; i < window_.size();) {
    size_t j = i;
    while (j < window_.size() && window_[j] == window_[i]) ++j;
    const int32_t id = window_[i];
    const auto count = static_cast<float>(j - i);
    i = j;
    if (id < 0 || id >= vocab) continue;  // not a token of this vocabulary: nothing to penalise
    float& l = logits[static_cast<size_t>(id)];
    // Dividing a negative logit would raise it, so those are multiplied (llama.cpp's rule).
    if (l <= 0.0f) {
      l *= p_.repetition_penalty;
    } else {
      l /= p_.repetition_penalty;
    }
    l -= count * p_.frequency_penalty + p_.presence_penalty;
  }
}

void Sampler::SkipSamples(int64_t n) {
  // Sample draws exactly one 64-bit value per call when temperature > 0 and none otherwise.
  if (p_.temperature > 0.0f && n > 0) rng_.discard(static_cast<unsigned long long>(n));
}

int32_t Sampler::Sample(std::span<float> logits, std::span<const int32_t> history) {
  if (logits.empty()) return 0;
  float lse = 0;
  if (p_.logprobs >= 0) {
    // Masking and penalties change the logits in place: keep the raw ones.
    raw_.assign(logits.begin(), logits.end());
    lse = RankForLogprobs(logits);
  }
  if (matcher_ != nullptr) matcher_->Apply(logits);
  const int32_t t = Pick(logits, history);
  // The mask allowed t (a grammar that allows nothing leaves Pick's fallback, refused here
  // and left for the stop checks).
  if (matcher_ != nullptr) matcher_->Accept(t).IgnoreError();
  if (p_.logprobs >= 0) {
    const float l = raw_[static_cast<size_t>(t)];
    logprobs_.logprob = std::isnan(l) ? -std::numeric_limits<float>::infinity() : l - lse;
  }
  return t;
}

absl::Status Sampler::Observe(int32_t token) {
  return matcher_ != nullptr ? matcher_->Accept(token) : absl::OkStatus();
}

float Sampler::RankForLogprobs(std::span<const float> logits) {
  // One pass for the maximum, one for the sum of exponentials (in double: 150k terms) and the
  // best n by a bounded heap.
  const size_t n = std::min(static_cast<size_t>(p_.logprobs), logits.size());
  float max_logit = -std::numeric_limits<float>::infinity();
  for (float l : logits) max_logit = l > max_logit ? l : max_logit;
  scratch_.clear();
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float l = logits[i];
    if (std::isnan(l)) continue;
    sum += std::exp(static_cast<double>(l) - max_logit);
    if (n > 0) KeepIfBest({l, static_cast<int32_t>(i)}, n, scratch_);
  }
  const float lse = std::isfinite(max_logit)
                        ? max_logit + static_cast<float>(std::log(sum))
                        : max_logit;
  std::sort(scratch_.begin(), scratch_.end(), Before);
  logprobs_.top.clear();
  for (const Cand& c : scratch_) logprobs_.top.push_back({c.id, c.logit - lse});
  return lse;
}

int32_t Sampler::Pick(std::span<float> logits, std::span<const int32_t> history) {
  if (logits.empty()) return 0;
  ApplyPenalties(logits, history);
  if (!(p_.temperature > 0.0f)) return Argmax(logits);

  // Survivors stay in id order throughout; each filter finds its cut-off candidate and keeps
  // everything ranked no worse. The draw then walks them in id order, so its result depends
  // only on the seed and the logits, never on how a standard library sorts.
  auto& cands = cands_;
  cands.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    const float l = std::isnan(logits[i]) ? -std::numeric_limits<float>::infinity() : logits[i];
    cands[i] = {l, static_cast<int32_t>(i)};
  }
  if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < cands.size()) {
    KeepUpTo(KthBest(cands, static_cast<size_t>(p_.top_k), scratch_), cands);
  }

  float max_logit = -std::numeric_limits<float>::infinity();
  for (const Cand& c : cands) max_logit = std::max(max_logit, c.logit);
  if (!std::isfinite(max_logit)) return Argmax(logits);  // every logit -inf (or +inf): no softmax

  // Unnormalised tempered probabilities; the best one is exactly 1.
  const float inv_t = 1.0f / p_.temperature;
  auto& w = weights_;
  auto weigh = [&] {
    w.resize(cands.size());
    double total = 0.0;
    for (size_t i = 0; i < cands.size(); ++i) {
      w[i] = std::exp((cands[i].logit - max_logit) * inv_t);
      total += w[i];
    }
    return total;
  };
  double total = weigh();

  if (p_.top_p < 1.0f) {
    KeepUpTo(NucleusEnd(static_cast<double>(p_.top_p) * total, max_logit, inv_t), cands);
    total = weigh();
  }

  if (p_.min_p > 0.0f) {
    // p_i >= min_p * p_max, and p_max's weight is 1.
    size_t out = 0;
    total = 0.0;
    for (size_t i = 0; i < cands.size(); ++i) {
      if (w[i] >= p_.min_p) {
        cands[out] = cands[i];
        w[out] = w[i];
        total += w[i];
        ++out;
      }
    }
    cands.resize(out);
    w.resize(out);
  }

  const double target = UniformDouble(rng_) * total;
  double cum = 0.0;
  for (size_t i = 0; i < cands.size(); ++i) {
    cum += w[i];
    if (cum > target) return cands[i].id;
  }
  // Rounding left target at or above the running sum: take the last token with weight.
  for (size_t i = cands.size(); i-- > 0;) {
    if (w[i] > 0.0f) return cands[i].id;
  }
  return Argmax(logits);
}

sampling_internal::Candidate Sampler::NucleusEnd(double target, float max_logit, float inv_t) {
  // The nucleus is the shortest best-first prefix whose weight reaches target. Sorting 150k
  // candidates per token would cost milliseconds, so bucket them by tempered distance from the
  // best logit (weight = exp(-distance)), find the bucket where the running mass crosses the
  // target, and sort only that bucket. Buckets are 1/64 wide and cover distances up to 32
  // (weight 1e-14); everything farther shares the last bucket.
  constexpr int kPerUnit = 64;
  constexpr int kBuckets = 32 * kPerUnit + 1;
  bucket_mass_.assign(kBuckets, 0.0);
  bucket_of_.resize(cands_.size());
  for (size_t i = 0; i < cands_.size(); ++i) {
    const float dist = (max_logit - cands_[i].logit) * inv_t;
    const int b = dist < static_cast<float>(kBuckets - 1) / kPerUnit
                      ? static_cast<int>(dist * kPerUnit)
                      : kBuckets - 1;
    bucket_of_[i] = static_cast<uint16_t>(b);
    bucket_mass_[static_cast<size_t>(b)] += weights_[i];
  }
  double cum = 0.0;
  for (int b = 0; b < kBuckets; ++b) {
    const double mass = bucket_mass_[static_cast<size_t>(b)];
    if (mass == 0.0 || (cum + mass < target && b != kBuckets - 1)) {
      cum += mass;
      continue;
    }
    // The crossing happens inside bucket b: walk it best-first.
    scratch_.clear();
    for (size_t i = 0; i < cands_.size(); ++i) {
      if (bucket_of_[i] == b) scratch_.push_back(cands_[i]);
    }
    std::sort(scratch_.begin(), scratch_.end(), Before);
    for (const Cand& c : scratch_) {
      cum += std::exp((c.logit - max_logit) * inv_t);
      if (cum >= target) return c;
    }
    if (b == kBuckets - 1) return scratch_.back();
  }
  // Rounding kept the running mass just under target: keep everyone. Any candidate ranked
  // last works as the cut-off; the worst is found without sorting.
  return *std::max_element(cands_.begin(), cands_.end(), Before);
}

namespace {

// Length of the longest suffix of `text` that is a proper prefix of some stop string: the
// text that must be held back because the next token could complete a stop string.
size_t HoldLength(std::string_view text, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const std::string& s : stops) {
    if (s.empty()) continue;
    const size_t max_len = std::min(text.size(), s.size() - 1);
    for (size_t len = max_len; len > hold; --len) {
      if (text.substr(text.size() - len) == std::string_view(s).substr(0, len)) {
        hold = len;
        break;
      }
    }
  }
  return hold;
}

}  // namespace

std::string StopChecker::Push(int32_t id, std::string_view text, bool is_eog) {
  if (reason_ != FinishReason::kNone) return {};
  ++generated_;
  const bool stop_id =
      std::find(p_.stop_token_ids.begin(), p_.stop_token_ids.end(), id) != p_.stop_token_ids.end();
  if (stop_id || (is_eog && !p_.ignore_eos)) {
    // The stop token's own text is not part of the completion; text held for a stop string
    // that now cannot complete is.
    reason_ = FinishReason::kStop;
    return std::exchange(held_, {});
  }
  held_.append(text);

  // Earliest stop-string occurrence wins. Anything that could start a stop string was held,
  // so searching only the held text finds every occurrence.
  size_t cut = std::string::npos;
  for (const std::string& s : p_.stop_strings) {
    if (!s.empty()) cut = std::min(cut, held_.find(s));
  }
  if (cut != std::string::npos) {
    reason_ = FinishReason::kStop;
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  if (generated_ >= p_.max_tokens) {
    reason_ = FinishReason::kLength;
    return std::exchange(held_, {});
  }
  const size_t hold = HoldLength(held_, p_.stop_strings);
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopChecker::Flush() { return std::exchange(held_, {}); }

}  // namespace tandem::engine
