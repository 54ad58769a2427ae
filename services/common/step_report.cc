#include "services/common/step_report.h"

#include <pthread.h>
#include <sched.h>

namespace tandem::services {

StepReporter::~StepReporter() {
  // A measurement still running is starved of CPU by SCHED_IDLE whenever the machine is busy:
  // have it stop rather than wait for idle time that may not come.
  cancel_ = true;
  if (measure_.joinable()) measure_.join();
}

void StepReporter::MeasurePeaksInBackground(int32_t threads) {
  measure_ = std::thread([this, threads] {
    // The measuring threads inherit this policy (pthreads' default, PTHREAD_INHERIT_SCHED).
    sched_param none{};
    (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &none);
    const engine::DevicePeaks measured = engine::MeasureCpuPeaks(threads, &cancel_);
    absl::MutexLock l(&mu_);
    if (peaks_.read_gbs <= 0) peaks_.read_gbs = measured.read_gbs;
    if (peaks_.gflops <= 0) peaks_.gflops = measured.gflops;
    snapshot_.set_peak_read_gbs(peaks_.read_gbs);
    snapshot_.set_peak_gflops(peaks_.gflops);
  });
}

void StepReporter::Update(const engine::Engine& e,
                          const std::function<std::vector<std::string>()>& request_ids) {
  if (e.steps() == seen_) return;
  seen_ = e.steps();
  const engine::Engine::StepRecord& s = e.last_step();
  if (tracer_ != nullptr) {
    const int64_t end = trace::Tracer::NowMicros();
    nlohmann::json args = {{"prefill_tokens", s.shape.prefill_tokens},
                           {"decode_seqs", s.shape.decode_seqs},
                           {"decode_kv_tokens", s.shape.decode_kv_tokens},
                           {"bytes", s.work.bytes},
                           {"flops", s.work.flops}};
    if (request_ids) args["requests"] = request_ids();
    tracer_->Complete("step", "engine", end - static_cast<int64_t>(s.seconds * 1e6), end,
                      std::move(args));
  }
  const engine::StepCostModel& m = e.step_cost();
  const engine::StepCostModel::Coefficients c = m.coefficients();
  double mbu = 0, mfu = 0, step_mbu = 0, step_mfu = 0;
  {
    absl::MutexLock l(&mu_);
    if (peaks_.read_gbs > 0) step_mbu = s.work.bytes / s.seconds / (peaks_.read_gbs * 1e9);
    if (peaks_.gflops > 0) step_mfu = s.work.flops / s.seconds / (peaks_.gflops * 1e9);
    bytes_ = kDecay * bytes_ + s.work.bytes;
    flops_ = kDecay * flops_ + s.work.flops;
    seconds_ = kDecay * seconds_ + s.seconds;
    if (peaks_.read_gbs > 0) mbu = bytes_ / seconds_ / (peaks_.read_gbs * 1e9);
    if (peaks_.gflops > 0) mfu = flops_ / seconds_ / (peaks_.gflops * 1e9);
    v1::StepCost& out = snapshot_;
    out.set_device(device_);
    out.set_intercept_s(c.intercept_s);
    out.set_prefill_token_s(c.prefill_token_s);
    out.set_decode_seq_s(c.decode_seq_s);
    out.set_decode_kv_token_s(c.decode_kv_token_s);
    out.set_steps(static_cast<uint64_t>(m.steps()));
    out.set_relative_rmse(m.relative_rmse());
    out.set_mbu(mbu);
    out.set_mfu(mfu);
    out.set_peak_read_gbs(peaks_.read_gbs);
    out.set_peak_gflops(peaks_.gflops);
  }
  if (metrics_ != nullptr) {
    metrics_->mbu.Set(mbu);
    metrics_->mfu.Set(mfu);
    metrics_->step_seconds.Observe(s.seconds);
    metrics_->step_mbu.Observe(step_mbu);
    metrics_->step_mfu.Observe(step_mfu);
    const engine::ModelConfig& mc = e.model().config();
    const std::vector<int64_t>& routed = e.expert_tokens();
    if (mc.is_moe() && !routed.empty()) {
      std::vector<prometheus::Counter*>& series = metrics_->ExpertTokens(mc.n_layer, mc.n_expert);
      expert_seen_.resize(routed.size(), 0);
      for (size_t i = 0; i < routed.size() && i < series.size(); ++i) {
        if (routed[i] > expert_seen_[i]) series[i]->Increment(double(routed[i] - expert_seen_[i]));
        expert_seen_[i] = routed[i];
      }
    }
  }
}

v1::StepCost StepReporter::Snapshot() const {
  absl::MutexLock l(&mu_);
  return snapshot_;
}

}  // namespace tandem::services
