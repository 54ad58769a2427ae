// Minimal timestamped logging to stderr for the router (abseil's LOG is not in this abseil
// build). One line per call, written with a single fwrite so concurrent lines do not interleave.
#pragma once

#include <cstdarg>

namespace tandem::router {

void Logf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace tandem::router
