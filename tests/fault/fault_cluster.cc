#include "tests/fault/fault_cluster.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/fakes/shell_util.h"

namespace tandem::testing {
namespace {

using ::tandem::testing::Quote;
using ::tandem::testing::Slurp;

namespace fs = std::filesystem;
namespace v1 = tandem::v1;

std::unique_ptr<grpc::ClientContext> Deadline(absl::Duration d) {
  auto cc = std::make_unique<grpc::ClientContext>();
  cc->set_deadline(absl::ToChronoTime(absl::Now() + d));
  return cc;
}

}  // namespace

fs::path FaultModelPath() {
  return fs::path(TANDEM_SHARED_MODELS_DIR) / "stories260K" / "stories260K.gguf";
}

v1::GenerateRequest GreedyRequest(const std::string& prompt, int max_tokens, bool ignore_eos) {
  v1::GenerateRequest req;
  req.set_text(prompt);
  req.mutable_sampling()->set_temperature(0);
  req.mutable_sampling()->set_max_tokens(max_tokens);
  req.mutable_sampling()->set_ignore_eos(ignore_eos);
  return req;
}

Completion GreedyReference(const std::string& prompt, int max_tokens) {
  static std::mutex mu;
  static std::map<std::pair<std::string, int>, Completion> cache;
  {
    std::lock_guard<std::mutex> l(mu);
    if (auto it = cache.find({prompt, max_tokens}); it != cache.end()) return it->second;
  }
  static std::atomic<int> seq{0};
  const fs::path out =
      fs::temp_directory_path() / absl::StrCat("tandem-fault-ref-", getpid(), "-", seq++);
  const std::string cmd = absl::StrCat(
      "timeout -k 5 60 ", TANDEM_BIN_DIR, "/tandem generate --model ",
      Quote(FaultModelPath().string()), " --prompt ", Quote(prompt), " --max-tokens ", max_tokens,
      " --temperature 0 --seed 0 --threads 1 --json >", out.string(), " 2>&1");
  const int st = std::system(cmd.c_str());
  const std::string text = Slurp(out);
  fs::remove(out);
  Completion c;
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    c.status = grpc::Status(grpc::StatusCode::UNKNOWN, "tandem generate failed: " + text);
    return c;
  }
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    c.tokens = j["tokens"].get<std::vector<int32_t>>();
    c.text = j["text"].get<std::string>();
    c.finished = true;
  } catch (const nlohmann::json::exception& e) {
    c.status = grpc::Status(grpc::StatusCode::UNKNOWN, std::string(e.what()) + ": " + text);
    return c;
  }
  std::lock_guard<std::mutex> l(mu);
  cache[{prompt, max_tokens}] = c;
  return c;
}

