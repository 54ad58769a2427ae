// Test helpers for Prometheus endpoints: a plain-socket HTTP GET, a sample lookup in the text
// exposition format, and `promtool check metrics` when the machine has promtool.
// Header-only; used by the metrics unit test and the services' metrics component test.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace tandem::testing {

struct HttpReply {
  int status = 0;  // 0: no reply (connection failed or timed out)
  std::string body;
};

// GET http://127.0.0.1:port/path with HTTP/1.0 (the server closes the connection after the
// reply, so no chunking and no keep-alive to handle). 10 s timeouts.
inline HttpReply HttpGet(int port, const std::string& path) {
  HttpReply r;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return r;
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return r;
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return r;
  }
  std::string raw;
  char buf[65536];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    raw.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  const size_t head_end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/", 0) != 0 || head_end == std::string::npos) return r;
  const size_t sp = raw.find(' ');
  r.status = std::atoi(raw.c_str() + sp + 1);
  r.body = raw.substr(head_end + 4);
  return r;
}

// The value of the sample whose name and labels are exactly `series`, e.g.
// `tandem_e2e_request_latency_seconds_count{model_name="tiny",role="decode"}`.
inline std::optional<double> SampleValue(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 &&
        line[series.size()] == ' ') {
      return std::strtod(line.c_str() + series.size() + 1, nullptr);
    }
  }
  return std::nullopt;
}

// The sample lines (not comments) of an exposition.
inline std::vector<std::string> SampleLines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] != '#') out.push_back(line);
  }
  return out;
}

struct PromtoolResult {
  bool available = false;  // promtool is on PATH
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

// Pipes `text` into `promtool check metrics`.
inline PromtoolResult PromtoolCheckMetrics(const std::string& text) {
  PromtoolResult r;
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) return r;
  r.available = true;
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("tandem-metrics-" + std::to_string(getpid()) + ".txt"))
                               .string();
  {
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) return r;
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
  }
  FILE* p = popen(("promtool check metrics < '" + path + "' 2>&1").c_str(), "r");
  if (p != nullptr) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
    const int st = pclose(p);
    r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  std::filesystem::remove(path);
  return r;
}

}  // namespace tandem::testing
