#include "services/router/slo.h"

#include <algorithm>
#include <limits>

namespace tandem::router {
namespace {

bool Fitted(const v1::StepCost& c) {
  return c.steps() >= kMinFittedSteps && c.prefill_token_s() > 0 && c.intercept_s() >= 0;
}

double BacklogSeconds(const WorkerRegistry::Load& l) {
  return l.backlog_requests * l.cost.intercept_s() + l.backlog_tokens * l.cost.prefill_token_s();
}

}  // namespace

TtftPrediction PredictTtft(const std::vector<WorkerRegistry::Load>& pool, int64_t ahead_tokens,
                           int ahead_requests, int64_t tokens, double overhead_s) {
  TtftPrediction p;
  int n = 0;
  double backlog = 0, intercept = 0, per_token = 0;
  for (const WorkerRegistry::Load& l : pool) {
    if (!Fitted(l.cost)) continue;
    ++n;
    backlog += BacklogSeconds(l);
    intercept += l.cost.intercept_s();
    per_token += l.cost.prefill_token_s();
  }
  if (n == 0) return p;
  intercept /= n;  // the pool's mean worker
  per_token /= n;
  p.known = true;
  p.backlog_s = (backlog + ahead_requests * intercept + ahead_tokens * per_token) / n;
  p.own_s = intercept + tokens * per_token;
  p.seconds = p.backlog_s + p.own_s + std::max(0.0, overhead_s);
  return p;
}

double LeastBacklogSeconds(const std::vector<WorkerRegistry::Load>& pool) {
  double least = std::numeric_limits<double>::infinity();
  for (const WorkerRegistry::Load& l : pool) {
    if (Fitted(l.cost)) least = std::min(least, BacklogSeconds(l));
  }
  return least == std::numeric_limits<double>::infinity() ? 0 : least;
}

double SloTracker::overhead_s() const {
  absl::MutexLock l(&mu_);
  return overhead_s_;
}

void SloTracker::Observe(double predicted_s, double measured_s) {
  const double residual = std::clamp(measured_s - predicted_s, 0.0, kMaxOverheadS);
  absl::MutexLock l(&mu_);
  overhead_s_ = seen_ ? (1 - kWeight) * overhead_s_ + kWeight * residual : residual;
  seen_ = true;
}

}  // namespace tandem::router
