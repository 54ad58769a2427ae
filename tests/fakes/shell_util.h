// Small helpers for tests that drive the tandem binaries through a shell: quoting an argument,
// reading back a file the command wrote, and running a command with a timeout.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace tandem::testing {

// `s` as one single-quoted POSIX shell word.
inline std::string Quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// The whole file, or "" when it cannot be read.
inline std::string Slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct ShellResult {
  int exit_code = -1;
  std::string out, err;
};

// Runs `cmd` through the shell, killed after `timeout_s`, and returns its exit code and output.
inline ShellResult RunShell(const std::string& cmd, int timeout_s = 120) {
  static std::atomic<int> seq{0};
  const std::filesystem::path tmp =
      std::filesystem::temp_directory_path() /
      ("tandem-shell-" + std::to_string(getpid()) + "-" + std::to_string(seq++));
  std::filesystem::create_directories(tmp);
  const std::string full = "timeout -k 5 " + std::to_string(timeout_s) + " " + cmd + " >" +
                           (tmp / "out").string() + " 2>" + (tmp / "err").string();
  ShellResult r;
  const int st = std::system(full.c_str());
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.out = Slurp(tmp / "out");
  r.err = Slurp(tmp / "err");
  std::filesystem::remove_all(tmp);
  return r;
}

}  // namespace tandem::testing
