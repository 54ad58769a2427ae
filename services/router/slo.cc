#include "services/router/slo.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace tandem::router {

bool FittedForPrefill(const v1::StepCost& c) {
  return c.steps() >= kMinFittedSteps && c.prefill_token_s() > 0;
}

bool FittedForDecode(const v1::StepCost& c) {
  return c.steps() >= kMinFittedSteps && (c.decode_seq_s() > 0 || c.decode_kv_token_s() > 0);
}

// A least-squares intercept can come out below zero when every step was about the same size
// (a prefill worker seeing one prompt length); a step never costs less than nothing.
double FittedIntercept(const v1::StepCost& c) { return std::max(0.0, c.intercept_s()); }

namespace {

double Work(const WorkerRegistry::Load& l) {
  return l.backlog_requests * FittedIntercept(l.cost) +
         l.backlog_tokens * l.cost.prefill_token_s();
}

}  // namespace

TtftPrediction PredictTtft(const std::vector<WorkerRegistry::Load>& pool, int64_t ahead_tokens,
                           int ahead_requests, int64_t tokens, double correction_s) {
  TtftPrediction p;
  int n = 0;
  double backlog = 0, intercept = 0, per_token = 0;
  for (const WorkerRegistry::Load& l : pool) {
    if (!FittedForPrefill(l.cost)) continue;
    ++n;
    backlog += Work(l);
    intercept += FittedIntercept(l.cost);
    per_token += l.cost.prefill_token_s();
  }
  if (n == 0) return p;
  intercept /= n;  // the pool's mean worker
  per_token /= n;
  p.known = true;
  p.backlog_s = (backlog + ahead_requests * intercept + ahead_tokens * per_token) / n;
  p.own_s = intercept + tokens * per_token;
  p.seconds = std::max(p.own_s, p.backlog_s + p.own_s + correction_s);
  return p;
}

double BacklogSeconds(const WorkerRegistry::Load& worker) {
  return FittedForPrefill(worker.cost) ? Work(worker) : 0;
}

double SloTracker::correction_s() const {
  absl::MutexLock l(&mu_);
  return correction_s_;
}

void SloTracker::Observe(double predicted_s, double measured_s) {
  const double residual = std::clamp(measured_s - predicted_s, -kMaxCorrectionS, kMaxCorrectionS);
  absl::MutexLock l(&mu_);
  if (seen_++ == 0) {
    correction_s_ = residual;
    return;
  }
  // Early on, plain means and large steps (1/n), so a fresh router (or a class just starting
  // to arrive) settles within tens of requests; later the fixed rates take over.
  const double w = std::max(kWeight, 1.0 / static_cast<double>(seen_));
  spread_s_ = (1 - w) * spread_s_ + w * std::abs(residual - correction_s_);
  const double step = std::max(1e-4, std::max(0.1, 2 * w) * spread_s_);
  correction_s_ += residual > correction_s_ ? step * kCorrectionQuantile
                                            : -step * (1 - kCorrectionQuantile);
  correction_s_ = std::clamp(correction_s_, -kMaxCorrectionS, kMaxCorrectionS);
}

}  // namespace tandem::router
