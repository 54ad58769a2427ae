// Test timing under ThreadSanitizer (`make tsan`, scripts/tsan.sh). Instrumented code runs
// several times slower, and an instrumented process takes seconds to exit (it unmaps its shadow
// memory). Waits that bound how soon something must happen go through Scaled(); checks of speed
// or of memory footprint (TSan's shadow memory is in every RSS) are skipped under kUnderTsan.
// Nothing changes in the other builds.
#pragma once

#include "absl/time/time.h"

namespace tandem::testing {

#if defined(__SANITIZE_THREAD__)
inline constexpr bool kUnderTsan = true;
inline constexpr int kTsanSlowdown = 5;
#else
inline constexpr bool kUnderTsan = false;
inline constexpr int kTsanSlowdown = 1;
#endif

inline absl::Duration Scaled(absl::Duration d) { return d * kTsanSlowdown; }

}  // namespace tandem::testing
