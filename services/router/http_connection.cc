#include "services/router/http_connection.h"

#include <dirent.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>

namespace tandem::router {
namespace {

bool SameEndpoint(const sockaddr_storage& sa, socklen_t len, const std::string& addr, int port) {
  char host[NI_MAXHOST];
  char serv[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&sa), len, host, sizeof(host), serv,
                  sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return false;
  }
  return addr == host && port == std::atoi(serv);
}

}  // namespace

int FindConnectionSocket(const std::string& remote_addr, int remote_port,
                         const std::string& local_addr, int local_port) {
  if (remote_port <= 0) return -1;
  // Without the local end, the peer alone decides: a client's ip:port is never also the
  // address of a server this process talks to on the same host, as both would be bound there.
  const bool check_local = local_port > 0;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    struct stat st;
    if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage peer{}, self{};
    socklen_t peer_len = sizeof(peer), self_len = sizeof(self);
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0 ||
        getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&self), &self_len) != 0) {
      continue;
    }
    if (SameEndpoint(peer, peer_len, remote_addr, remote_port) &&
        (!check_local || SameEndpoint(self, self_len, local_addr, local_port))) {
      found = static_cast<int>(fd);
      break;
    }
  }
  closedir(dir);
  return found;
}

bool PeerHungUp(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

DisconnectWatcher::DisconnectWatcher(absl::Duration period)
    : period_(period), thread_([this] { Loop(); }) {}

DisconnectWatcher::~DisconnectWatcher() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

uint64_t DisconnectWatcher::Watch(int fd, std::function<void()> on_hangup) {
  if (fd < 0) return 0;
  absl::MutexLock lock(&mu_);
  const uint64_t h = next_handle_++;
  entries_.push_back({h, fd, std::move(on_hangup)});
  return h;
}

void DisconnectWatcher::Unwatch(uint64_t handle) {
  if (handle == 0) return;
  // Callbacks run under mu_, so once this lock is held none of them is running.
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].handle == handle) {
      entries_[i] = std::move(entries_.back());
      entries_.pop_back();
      return;
    }
  }
}

int DisconnectWatcher::watched() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(entries_.size());
}

void DisconnectWatcher::Loop() {
  std::vector<pollfd> fds;
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), period_);
    if (stop_) break;
    fds.clear();
    for (const Entry& e : entries_) fds.push_back({e.fd, POLLRDHUP, 0});
    if (fds.empty() || poll(fds.data(), fds.size(), 0) <= 0) continue;
    // entries_ cannot change while mu_ is held, so fds[i] is still entries_[i].
    for (size_t i = fds.size(); i-- > 0;) {
      if ((fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) == 0) continue;
      std::function<void()> cb = std::move(entries_[i].on_hangup);
      entries_[i] = std::move(entries_.back());
      entries_.pop_back();
      if (cb) cb();
    }
  }
}

}  // namespace tandem::router
