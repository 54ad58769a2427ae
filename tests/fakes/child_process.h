// A tandem binary run as a child process for tests: argv and the log path are built before
// fork (the test process has threads, so the child only makes async-signal-safe calls until
// exec), stdout and stderr go to the log file, and a child still running when the object dies
// is killed (SIGKILL) and reaped, so a failing test leaks no process.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tandem::testing {

class ChildProcess {
 public:
  // binary: a file name in TANDEM_BIN_DIR (the build's bin folder).
  ChildProcess(const std::string& binary, const std::vector<std::string>& args,
               const std::string& log)
      : log_(log) {
    const std::string path = std::string(TANDEM_BIN_DIR) + "/" + binary;
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(path.c_str()));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
      execv(path.c_str(), argv.data());
      _exit(127);
    }
  }
  ~ChildProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  void Signal(int sig) { kill(pid_, sig); }
  pid_t pid() const { return pid_; }

  // The exit status (128 + signal number when killed), or -1 while still running after
  // `timeout`.
  int Wait(absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return -1;
  }

  // SIGTERM, then Wait.
  int Stop(absl::Duration timeout = absl::Seconds(10)) {
    Signal(SIGTERM);
    return Wait(timeout);
  }

  std::string Log() const {
    std::ifstream f(log_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  bool exited_ = false;
};

// A loopback port that was free a moment ago, for flags that take a fixed port (0 where none
// could be bound). Another process may take it before the caller binds it; tests accept that.
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

// The port a process wrote to its --port-file, or 0 when `timeout` passes first or `child`
// (optional) exits before writing it.
inline int WaitForPortFile(const std::string& file, ChildProcess* child = nullptr,
                           absl::Duration timeout = absl::Seconds(30)) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    std::ifstream f(file);
    int port = 0;
    if (f >> port && port > 0) return port;
    if (child != nullptr && child->Wait(absl::ZeroDuration()) >= 0) return 0;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

}  // namespace tandem::testing
