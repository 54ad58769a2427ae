#include "services/router/router_metrics.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/router/plan.h"

namespace tandem::router {
namespace {

double Seconds(absl::Duration d) { return std::max(0.0, absl::ToDoubleSeconds(d)); }

}  // namespace

const char* FinishReasonLabel(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    default:
      return "error";
  }
}

RouterMetrics::RouterMetrics(services::Metrics* metrics, const std::string& model_name,
                             const AutoscaleOptions& autoscale)
    : metrics_(metrics),
      serving_(metrics->Serving(model_name, "router")),
      model_name_(model_name),
      autoscale_(autoscale),
      started_(absl::Now()),
      ttft_(autoscale.window),
      itl_(autoscale.window),
      prompt_tokens_(autoscale.window),
      output_tokens_(autoscale.window),
      prefill_tokens_(autoscale.window),
      prefill_seconds_(autoscale.window) {
  auto& breakdown = prometheus::BuildHistogram()
                        .Name(absl::StrCat(services::kMetricPrefix, "ttft_breakdown_seconds"))
                        .Help("Where the router's time to first token went, by stage.")
                        .Register(metrics_->registry());
  for (size_t i = 0; i < kTtftStages.size(); ++i) {
    stages_[i] =
        &breakdown.Add({{"model_name", model_name}, {"role", "router"}, {"stage", kTtftStages[i]}},
                       services::TtftBuckets());
  }
  auto& replicas = prometheus::BuildGauge()
                       .Name(absl::StrCat(services::kMetricPrefix, "recommended_replicas"))
                       .Help(
                           "Workers each pool should have to meet the TTFT and ITL targets (see "
                           "docs/cluster.md).")
                       .Register(metrics_->registry());
  recommended_prefill_ = &replicas.Add({{"model_name", model_name}, {"role", "prefill"}});
  recommended_decode_ = &replicas.Add({{"model_name", model_name}, {"role", "decode"}});
  prefix_index_blocks_ =
      &prometheus::BuildGauge()
           .Name(absl::StrCat(services::kMetricPrefix, "prefix_index_blocks"))
           .Help(
               "Prompt block hashes the router's prefix index tracks (kv-aware policy), bounded "
               "by twice the prefill workers' KV blocks.")
           .Register(metrics_->registry())
           .Add({{"model_name", model_name}, {"role", "router"}});
  slo_rejected_ = &prometheus::BuildCounter()
                       .Name(absl::StrCat(services::kMetricPrefix, "slo_rejected_total"))
                       .Help("Requests refused for their time to first token target: at arrival "
                             "(predicted past it) or in the queue (no longer reachable).")
                       .Register(metrics_->registry());
  for (const char* p : {"interactive", "standard", "batch"}) {
    slo_rejected_->Add({{"model_name", model_name}, {"role", "router"}, {"priority", p}});
  }
  auto& sessions = prometheus::BuildCounter()
                       .Name(absl::StrCat(services::kMetricPrefix, "session_requests_total"))
                       .Help("Disaggregated requests with a session id, by whether their decode "
                             "worker already held part of the prompt's KV.")
                       .Register(metrics_->registry());
  session_held_ = &sessions.Add({{"model_name", model_name}, {"role", "router"}, {"held", "yes"}});
  session_missed_ = &sessions.Add({{"model_name", model_name}, {"role", "router"}, {"held", "no"}});
  held_tokens_ = &prometheus::BuildCounter()
                      .Name(absl::StrCat(services::kMetricPrefix, "decode_held_tokens_total"))
                      .Help("Prompt tokens whose KV the decode worker already held (an earlier "
                            "turn), so prefill did not send it.")
                      .Register(metrics_->registry())
                      .Add({{"model_name", model_name}, {"role", "router"}});
}

void RouterMetrics::RecordHandoff(bool with_session, int held_tokens, uint64_t bytes) {
  serving_.kv_transfer_bytes.Observe(static_cast<double>(bytes));
  if (held_tokens > 0) held_tokens_->Increment(held_tokens);
  if (with_session) (held_tokens > 0 ? session_held_ : session_missed_)->Increment();
}

void RouterMetrics::RecordSloRejected(const std::string& priority) {
  slo_rejected_->Add({{"model_name", model_name_}, {"role", "router"}, {"priority", priority}})
      .Increment();
}

void RouterMetrics::RecordAdmitted(absl::Duration queue) {
  serving_.request_queue_time.Observe(Seconds(queue));
}

void RouterMetrics::RecordPrefill(int prompt_tokens, double compute_seconds) {
  if (prompt_tokens <= 0 || compute_seconds <= 0) return;
  const absl::Time now = absl::Now();
  absl::MutexLock l(&mu_);
  prefill_tokens_.Add(now, prompt_tokens);
  prefill_seconds_.Add(now, compute_seconds);
}

void RouterMetrics::RecordFirstToken(absl::Time at, absl::Duration ttft,
                                     const v1::TtftBreakdown& b) {
  serving_.time_to_first_token.Observe(Seconds(ttft));
  const double values[kTtftStages.size()] = {b.queue(),
                                             b.prefill_compute(),
                                             b.kv_transfer(),
                                             b.prefix_onboarding_tiers().device(),
                                             b.prefix_onboarding_tiers().host(),
                                             b.prefix_onboarding_tiers().ssd(),
                                             b.first_decode_step()};
  for (size_t i = 0; i < kTtftStages.size(); ++i) stages_[i]->Observe(std::max(0.0, values[i]));
  absl::MutexLock l(&mu_);
  ttft_.Add(at, Seconds(ttft));
}

