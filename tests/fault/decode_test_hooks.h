// The decode worker's test hooks, registered only by its test twin tandem-decode-test-hooks
// (tests/fault/CMakeLists.txt builds services/decode/main.cc with TANDEM_DECODE_TEST_HOOKS,
// which includes this header). The product binaries never take these flags.
//   --test-wedge-after-steps N   after N engine iterations with work, the engine thread blocks
//                                for good (a wedged step: a deadlock, a hung device), so a test
//                                can watch the liveness watchdog see it.
#pragma once

#include <atomic>
#include <functional>
#include <memory>

#include "CLI/CLI.hpp"
#include "absl/time/clock.h"

namespace tandem::testing {

inline void AddDecodeTestHooks(CLI::App& app, int* wedge_after_steps) {
  app.add_option("--test-wedge-after-steps", *wedge_after_steps,
                 "block the engine thread for good after this many steps (0: never)")
      ->check(CLI::NonNegativeNumber);
}

// The before_step hook of --test-wedge-after-steps N (N > 0).
inline std::function<void()> WedgeAfterSteps(int n) {
  auto steps = std::make_shared<std::atomic<int>>(0);
  return [steps, n] {
    if (steps->fetch_add(1) < n) return;
    for (;;) absl::SleepFor(absl::Seconds(1));
  };
}

}  // namespace tandem::testing