bool ProcessRunning(pid_t pid) {
  if (pid <= 0 || kill(pid, 0) != 0) return false;
  const std::string stat = Slurp(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

int64_t VmRssKb(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

HttpResponse HttpCall(int port, const std::string& method, const std::string& path,
                      const std::string& body, absl::Duration timeout) {
  HttpResponse r;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return r;
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(absl::ToInt64Seconds(timeout));
  tv.tv_usec = 1000;
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
  std::string req = absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: 127.0.0.1:", port,
                                 "\r\nConnection: close\r\n");
  if (!body.empty()) {
    absl::StrAppend(&req, "Content-Type: application/json\r\nContent-Length: ", body.size(),
                    "\r\n");
  }
  absl::StrAppend(&req, "\r\n", body);
  for (size_t off = 0; off < req.size();) {
    const ssize_t n = send(fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
    if (n <= 0) {
      close(fd);
      return r;
    }
    off += static_cast<size_t>(n);
  }
  std::string in;
  char buf[8192];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) in.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t head_end = in.find("\r\n\r\n");
  if (in.rfind("HTTP/1.", 0) != 0 || head_end == std::string::npos) return r;
  r.status = std::atoi(in.c_str() + in.find(' ') + 1);
  std::istringstream head(in.substr(0, head_end));
  std::string line;
  std::getline(head, line);  // status line
  while (std::getline(head, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    size_t v = colon + 1;
    while (v < line.size() && line[v] == ' ') ++v;
    r.headers[name] = line.substr(v);
  }
  r.body = in.substr(head_end + 4);
  if (auto it = r.headers.find("transfer-encoding");
      it != r.headers.end() && it->second.find("chunked") != std::string::npos) {
    std::string plain;
    for (size_t pos = 0;;) {
      const size_t eol = r.body.find("\r\n", pos);
      if (eol == std::string::npos) break;
      const size_t n = std::strtoul(r.body.substr(pos, eol - pos).c_str(), nullptr, 16);
      if (n == 0) break;
      plain += r.body.substr(eol + 2, n);
      pos = eol + 2 + n + 2;
    }
    r.body = plain;
  }
  return r;
}

double MetricValue(const std::string& exposition, const std::string& name) {
  std::istringstream in(exposition);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    const char next = line[name.size()];
    if (next != ' ' && next != '{') continue;
    return std::atof(line.c_str() + line.rfind(' ') + 1);
  }
  return -1;
}

FaultCluster::FaultCluster(FaultClusterOptions o) : o_(std::move(o)) {
  dir_ = fs::temp_directory_path() / absl::StrCat("tandem-fault-", getpid(), "-", o_.name);
  fs::remove_all(dir_);
  fs::create_directories(dir_);
}

FaultCluster::~FaultCluster() {
  // Workers first (they deregister from a router that is still there), then the rest.
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<Proc*> batch;
    for (auto& p : procs_) {
      const bool worker = p->role == "prefill" || p->role == "decode";
      if (p->child != nullptr && worker == (pass == 0) && ProcessRunning(p->child->pid())) {
        batch.push_back(p.get());
      }
    }
    for (Proc* p : batch) p->child->Signal(SIGTERM);
    for (Proc* p : batch) {
      if (p->child->Wait(absl::Seconds(8)) < 0) p->child->Signal(SIGKILL);
      p->child.reset();  // reaps (SIGKILL if still running)
    }
  }
  if (::testing::Test::HasFailure()) {
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().extension() != ".log") continue;
      std::string log = Slurp(e.path());
      if (log.size() > 4000) log = "..." + log.substr(log.size() - 4000);
      std::fprintf(stderr, "==== %s ====\n%s\n", e.path().c_str(), log.c_str());
    }
  } else {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
}

std::vector<std::string> FaultCluster::WorkerArgs(const std::string& role,
                                                  const std::string& name) const {
  std::vector<std::string> a = {"--model",     model(),
                                "--host",      "127.0.0.1",
                                "--port",      "0",
                                "--port-file", (dir_ / (name + ".port")).string(),
                                "--worker-id", name,
                                "--router",    absl::StrJoin(router_addresses_, ","),
                                "--threads",   "1",
                                "--transport", "ucx",
                                "--ucx-tls",   "shm",
                                "--ctx-size",  std::to_string(o_.ctx_size)};
  const int ep = role == "decode" ? o_.decode_ep : o_.prefill_ep;
  if (ep > 1) a.insert(a.end(), {"--ep-size", std::to_string(ep)});
  if (role == "decode") {
    a.insert(a.end(), {"--role", o_.decode_role});
    a.insert(a.end(), o_.decode_args.begin(), o_.decode_args.end());
  } else {
    if (o_.kvstore) a.insert(a.end(), {"--kvstore", absl::StrCat("127.0.0.1:", kvstore_port_)});
    a.insert(a.end(), o_.prefill_args.begin(), o_.prefill_args.end());
  }
  if (auto it = o_.worker_args.find(name); it != o_.worker_args.end()) {
    a.insert(a.end(), it->second.begin(), it->second.end());
  }
  return a;
}

const std::string& FaultCluster::model() const {
  static const std::string fallback = FaultModelPath().string();
  return o_.model.empty() ? fallback : o_.model;
}