void RouterMetrics::RecordInterToken(absl::Time at, absl::Duration gap) {
  serving_.inter_token_latency.Observe(Seconds(gap));
  absl::MutexLock l(&mu_);
  itl_.Add(at, Seconds(gap));
}

void RouterMetrics::RecordMigration() { serving_.migrations.Increment(); }

void RouterMetrics::RecordEnd(absl::Duration e2e, const std::string& finished_reason,
                              int prompt_tokens, int completion_tokens) {
  serving_.e2e_request_latency.Observe(Seconds(e2e));
  serving_.RequestSuccess(finished_reason).Increment();
  const absl::Time now = absl::Now();
  absl::MutexLock l(&mu_);
  prompt_tokens_.Add(now, std::max(prompt_tokens, 0));
  output_tokens_.Add(now, std::max(completion_tokens, 0));
}

void RouterMetrics::Refresh(int running, int waiting, int prefill_workers, int decode_workers,
                            const std::optional<sim::Costs>& costs, const sim::Topology& shape) {
  serving_.num_requests_running.Set(running);
  serving_.num_requests_waiting.Set(waiting);
  const absl::Time now = absl::Now();
  AutoscaleInputs in;
  in.current_prefill = prefill_workers;
  in.current_decode = decode_workers;
  Recommendation r;
  std::vector<double> prompts, outputs;
  double span = 0;
  {
    absl::MutexLock l(&mu_);
    for (SampleWindow* w :
         {&ttft_, &itl_, &prompt_tokens_, &output_tokens_, &prefill_tokens_, &prefill_seconds_}) {
      w->Expire(now);
    }
    std::vector<double> v = ttft_.Values();
    in.p90_ttft_s = Percentile(v, 0.9);
    v = itl_.Values();
    in.p90_itl_s = Percentile(v, 0.9);
    // Rates over the window, or over the router's life while that is shorter.
    span = std::max(1.0, absl::ToDoubleSeconds(std::min(autoscale_.window, now - started_)));
    in.prompt_tokens_per_s = prompt_tokens_.Sum() / span;
    in.output_tokens_per_s = output_tokens_.Sum() / span;
    const double busy = prefill_seconds_.Sum();
    in.prefill_capacity_tps = autoscale_.prefill_capacity_tps > 0 ? autoscale_.prefill_capacity_tps
                              : busy > 0                          ? prefill_tokens_.Sum() / busy
                                                                  : 0;
    in.decode_capacity_tps = autoscale_.decode_capacity_tps;
    r = Recommend(in, autoscale_);
    last_inputs_ = in;
    if (costs.has_value() && (autoscale_.slo_ttft_s > 0 || autoscale_.slo_itl_s > 0) &&
        prompt_tokens_.size() >= kMinPlanRequests) {
      prompts = prompt_tokens_.Values();
      outputs = output_tokens_.Values();
    }
  }
  if (!prompts.empty()) {
    // The planner simulates outside the lock: requests keep being recorded meanwhile.
    std::optional<Recommendation> p =
        Planned(std::move(prompts), std::move(outputs), span, *costs, shape);
    if (p.has_value()) r = *p;
  }
  {
    absl::MutexLock l(&mu_);
    last_ = r;
  }
  recommended_prefill_->Set(r.prefill);
  recommended_decode_->Set(r.decode);
}

std::optional<Recommendation> RouterMetrics::Planned(std::vector<double> prompts,
                                                    std::vector<double> outputs, double span_s,
                                                    const sim::Costs& costs,
                                                    const sim::Topology& shape) const {
  absl::StatusOr<plan::Workload> w =
      plan::ObservedWorkload(std::move(prompts), std::move(outputs), span_s);
  if (!w.ok()) return std::nullopt;
  plan::Options o;
  o.costs = costs;
  o.shape = shape;
  o.max_workers = std::max(2, autoscale_.max_replicas * 2);  // P + D, each up to the cap
  o.attainment = 0.9;  // the rule's p90
  o.colocated = false;
  absl::StatusOr<plan::Answer> a =
      plan::Plan(*w, plan::Slo{autoscale_.slo_ttft_s, autoscale_.slo_itl_s}, o);
  if (!a.ok() || a->disaggregated.workers() == 0) return std::nullopt;
  const int hi = std::max(autoscale_.min_replicas, autoscale_.max_replicas);
  Recommendation r;
  r.prefill = std::clamp(a->disaggregated.prefill, autoscale_.min_replicas, hi);
  r.decode = std::clamp(a->disaggregated.decode, autoscale_.min_replicas, hi);
  r.planned = true;
  return r;
}

Recommendation RouterMetrics::last_recommendation() const {
  absl::MutexLock l(&mu_);
  return last_;
}

AutoscaleInputs RouterMetrics::last_inputs() const {
  absl::MutexLock l(&mu_);
  return last_inputs_;
}

}  // namespace tandem::router
