// A worker's engine steps, turned into what it reports: the step cost model and utilisation in
// its WorkerStats (so the router sees them with every heartbeat) and the utilisation series on
// /metrics.
//
// Threading: Update runs on the engine thread after each of its turns; Snapshot from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/trace/trace.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/step_cost.h"
#include "services/common/metrics.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::services {

class StepReporter {
 public:
  // `metrics` and `tracer` may be null. Peaks of 0 leave MBU or MFU at 0. With a tracer every
  // step is a slice named "step" on the engine thread's track.
  StepReporter(engine::DevicePeaks peaks, std::string device, UtilizationMetrics* metrics,
               trace::Tracer* tracer = nullptr)
      : peaks_(peaks), device_(std::move(device)), metrics_(metrics), tracer_(tracer) {}
  // Stops a measurement still running and waits for it.
  ~StepReporter();

  // Measures the peaks that are still 0 on the CPU with `threads` threads, in a thread of its
  // own at SCHED_IDLE priority: it takes only CPU time nothing else wants, so a worker starting
  // beside busy ones (a new pod while a node serves) neither delays its start nor slows them.
  // Until it is done, MBU and MFU read 0.
  void MeasurePeaksInBackground(int32_t threads);

  // Records the engine's last step if it ran one since the previous call (a worker's turn runs
  // at most one step of its engine). `request_ids`, called only when tracing, names the
  // requests the step carried, for the trace.
  void Update(const engine::Engine& e,
              const std::function<std::vector<std::string>()>& request_ids = {});
  v1::StepCost Snapshot() const;

  // Recent steps weigh more: sums decay by this per step.
  static constexpr double kDecay = 0.9;

 private:
  engine::DevicePeaks peaks_ ABSL_GUARDED_BY(mu_);
  const std::string device_;
  UtilizationMetrics* const metrics_;
  std::vector<int64_t> expert_seen_;  // the engine's expert_tokens() at the last Update
  trace::Tracer* const tracer_;
  int64_t seen_ = 0;  // engine thread only
  mutable absl::Mutex mu_;
  std::thread measure_;
  std::atomic<bool> cancel_{false};
  v1::StepCost snapshot_ ABSL_GUARDED_BY(mu_);
  double bytes_ ABSL_GUARDED_BY(mu_) = 0, flops_ ABSL_GUARDED_BY(mu_) = 0,
         seconds_ ABSL_GUARDED_BY(mu_) = 0;
};


}  // namespace tandem::services
