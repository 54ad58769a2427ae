// --trace FILE and --trace-max-mb, the same on every tandem service (common/trace/trace.h).
//
// Each main() adds the flags, and after parsing opens the tracer, which it owns and keeps
// alive until its servers have stopped; the services borrow it through their options.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/trace/trace.h"

namespace CLI {
class App;
}

namespace tandem::services {

struct TraceFlags {
  std::string path;
  int64_t max_mb = 512;
};

void AddTraceFlags(CLI::App* app, TraceFlags* f);

// Null when --trace was not given; INVALID_ARGUMENT or FAILED_PRECONDITION for a bad limit or a
// file that cannot be written.
absl::StatusOr<std::unique_ptr<trace::Tracer>> OpenTrace(const TraceFlags& f,
                                                         const std::string& process_name);

}  // namespace tandem::services
