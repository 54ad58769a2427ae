#include "services/common/process_util.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/util/status_util.h"

namespace tandem::services {

absl::StatusOr<std::vector<int>> ParseCpuList(std::string_view list) {
  std::vector<int> out;
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("bad CPU list \"", std::string(list), "\": use e.g. 0-3,6"));
  };
  for (absl::string_view part : absl::StrSplit(absl::string_view(list.data(), list.size()), ',')) {
    std::vector<absl::string_view> ends = absl::StrSplit(part, '-');
    int lo = 0, hi = 0;
    if (ends.size() == 1) {
      if (!absl::SimpleAtoi(ends[0], &lo)) return bad();
      hi = lo;
    } else if (ends.size() == 2) {
      if (!absl::SimpleAtoi(ends[0], &lo) || !absl::SimpleAtoi(ends[1], &hi)) return bad();
    } else {
      return bad();
    }
    if (lo < 0 || hi < lo || hi >= CPU_SETSIZE) return bad();
    for (int c = lo; c <= hi; ++c) out.push_back(c);
  }
  if (out.empty()) return bad();
  return out;
}

absl::Status PinToCpus(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    return util::FromErrno(errno, "sched_setaffinity");
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return util::FromErrno(errno, absl::StrCat("open ", tmp));
    f << contents;
    f.flush();
    if (!f) return util::FromErrno(errno, absl::StrCat("write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return util::FromErrno(errno, absl::StrCat("rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

namespace {
sigset_t TerminationSignals() {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGTERM);
  sigaddset(&s, SIGINT);
  return s;
}
}  // namespace

void BlockTerminationSignals() {
  sigset_t s = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &s, nullptr);
}

int WaitForTerminationSignal() {
  sigset_t s = TerminationSignals();
  int sig = 0;
  while (sigwait(&s, &sig) != 0) {
  }
  return sig;
}

int WaitForTerminationSignalFor(int timeout_ms) {
  sigset_t s = TerminationSignals();
  timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
  const int sig = sigtimedwait(&s, nullptr, &ts);
  return sig > 0 ? sig : 0;
}

std::string DefaultWorkerId(std::string_view role) {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "host");
  return absl::StrCat(std::string(role), "-", host, "-", getpid());
}

std::string AdvertisedHost(const std::string& listen_host) {
  if (listen_host.empty() || listen_host == "0.0.0.0" || listen_host == "::" ||
      listen_host == "[::]") {
    return "127.0.0.1";
  }
  return listen_host;
}

}  // namespace tandem::services
