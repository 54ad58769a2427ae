// RouterMetrics: what the router records about the requests it serves, as Prometheus series
// labelled role="router" (the DESIGN.md families), plus two router-only families:
//   tandem_ttft_breakdown_seconds{model_name,role="router",stage}  histogram, one series per
//     stage: queue, prefill_compute, kv_transfer, prefix_onboarding_device,
//     prefix_onboarding_host, prefix_onboarding_ssd, first_decode_step;
//   tandem_recommended_replicas{model_name,role}  gauge, role = prefill | decode: for a
//     disaggregated cluster whose workers have fitted their step costs, with an SLO target and
//     at least kMinPlanRequests requests in the window, `tandem plan`'s answer (plan.h) for the
//     window's workload at 90% attainment; otherwise (or when no cluster up to max_replicas meets
//     the targets) autoscale.h's rule over the last AutoscaleOptions::window of observations;
//   tandem_slo_rejected_total{model_name,role="router",priority}  counter: requests refused for
//     their TTFT target (slo.h), at arrival or after waiting past it in the queue, by class;
//   tandem_session_requests_total{model_name,role="router",held}  counter: disaggregated
//     requests with a session id, by whether their decode worker held part of the prompt's KV
//     already (held="yes": a session hit) or not;
//   tandem_decode_held_tokens_total{model_name,role="router"}  counter: prompt tokens whose KV
//     the decode worker held, so prefill did not send it.
// kv_transfer_bytes{role="router"} observes each disaggregated request's prompt KV bytes (one
// turn of a conversation).
// Router semantics: TTFT is arrival at the router -> first token relayed to the client; ITL the
// gaps between relayed messages that carry tokens; e2e arrival -> the end of the call, any
// outcome; queue time arrival -> admission; running/waiting are admission's counts;
// request_success_total counts every admitted-or-refused request that passed validation, by
// finish reason ("error" for a failure status, "cancelled" when the client went away);
// migrations_total counts decode streams moved to another worker mid-request.
//
// Threading: every method is thread-safe (gRPC threads record, the scrape thread refreshes).
// Ownership: borrows the services::Metrics, which must outlive it.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "services/common/metrics.h"
#include "services/router/autoscale.h"
#include "services/router/sim.h"
#include "tandem/v1/inference.pb.h"

namespace tandem::router {

// The stage label values of tandem_ttft_breakdown_seconds, in the order a request meets them.
inline constexpr std::array<const char*, 7> kTtftStages = {"queue",
                                                           "prefill_compute",
                                                           "kv_transfer",
                                                           "prefix_onboarding_device",
                                                           "prefix_onboarding_host",
                                                           "prefix_onboarding_ssd",
                                                           "first_decode_step"};

// Requests the window must hold before the planner answers for it.
inline constexpr size_t kMinPlanRequests = 20;

class RouterMetrics {
 public:
  RouterMetrics(services::Metrics* metrics, const std::string& model_name,
                const AutoscaleOptions& autoscale);

  // A request was admitted after waiting `queue`.
  void RecordAdmitted(absl::Duration queue);
  // A prefill worker reported its compute time for `prompt_tokens` tokens.
  void RecordPrefill(int prompt_tokens, double compute_seconds);
  // The first token reached the client: `ttft` since arrival, split as `b`.
  void RecordFirstToken(absl::Time at, absl::Duration ttft, const v1::TtftBreakdown& b);
  // A later token message reached the client `gap` after the previous one.
  void RecordInterToken(absl::Time at, absl::Duration gap);
  // A disaggregated request's KV handoff: it had a session id or not, decode held
  // `held_tokens` of its prompt, and prefill sent `bytes`.
  void RecordHandoff(bool with_session, int held_tokens, uint64_t bytes);
  // A broken decode stream was moved to another worker (tandem_migrations_total).
  void RecordMigration();
  // A request of class `priority` ("interactive", "standard", "batch") was refused by its
  // predicted TTFT.
  void RecordSloRejected(const std::string& priority);
  // The call ended. finished_reason: one of services::kFinishReasons.
  void RecordEnd(absl::Duration e2e, const std::string& finished_reason, int prompt_tokens,
                 int completion_tokens);

  // Refreshes the gauges (running, waiting, recommended replicas); called before each scrape.
  // Counts are non-draining workers per pool (colocated in both). `costs`: the prefill and decode
  // pools' fitted step costs, when the cluster is disaggregated and both pools have fitted them;
  // with them the recommendation comes from the planner (a few simulations, milliseconds), for
  // workers of `shape` (the workers' registered engine settings; the counts are ignored).
  void Refresh(int running, int waiting, int prefill_workers, int decode_workers,
               const std::optional<sim::Costs>& costs = std::nullopt,
               const sim::Topology& shape = {});

  // Hashes in the router's prefix index (tandem_prefix_index_blocks; kv-aware policy).
  void SetPrefixIndexBlocks(size_t blocks) {
    prefix_index_blocks_->Set(static_cast<double>(blocks));
  }

  // What the last Refresh computed (for tests and logs).
  Recommendation last_recommendation() const;
  AutoscaleInputs last_inputs() const;

 private:
  // The planner's P and D counts for the observed workload; nullopt when it has none.
  std::optional<Recommendation> Planned(std::vector<double> prompts, std::vector<double> outputs,
                                        double span_s, const sim::Costs& costs,
                                        const sim::Topology& shape) const;

  services::Metrics* metrics_;
  services::ServingMetrics& serving_;
  std::array<prometheus::Histogram*, kTtftStages.size()> stages_{};
  prometheus::Gauge* recommended_prefill_ = nullptr;
  prometheus::Gauge* recommended_decode_ = nullptr;
  prometheus::Gauge* prefix_index_blocks_ = nullptr;
  prometheus::Family<prometheus::Counter>* slo_rejected_ = nullptr;
  prometheus::Counter* session_held_ = nullptr;    // held="yes"
  prometheus::Counter* session_missed_ = nullptr;  // held="no"
  prometheus::Counter* held_tokens_ = nullptr;
  const std::string model_name_;
  const AutoscaleOptions autoscale_;
  const absl::Time started_;

  mutable absl::Mutex mu_;
  SampleWindow ttft_ ABSL_GUARDED_BY(mu_);
  SampleWindow itl_ ABSL_GUARDED_BY(mu_);
  SampleWindow prompt_tokens_ ABSL_GUARDED_BY(mu_);   // by the request's end
  SampleWindow output_tokens_ ABSL_GUARDED_BY(mu_);   // by the request's end
  SampleWindow prefill_tokens_ ABSL_GUARDED_BY(mu_);  // tokens prefilled, by report time
  SampleWindow prefill_seconds_ ABSL_GUARDED_BY(mu_);
  Recommendation last_ ABSL_GUARDED_BY(mu_);
  AutoscaleInputs last_inputs_ ABSL_GUARDED_BY(mu_);
};

// A finish reason as request_success_total names it.
const char* FinishReasonLabel(v1::FinishReason r);

}  // namespace tandem::router
