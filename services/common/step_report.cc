#include "services/common/step_report.h"

namespace tandem::services {

void StepReporter::Update(const engine::Engine& e) {
  if (e.steps() == seen_) return;
  seen_ = e.steps();
  const engine::Engine::StepRecord& s = e.last_step();
  const double step_mbu =
      peaks_.read_gbs > 0 ? s.work.bytes / s.seconds / (peaks_.read_gbs * 1e9) : 0.0;
  const double step_mfu = peaks_.gflops > 0 ? s.work.flops / s.seconds / (peaks_.gflops * 1e9) : 0.0;
  const engine::StepCostModel& m = e.step_cost();
  const engine::StepCostModel::Coefficients c = m.coefficients();
  double mbu = 0, mfu = 0;
  {
    absl::MutexLock l(&mu_);
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
  }
}

v1::StepCost StepReporter::Snapshot() const {
  absl::MutexLock l(&mu_);
  return snapshot_;
}

engine::DevicePeaks WorkerPeaks(double read_gbs, double gflops, int32_t threads) {
  engine::DevicePeaks p;
  if (read_gbs <= 0 || gflops <= 0) p = engine::MeasureCpuPeaks(threads);
  if (read_gbs > 0) p.read_gbs = read_gbs;
  if (gflops > 0) p.gflops = gflops;
  return p;
}

}  // namespace tandem::services
