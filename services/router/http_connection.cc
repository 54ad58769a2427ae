#include "services/router/http_connection.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace tandem::router {
namespace {

// An address as /proc/net/tcp{,6} prints it: the address's 32-bit words in host order, each as
// 8 upper-case hex digits, then ":" and the port as 4. IPv4 addresses also get their
// v4-mapped IPv6 form (a dual-stack listener's connections are in tcp6). Empty when unparsable.
std::vector<std::string> ProcNetForms(const std::string& addr, int port) {
  std::vector<std::string> out;
  unsigned char b[16] = {};
  const auto words = [&](int n) {
    std::string s;
    for (int i = 0; i < n; ++i) {
      uint32_t w;
      std::memcpy(&w, b + 4 * i, 4);
      char hex[9];
      std::snprintf(hex, sizeof(hex), "%08X", w);
      s += hex;
    }
    char p[6];
    std::snprintf(p, sizeof(p), ":%04X", port & 0xFFFF);
    return s + p;
  };
  if (inet_pton(AF_INET, addr.c_str(), b) == 1) {
    out.push_back(words(1));
    std::memmove(b + 12, b, 4);
    std::memset(b, 0, 10);
    b[10] = b[11] = 0xFF;
    out.push_back(words(4));
  } else if (inet_pton(AF_INET6, addr.c_str(), b) == 1) {
    out.push_back(words(4));
  }
  return out;
}

// The inode of the TCP socket with these endpoints (local_port <= 0: any local end), 0 if none.
uint64_t SocketInode(const std::string& remote_addr, int remote_port, const std::string& local_addr,
                     int local_port) {
  const std::vector<std::string> rem = ProcNetForms(remote_addr, remote_port);
  const std::vector<std::string> loc =
      local_port > 0 ? ProcNetForms(local_addr, local_port) : std::vector<std::string>{};
  if (rem.empty() || (local_port > 0 && loc.empty())) return 0;
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream f(table);
    std::string line;
    std::getline(f, line);  // the header
    while (std::getline(f, line)) {
      // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
      std::istringstream in(line);
      std::string sl, local, remote, st, queues, timer, retr, uid, timeout;
      uint64_t inode = 0;
      if (!(in >> sl >> local >> remote >> st >> queues >> timer >> retr >> uid >> timeout >>
            inode)) {
        continue;
      }
      const auto any = [](const std::vector<std::string>& forms, const std::string& v) {
        for (const std::string& f : forms) {
          if (f == v) return true;
        }
        return false;
      };
      if (inode != 0 && any(rem, remote) && (local_port <= 0 || any(loc, local))) return inode;
    }
  }
  return 0;
}

}  // namespace

int FindConnectionSocket(const std::string& remote_addr, int remote_port,
                         const std::string& local_addr, int local_port) {
  if (remote_port <= 0) return -1;
  // The kernel's socket tables name the connection's inode; the descriptor is then the entry
  // of /proc/self/fd that links to it. Only names are read: no call touches a descriptor of
  // this process other than the one found, since other threads open and close theirs
  // meanwhile. (Without the local end, the peer alone decides: a client's ip:port is never
  // also the address of a server this process talks to on the same host, as both would be
  // bound there.)
  const uint64_t inode = SocketInode(remote_addr, remote_port, local_addr, local_port);
  if (inode == 0) return -1;
  const std::string want = "socket:[" + std::to_string(inode) + "]";
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), last; !ec && it != last;
       it.increment(ec)) {
    std::error_code link_ec;
    const std::filesystem::path target = std::filesystem::read_symlink(it->path(), link_ec);
    if (link_ec || target.native() != want) continue;
    char* end = nullptr;
    const std::string name = it->path().filename().string();
    const long fd = std::strtol(name.c_str(), &end, 10);
    if (end != name.c_str() && *end == '\0') return static_cast<int>(fd);
  }
  return -1;
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
