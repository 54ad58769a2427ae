// Process plumbing for the worker binaries' main(): CPU pinning, the port file scripts wait for,
// and orderly shutdown on SIGTERM/SIGINT.
//
// Threading: BlockTerminationSignals and PinToCpus act on the calling thread and are inherited
// by threads created afterwards, so main calls them before anything starts a thread.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::services {

// "0-3,6,8-9" -> {0,1,2,3,6,8,9}. INVALID_ARGUMENT for anything else.
absl::StatusOr<std::vector<int>> ParseCpuList(std::string_view list);
// sched_setaffinity on the calling thread (and so on every thread it creates later).
absl::Status PinToCpus(const std::vector<int>& cpus);

// Writes `contents` to path.tmp and renames it over `path`, so a reader never sees a partial
// file.
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents);

// Blocks SIGTERM and SIGINT in the calling thread (and the threads it will create), so that
// WaitForTerminationSignal receives them synchronously instead of a handler interrupting
// arbitrary code.
void BlockTerminationSignals();
// Waits for SIGTERM or SIGINT; returns the signal number.
int WaitForTerminationSignal();
// The same for at most timeout_ms; 0 when none came (or the wait was interrupted).
int WaitForTerminationSignalFor(int timeout_ms);

// "<role>-<hostname>-<pid>": unique per process on a host, readable in logs.
std::string DefaultWorkerId(std::string_view role);
// The host to advertise to the registry for a server listening on `listen_host`: a wildcard
// address ("0.0.0.0", "::", "") is not dialable, so it becomes 127.0.0.1.
std::string AdvertisedHost(const std::string& listen_host);

}  // namespace tandem::services
