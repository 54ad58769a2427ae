#include "services/common/trace_flags.h"

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"

namespace tandem::services {

void AddTraceFlags(CLI::App* app, TraceFlags* f) {
  app->add_option("--trace", f->path,
                  "Write a Chrome/Perfetto JSON trace of engine steps, KV transfers and RPCs "
                  "to this file (merge services' files with `tandem trace merge`)");
  app->add_option("--trace-max-mb", f->max_mb,
                  "Stop recording once the trace file reaches this size");
}

absl::StatusOr<std::unique_ptr<trace::Tracer>> OpenTrace(const TraceFlags& f,
                                                         const std::string& process_name) {
  if (f.path.empty()) return std::unique_ptr<trace::Tracer>();
  if (f.max_mb <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--trace-max-mb must be positive, got ", f.max_mb));
  }
  trace::TracerOptions o;
  o.path = f.path;
  o.process_name = process_name;
  o.max_bytes = f.max_mb << 20;
  return trace::Tracer::Create(o);
}

}  // namespace tandem::services
