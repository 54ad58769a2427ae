// Whether a worker's engine loop is alive, for the watchdog in ServeWorker (worker_main.h).
//
// The loop says when it goes to sleep with nothing to do (Idle) and when it starts a turn of
// work (Working): commands, an engine step, finishing requests. A loop that has been working on
// one turn for longer than a limit is wedged (a step that never returns, a deadlock, a frozen
// device): the watchdog then reports the worker NOT_SERVING, so the router stops choosing it and
// the liveness probe has the pod restarted. A loop asleep is never wedged, however long it
// sleeps, whatever waits for admission.
//
// Threading: Idle and Working on the loop's thread; BusyFor anywhere. Lock-free.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tandem::services {

class LoopLiveness {
 public:
  void Idle() { since_ns_.store(kIdle, std::memory_order_release); }
  // Each turn restarts the clock: a loop that keeps turning is alive however busy it is.
  void Working() { since_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_release); }
  // How long the current turn has run; zero while the loop sleeps.
  absl::Duration BusyFor(absl::Time now) const {
    const int64_t since = since_ns_.load(std::memory_order_acquire);
    if (since == kIdle) return absl::ZeroDuration();
    return std::max(absl::ZeroDuration(), now - absl::FromUnixNanos(since));
  }

 private:
  static constexpr int64_t kIdle = INT64_MIN;
  std::atomic<int64_t> since_ns_{kIdle};
};

}  // namespace tandem::services