absl::Status FaultCluster::Spawn(Proc& p, absl::Time deadline) {
  if (p.port_file.empty()) {
    p.child = std::make_unique<ChildProcess>(p.binary, p.args, (dir_ / (p.name + ".log")).string());
    return ProcessRunning(p.child->pid())
               ? absl::OkStatus()
               : absl::UnavailableError(absl::StrCat(p.name, " exited at once"));
  }
  fs::remove(p.port_file);
  const std::string log =
      (dir_ / (p.name == "kvstore" && kvstore_starts_ > 0
                   ? absl::StrCat("kvstore-", kvstore_starts_ + 1, ".log")
                   : p.name + ".log"))
          .string();
  p.child = std::make_unique<ChildProcess>(p.binary, p.args, log);
  while (true) {
    std::ifstream f(p.port_file);
    int port = 0;
    if (f >> port && port > 0) {
      p.port = port;
      return absl::OkStatus();
    }
    if (!ProcessRunning(p.child->pid())) {
      return absl::UnavailableError(
          absl::StrCat(p.name, " exited before serving; its log:\n", Slurp(log)));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(p.name, " did not start serving in time"));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

absl::Status FaultCluster::Start(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (int i = 0; i < std::max(1, o_.routers); ++i) {
    auto router = std::make_unique<Proc>();
    router->name = RouterName(i);
    router->role = "router";
    router->binary = "tandem-router";
    router->port_file = (dir_ / (router->name + ".port")).string();
    const bool without_model =
        std::find(o_.routers_without_model.begin(), o_.routers_without_model.end(), i) !=
        o_.routers_without_model.end();
    if (!without_model) router->args = {"--model", model()};
    router->args.insert(router->args.end(),
                        {"--host", "127.0.0.1", "--port", "0", "--port-file", router->port_file,
                         "--lease-ms", std::to_string(o_.lease_ms), "--ctx-size",
                         std::to_string(o_.ctx_size)});
    router->args.insert(router->args.end(), o_.router_args.begin(), o_.router_args.end());
    procs_.push_back(std::move(router));
    if (absl::Status st = Spawn(*procs_.back(), deadline); !st.ok()) return st;
    router_addresses_.push_back(absl::StrCat("127.0.0.1:", procs_.back()->port));
  }
  UseRouter(0);

  if (o_.kvstore) {
    auto kv = std::make_unique<Proc>();
    kv->name = kv->role = "kvstore";
    kv->binary = "tandem-kvstore";
    kv->port_file = (dir_ / "kvstore.port").string();
    fs::create_directories(dir_ / "ssd");
    kv->args = {"--host", "127.0.0.1", "--port", "0", "--port-file", kv->port_file,
                "--dir", (dir_ / "ssd").string(), "--transport", "ucx", "--ucx-tls", "shm"};
    kv->args.insert(kv->args.end(), o_.kvstore_args.begin(), o_.kvstore_args.end());
    procs_.push_back(std::move(kv));
    if (absl::Status st = Spawn(*procs_.back(), deadline); !st.ok()) return st;
    kvstore_port_ = procs_.back()->port;
    // Later starts reuse the port, so the prefill workers' --kvstore stays right.
    std::vector<std::string>& args = procs_.back()->args;
    for (size_t i = 0; i + 1 < args.size(); ++i) {
      if (args[i] == "--port") args[i + 1] = std::to_string(kvstore_port_);
    }
  }

  if (o_.before_workers) o_.before_workers(*this);
  for (const auto& [role, n] : {std::pair<std::string, int>{"prefill", o_.prefill},
                                std::pair<std::string, int>{"decode", o_.decode}}) {
    for (int i = 0; i < n; ++i) {
      auto w = std::make_unique<Proc>();
      w->name = absl::StrCat(role, "-", i);
      w->role = role;
      w->port_file = (dir_ / (w->name + ".port")).string();
      w->args = WorkerArgs(role, w->name);
      // A worker given a test hook runs its test twin (tests/fault/CMakeLists.txt).
      const bool hooks = std::any_of(w->args.begin(), w->args.end(),
                                     [](const std::string& a) { return a.rfind("--test-", 0) == 0; });
      w->binary = absl::StrCat(role == "decode" ? "tandem-decode" : "tandem-prefill",
                               hooks ? "-test-hooks" : "");
      procs_.push_back(std::move(w));
      Proc& leader = *procs_.back();
      if (absl::Status st = Spawn(leader, deadline); !st.ok()) return st;
      const int ep = role == "decode" ? o_.decode_ep : o_.prefill_ep;
      for (int r = 1; r < ep; ++r) {
        auto rank = std::make_unique<Proc>();
        rank->name = absl::StrCat(leader.name, "-ep", r);
        rank->role = "expert-rank";
        rank->binary = leader.binary;
        rank->args = WorkerArgs(role, rank->name);
        rank->args.insert(rank->args.end(),
                          {"--ep-rank", std::to_string(r), "--ep-leader",
                           absl::StrCat("127.0.0.1:", leader.port)});
        procs_.push_back(std::move(rank));
        if (absl::Status st = Spawn(*procs_.back(), deadline); !st.ok()) return st;
      }
    }
  }
  const std::vector<std::string> names = worker_names();
  const bool all = WaitFor(deadline - absl::Now(), [&] {
    for (const std::string& n : names) {
      if (!Registered(n)) return false;
    }
    return true;
  });
  if (!all) return absl::DeadlineExceededError("not every worker registered with the router");
  return absl::OkStatus();
}

std::string FaultCluster::RouterName(int i) {
  return i == 0 ? "router" : absl::StrCat("router-", i);
}

void FaultCluster::UseRouter(int i) {
  router_address_ = router_addresses_.at(i);
  channel_ = grpc::CreateChannel(router_address_, grpc::InsecureChannelCredentials());
  inference_ = v1::Inference::NewStub(channel_);
  registry_ = v1::Registry::NewStub(channel_);
}

ChildProcess* FaultCluster::process(const std::string& name) {
  for (auto& p : procs_) {
    if (p->name == name) return p->child.get();
  }
  return nullptr;
}

int FaultCluster::port(const std::string& name) const {
  for (const auto& p : procs_) {
    if (p->name == name) return p->port;
  }
  return 0;
}

pid_t FaultCluster::pid(const std::string& name) {
  ChildProcess* c = process(name);
  return c == nullptr ? -1 : c->pid();
}

std::vector<std::string> FaultCluster::worker_names() const {
  std::vector<std::string> out;
  for (const auto& p : procs_) {
    if (p->role == "prefill" || p->role == "decode") out.push_back(p->name);
  }
  return out;
}

absl::Status FaultCluster::RestartExpertRank(const std::string& name) {
  for (auto& p : procs_) {
    if (p->name != name || p->role != "expert-rank") continue;
    if (p->child != nullptr && ProcessRunning(p->child->pid())) {
      return absl::FailedPreconditionError(absl::StrCat(name, " is still running"));
    }
    if (p->child != nullptr) p->child->Wait(absl::Seconds(5));
    return Spawn(*p, absl::Now() + absl::Seconds(10));
  }
  return absl::NotFoundError(absl::StrCat("no expert rank ", name));
}

void FaultCluster::KillKvstore() {
  for (auto& p : procs_) {
    if (p->name != "kvstore" || p->child == nullptr) continue;
    p->child->Signal(SIGKILL);
    p->child->Wait(absl::Seconds(10));
    p->child.reset();
  }
}

absl::Status FaultCluster::RestartKvstore(absl::Duration timeout) {
  for (auto& p : procs_) {
    if (p->name != "kvstore") continue;
    if (p->child != nullptr) return absl::FailedPreconditionError("the kvstore still runs");
    ++kvstore_starts_;
    const absl::Time deadline = absl::Now() + timeout;
    // The port was in use a moment ago; a bind may need a few tries.
    absl::Status st;
    do {
      st = Spawn(*p, deadline);
      if (st.ok()) return st;
      p->child.reset();
      absl::SleepFor(absl::Milliseconds(100));
    } while (absl::Now() < deadline);
    return st;
  }
  return absl::NotFoundError("this cluster has no kvstore");
}

Completion FaultCluster::Generate(const v1::GenerateRequest& req, absl::Duration timeout) {
  Completion c;
  grpc::ClientContext cc;
  cc.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  const absl::Time t0 = absl::Now();
  auto reader = inference_->Generate(&cc, req);
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
    c.tokens.insert(c.tokens.end(), m.token_ids().begin(), m.token_ids().end());
    c.text += m.text();
    if (!m.prefill_worker().empty()) c.prefill_worker = m.prefill_worker();
    if (!m.decode_worker().empty()) c.decode_worker = m.decode_worker();
    if (m.finished()) {
      c.finished = true;
      c.reason = m.finish_reason();
      c.usage = m.usage();
      c.ttft = m.ttft();
    }
  }
  c.status = reader->Finish();
  c.elapsed = absl::Now() - t0;
  return c;
}

absl::StatusOr<v1::WorkerStats> FaultCluster::Stats(const std::string& worker) {
  for (auto& p : procs_) {
    if (p->name != worker) continue;
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", p->port),
                                       grpc::InsecureChannelCredentials());
    v1::WorkerStats stats;
    const grpc::Status st =
        p->role == "prefill"
            ? v1::PrefillWorker::NewStub(channel)->Stats(Deadline(absl::Seconds(5)).get(),
                                                         v1::WorkerStatsRequest(), &stats)
            : v1::DecodeWorker::NewStub(channel)->Stats(Deadline(absl::Seconds(5)).get(),
                                                        v1::WorkerStatsRequest(), &stats);
    if (!st.ok()) {
      return absl::UnavailableError(absl::StrCat(worker, " Stats: ", st.error_message()));
    }
    return stats;
  }
  return absl::NotFoundError(absl::StrCat("no worker ", worker));
}

