#include "engine/spec/proposer.h"

#include <algorithm>
#include <cmath>

#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "engine/model/model.h"

namespace tandem::engine {

std::string_view SpecMethodName(SpecMethod m) {
  switch (m) {
    case SpecMethod::kNgram:
      return "ngram";
    case SpecMethod::kSelf:
      return "self";
    case SpecMethod::kDraft:
      return "draft";
    case SpecMethod::kOff:
      break;
  }
  return "off";
}

std::string SpecHandshake(const SpeculativeOptions& o) {
  switch (o.method) {
    case SpecMethod::kSelf:
      return absl::StrCat("self:", std::string(kernels::Traits(o.self_type).name));
    case SpecMethod::kDraft:
      // The file name, not the path: pods mount the same model at different paths.
      return absl::StrCat("draft:", std::filesystem::path(o.draft_path).filename().string());
    default:
      return std::string(SpecMethodName(o.method));
  }
}

absl::StatusOr<SpeculativeOptions> ParseSpeculative(std::string_view spec, int32_t k) {
  SpeculativeOptions o;
  if (k < 1 || k > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("--spec-tokens must be in [1, 16], got ", k));
  }
  o.max_draft = k;
  if (spec.empty() || spec == "off") return o;
  if (spec == "ngram") {
    o.method = SpecMethod::kNgram;
    return o;
  }
  if (spec.starts_with("self:") || spec.starts_with("draft:")) {
    const std::string_view arg = spec.substr(spec.find(':') + 1);
    if (arg.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--speculative ", std::string(spec), " names no ",
                       spec.starts_with("self:") ? "type" : "draft model"));
    }
    if (spec.starts_with("draft:")) {
      o.method = SpecMethod::kDraft;
      o.draft_path = std::string(arg);
      return o;
    }
    const std::optional<kernels::DType> type = kernels::DTypeFromName(arg);
    if (!type || !IsWeightType(*type)) {
      return absl::InvalidArgumentError(absl::StrCat("--speculative ", std::string(spec), ": '",
                                                     std::string(arg), "' is not a weight type (",
                                                     kWeightTypes, ")"));
    }
    o.method = SpecMethod::kSelf;
    o.self_type = *type;
    return o;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown --speculative '", std::string(spec), "' (off, ngram, self:TYPE or draft:PATH)"));
}

NgramProposer::NgramProposer(int32_t ngram_min, int32_t ngram_max)
    : min_(std::max(1, ngram_min)), max_(std::max(std::max(1, ngram_min), ngram_max)) {}

void NgramProposer::Propose(std::span<const int32_t> tokens, int32_t max_draft,
                            std::vector<int32_t>* draft) {
  draft->clear();
  const int64_t len = static_cast<int64_t>(tokens.size());
  if (max_draft <= 0) return;
  for (int64_t n = std::min<int64_t>(max_, len - 1); n >= min_; --n) {
    const std::span<const int32_t> suffix = tokens.subspan(len - n);
    // Latest start i < len - n whose n tokens equal the suffix (the suffix itself excluded).
    for (int64_t i = len - n - 1; i >= 0; --i) {
      if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + i)) continue;
      const int64_t from = i + n;
      const int64_t to = std::min(len, from + max_draft);
      draft->assign(tokens.begin() + from, tokens.begin() + to);
      return;
    }
  }
}

absl::Status Proposer::ProposeBatch(std::span<const DraftSlot> slots) {
  for (const DraftSlot& s : slots) Propose(s.tokens, s.max_draft, s.draft);
  return absl::OkStatus();
}

std::unique_ptr<Proposer> MakeProposer(const SpeculativeOptions& o) {
  switch (o.method) {
    case SpecMethod::kNgram:
      return std::make_unique<NgramProposer>(o.ngram_min, o.ngram_max);
    case SpecMethod::kSelf:
    case SpecMethod::kDraft:
    case SpecMethod::kOff:
      break;
  }
  return nullptr;
}

SpecCostModel::SpecCostModel(const SpeculativeOptions& o)
    : prior_verify_(o.verify_cost),
      prior_draft_(o.draft_cost),
      fits_(static_cast<size_t>(std::clamp(o.max_batch, 1, kMaxBatch)) + 1) {}

const SpecCostModel::Fit& SpecCostModel::at(int32_t decoding) const {
  return fits_[static_cast<size_t>(std::clamp<int64_t>(decoding, 1, fits_.size() - 1))];
}

