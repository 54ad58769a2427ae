// Noticing that an HTTP client went away while its request is still being worked on.
//
// Why: a client that closes its connection mid-generation must free the workers' KV blocks at
// once, as a cancelled gRPC call does. A streaming response notices when a write fails, but
// only at its next token; a non-streaming one, or one still waiting for admission, writes
// nothing until the end. cpp-httplib gives a handler no access to its socket, so
// FindConnectionSocket finds it by the connection's addresses (the TCP 4-tuple is unique among
// open connections): the kernel's socket table (/proc/self/net/tcp, tcp6) gives its inode, and
// /proc/self/fd the descriptor that links to it, without touching any other thread's
// descriptors. DisconnectWatcher polls the watched sockets for a peer hang-up
// (POLLRDHUP / POLLHUP / POLLERR) without reading from them.
//
// Threading: DisconnectWatcher is thread-safe; callbacks run on its own thread, must be quick
// and must not call back into the watcher. Unwatch returns only after any running callback of
// that entry has returned, so the callback's captures may be destroyed right after.
// Ownership: the caller keeps the socket open while it is watched (httplib closes it only
// after the handler and its response's content provider are done).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tandem::router {

// The file descriptor of this process's TCP socket whose peer is remote_addr:remote_port and
// whose local end is local_addr:local_port (addresses in getnameinfo's numeric form, as httplib
// reports them), or -1 when there is none. local_port <= 0: matched on the peer alone.
int FindConnectionSocket(const std::string& remote_addr, int remote_port,
                         const std::string& local_addr, int local_port);

// True when the peer has closed or reset the connection (data still unread does not count).
bool PeerHungUp(int fd);

class DisconnectWatcher {
 public:
  explicit DisconnectWatcher(absl::Duration period = absl::Milliseconds(50));
  ~DisconnectWatcher();
  DisconnectWatcher(const DisconnectWatcher&) = delete;
  DisconnectWatcher& operator=(const DisconnectWatcher&) = delete;

  // Calls on_hangup once, from the watcher thread, when fd's peer hangs up. Returns a handle
  // for Unwatch (0 when fd < 0: nothing is watched).
  uint64_t Watch(int fd, std::function<void()> on_hangup);
  void Unwatch(uint64_t handle);  // a no-op for 0 or an unknown handle
  int watched() const;

 private:
  struct Entry {
    uint64_t handle;
    int fd;
    std::function<void()> on_hangup;
  };
  void Loop();

  const absl::Duration period_;
  mutable absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tandem::router