absl::StatusOr<std::vector<v1::WorkerInfo>> FaultCluster::Workers() {
  v1::ListWorkersResponse resp;
  const grpc::Status st =
      registry_->ListWorkers(Deadline(absl::Seconds(5)).get(), v1::ListWorkersRequest(), &resp);
  if (!st.ok()) return absl::UnavailableError(st.error_message());
  return std::vector<v1::WorkerInfo>(resp.workers().begin(), resp.workers().end());
}

bool FaultCluster::Registered(const std::string& worker) {
  absl::StatusOr<std::vector<v1::WorkerInfo>> ws = Workers();
  if (!ws.ok()) return false;
  for (const v1::WorkerInfo& w : *ws) {
    if (w.worker_id() == worker) return true;
  }
  return false;
}

bool FaultCluster::WaitIdle(absl::Duration timeout, std::string* why,
                            std::vector<std::string> workers) {
  if (workers.empty()) {
    for (const std::string& n : worker_names()) {
      if (ProcessRunning(pid(n))) workers.push_back(n);
    }
  }
  return WaitFor(
      timeout,
      [&] {
        absl::StatusOr<std::vector<v1::WorkerInfo>> infos = Workers();
        for (const std::string& n : workers) {
          absl::StatusOr<v1::WorkerStats> s = Stats(n);
          if (!s.ok()) {
            *why = std::string(s.status().message());
            return false;
          }
          if (s->running() != 0 || s->waiting() != 0 || s->reservations() != 0 ||
              s->kv_blocks_free() != s->kv_blocks_total()) {
            *why = absl::StrCat(n, " is not idle: ", s->ShortDebugString());
            return false;
          }
          if (infos.ok()) {
            for (const v1::WorkerInfo& w : *infos) {
              if (w.worker_id() == n && w.router_inflight() != 0) {
                *why = absl::StrCat("the router holds ", w.router_inflight(), " in flight on ", n);
                return false;
              }
            }
          }
        }
        return true;
      },
      absl::Milliseconds(50));
}

}  // namespace tandem::testing