SpecCostModel::Fit& SpecCostModel::at(int32_t decoding) {
  return fits_[static_cast<size_t>(std::clamp<int64_t>(decoding, 1, fits_.size() - 1))];
}

void SpecCostModel::ObserveStep(int32_t decoding, int32_t drafts, double seconds) {
  if (decoding <= 0 || seconds <= 0) return;
  Fit& f = at(decoding);
  const double x = drafts;
  f.w = kForget * f.w + 1;
  f.x = kForget * f.x + x;
  f.y = kForget * f.y + seconds;
  f.xx = kForget * f.xx + x * x;
  f.xy = kForget * f.xy + x * seconds;
  f.since_plain = drafts == 0 ? 0 : f.since_plain + 1;
}

bool SpecCostModel::WantsPlainStep(int32_t decoding) const {
  const Fit& f = at(decoding);
  double alpha = 0, beta = 0;
  return f.since_plain >= kCalibrateEvery && !Solve(f, &alpha, &beta);
}

void SpecCostModel::ObserveDraftStep(int32_t decoding, double step_seconds) {
  if (decoding <= 0 || step_seconds <= 0) return;
  Fit& f = at(decoding);
  f.draft_step = f.draft_step == 0 ? step_seconds : 0.8 * f.draft_step + 0.2 * step_seconds;
}

bool SpecCostModel::Solve(const Fit& f, double* alpha, double* beta) {
  if (f.w < 4) return false;
  const double mx = f.x / f.w;
  const double my = f.y / f.w;
  const double var = f.xx / f.w - mx * mx;
  // K must have varied (by about one draft token or more) for the slope to mean anything.
  if (var < 0.2) return false;
  *beta = std::max(0.0, (f.xy / f.w - mx * my) / var);
  *alpha = my - *beta * mx;
  return *alpha > 0;
}

double SpecCostModel::verify_cost(int32_t decoding) const {
  double alpha = 0, beta = 0;
  const double b = std::max(1, decoding);
  // The prior is a one-sequence figure; a draft token for each of B sequences is priced as B of
  // them, which errs on the side of not drafting in a batch that has not been measured yet.
  if (!Solve(at(decoding), &alpha, &beta)) return std::min(kMaxCost, b * prior_verify_);
  return std::min(kMaxCost, b * beta / alpha);
}

double SpecCostModel::draft_cost(int32_t decoding) const {
  const Fit& f = at(decoding);
  double alpha = 0, beta = 0;
  if (f.draft_step <= 0) return prior_draft_;
  // A plain step's time: the fit's intercept, or the mean step time when K never varied.
  if (!Solve(f, &alpha, &beta)) {
    if (f.w < 4 || f.x > 0) return prior_draft_;
    alpha = f.y / f.w;
  }
  return std::min(kMaxCost, f.draft_step / alpha);
}

int32_t DraftLength::Next() { return Next(o_.verify_cost + o_.draft_cost); }

int32_t DraftLength::Next(double draft_token_cost) {
  if (o_.method == SpecMethod::kOff || o_.max_draft <= 0) return 0;
  if (!o_.adaptive) return o_.max_draft;
  const double a = std::clamp(acceptance(), 0.0, 0.999);
  int32_t best = 0;
  double best_rate = 1.0;  // k = 0: one token per one-token step
  double expected = 1.0;   // 1 + a + ... + a^k
  double pow = 1.0;
  for (int32_t k = 1; k <= o_.max_draft; ++k) {
    pow *= a;
    expected += pow;
    const double rate = expected / (1.0 + draft_token_cost * k);
    if (rate > best_rate) {
      best_rate = rate;
      best = k;
    }
  }
  probing_ = false;
  if (best > 0) {
    idle_steps_ = 0;
    probe_every_ = kProbeEvery;
    return best;
  }
  if (o_.draft_cost > 0) return 0;
  if (++idle_steps_ >= probe_every_) {
    idle_steps_ = 0;
    probing_ = true;
    return 1;
  }
  return 0;
}

void DraftLength::Record(int32_t drafted, int32_t accepted) {
  if (drafted <= 0) return;
  if (probing_) {
    probe_every_ = accepted > 0 ? kProbeEvery : std::min(2 * probe_every_, kMaxProbeEvery);
    probing_ = false;
  }
  // Older steps weigh less, so the estimate follows a sequence whose text changes character.
  constexpr double kKeep = 0.9;
  hits_ = kKeep * hits_ + accepted;
  trials_ = kKeep * trials_ + accepted + (accepted < drafted ? 1 : 0);
}

}  // namespace tandem::engine
