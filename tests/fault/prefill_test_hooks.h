// The prefill worker's test hooks, registered only by its test twin tandem-prefill-test-hooks
// (tests/fault/CMakeLists.txt builds services/prefill/main.cc with TANDEM_PREFILL_TEST_HOOKS,
// which includes this header). The product binaries never take these flags.
//   --test-step-delay-ms N          sleep before every engine step, so a test can act on a
//                                   request while its prefill runs;
//   --test-fault-flip-bit-every N   corrupt one bit of every Nth KV write sent, after its
//                                   checksums were computed (common/transfer/fault_injection.h).
#pragma once

#include "CLI/CLI.hpp"

namespace tandem::testing {

inline void AddPrefillTestHooks(CLI::App& app, int* step_delay_ms, int* flip_bit_every) {
  app.add_option("--test-step-delay-ms", *step_delay_ms, "sleep before every engine step")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--test-fault-flip-bit-every", *flip_bit_every,
                 "corrupt one bit of every Nth KV write sent")
      ->check(CLI::NonNegativeNumber);
}

}  // namespace tandem::testing
