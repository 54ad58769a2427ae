#include "services/router/log.h"

#include <cstdio>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tandem::router {

void Logf(const char* fmt, ...) {
  char body[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(body, sizeof(body), fmt, ap);
  va_end(ap);
  std::string line = absl::FormatTime("%Y-%m-%d %H:%M:%E3S ", absl::Now(), absl::LocalTimeZone());
  line += "[router] ";
  line += body;
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace tandem::router
