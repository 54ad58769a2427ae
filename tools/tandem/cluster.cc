#include "tools/tandem/cluster.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/util/status_util.h"
#include "engine/spec/proposer.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "services/common/tls.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::tools {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kStateFile[] = "cluster.json";

// One process of the cluster, as cluster.json records it.
struct Proc {
  std::string name;    // also the worker id in the registry
  std::string role;    // router, prefill, decode, colocated, expert-rank
  std::string binary;  // absolute path
  std::vector<std::string> args;
  std::vector<int> cpus;
  pid_t pid = -1;
  int port = 0;
};

struct State {
  std::string dir, model, bin_dir;
  std::string router_address;                // the first router's
  std::vector<std::string> router_addresses;  // every router's, the first first
  std::string kvstore_address;                // empty: no kvstore
  int router_port = 0, http_port = 0;
  int threads = 1;
  bool pin = false;
  std::string transport, ucx_tls;
  int ctx_size = 0, kv_blocks = 0, max_seqs = 0;
  std::vector<std::string> worker_args;
  std::string trace_dir;  // every process writes --trace <trace_dir>/<name>.json; empty: none
  int next_cpu = 0;
  std::vector<Proc> procs;
};

fs::path LogPath(const State& s, const std::string& name) {
  return fs::path(s.dir) / (name + ".log");
}
fs::path PidPath(const State& s, const std::string& name) {
  return fs::path(s.dir) / (name + ".pid");
}
fs::path PortPath(const State& s, const std::string& name) {
  return fs::path(s.dir) / (name + ".port");
}

json ToJson(const State& s) {
  json j;
  j["version"] = 1;
  j["dir"] = s.dir;
  j["model"] = s.model;
  j["bin_dir"] = s.bin_dir;
  j["router"] = s.router_address;
  j["routers"] = s.router_addresses;
  j["kvstore"] = s.kvstore_address;
  j["router_port"] = s.router_port;
  j["http_port"] = s.http_port;
  j["settings"] = {{"threads", s.threads},     {"pin", s.pin},
                   {"transport", s.transport}, {"ucx_tls", s.ucx_tls},
                   {"ctx_size", s.ctx_size},   {"kv_blocks", s.kv_blocks},
                   {"max_seqs", s.max_seqs},   {"worker_args", s.worker_args},
                   {"trace_dir", s.trace_dir}, {"next_cpu", s.next_cpu}};
  json procs = json::array();
  for (const Proc& p : s.procs) {
    procs.push_back({{"name", p.name},
                     {"role", p.role},
                     {"binary", p.binary},
                     {"args", p.args},
                     {"cpus", p.cpus},
                     {"pid", p.pid},
                     {"port", p.port},
                     {"log", LogPath(s, p.name).string()}});
  }
  j["processes"] = procs;
  return j;
}

absl::Status WriteAtomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    f.close();
    if (!f) return absl::PermissionDeniedError(absl::StrCat("cannot write ", tmp.string()));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot rename ", tmp.string(), ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status SaveState(const State& s) {
  return WriteAtomically(fs::path(s.dir) / kStateFile, ToJson(s).dump(2) + "\n");
}

absl::StatusOr<State> LoadState(const std::string& dir) {
  const fs::path path = fs::path(dir) / kStateFile;
  std::ifstream f(path);
  if (!f) {
    return absl::NotFoundError(absl::StrCat("no cluster in ", dir, " (", path.string(),
                                            " is missing; start one with tandem cluster up)"));
  }
  json j;
  try {
    j = json::parse(f);
    State s;
    s.dir = j.at("dir").get<std::string>();
    s.model = j.at("model").get<std::string>();
    s.bin_dir = j.at("bin_dir").get<std::string>();
    s.router_address = j.at("router").get<std::string>();
    s.router_addresses = j.value("routers", std::vector<std::string>{s.router_address});
    s.kvstore_address = j.value("kvstore", std::string());
    s.router_port = j.at("router_port").get<int>();
    s.http_port = j.at("http_port").get<int>();
    const json& st = j.at("settings");
    s.threads = st.at("threads").get<int>();
    s.pin = st.at("pin").get<bool>();
    s.transport = st.at("transport").get<std::string>();
    s.ucx_tls = st.at("ucx_tls").get<std::string>();
    s.ctx_size = st.at("ctx_size").get<int>();
    s.kv_blocks = st.at("kv_blocks").get<int>();
    s.max_seqs = st.at("max_seqs").get<int>();
    s.worker_args = st.at("worker_args").get<std::vector<std::string>>();
    s.trace_dir = st.value("trace_dir", std::string());
    s.next_cpu = st.at("next_cpu").get<int>();
    for (const json& p : j.at("processes")) {
      Proc q;
      q.name = p.at("name").get<std::string>();
      q.role = p.at("role").get<std::string>();
      q.binary = p.at("binary").get<std::string>();
      q.args = p.at("args").get<std::vector<std::string>>();
      q.cpus = p.at("cpus").get<std::vector<int>>();
      q.pid = p.at("pid").get<pid_t>();
      q.port = p.at("port").get<int>();
      s.procs.push_back(std::move(q));
    }
    return s;
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), " is not a cluster description: ", e.what()));
  }
}

// Whether `pid` is a live (not zombie) process running `binary`. Checking the executable guards
// against a pid the kernel has since given to an unrelated process.
bool Alive(pid_t pid, const std::string& binary) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno != EPERM) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return false;
  const char state = line[paren + 2];
  if (state == 'Z' || state == 'X') return false;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/" + std::to_string(pid) + "/exe", ec);
  if (ec) return true;  // not ours to inspect; trust the pid and stat
  std::string target = exe.string();
  const std::string deleted = " (deleted)";  // the binary was rebuilt under the process
  if (target.size() > deleted.size() &&
      target.compare(target.size() - deleted.size(), deleted.size(), deleted) == 0) {
    target.resize(target.size() - deleted.size());
  }
  return fs::path(target).filename() == fs::path(binary).filename();
}

// Reaps `pid` if it is our child; harmless otherwise.
void Reap(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, WNOHANG);
}

std::string Tail(const fs::path& path, int lines) {
  std::ifstream f(path);
  std::vector<std::string> all;
  for (std::string l; std::getline(f, l);) all.push_back(l);
  const size_t from = all.size() > static_cast<size_t>(lines) ? all.size() - lines : 0;
  std::string out;
  for (size_t i = from; i < all.size(); ++i) absl::StrAppend(&out, "    ", all[i], "\n");
  return out;
}

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  if (cpus.empty()) cpus.push_back(0);
  return cpus;
}

// The next n CPUs of the allowed set, round-robin from the state's cursor.
std::vector<int> TakeCpus(State& s, int n) {
  const std::vector<int> allowed = AllowedCpus();
  n = std::max(1, std::min<int>(n, allowed.size()));
  std::vector<int> out;
  for (int i = 0; i < n; ++i) out.push_back(allowed[(s.next_cpu + i) % allowed.size()]);
  s.next_cpu = (s.next_cpu + n) % allowed.size();
  return out;
}

absl::StatusOr<pid_t> Spawn(const State& s, const Proc& p) {
  const fs::path log = LogPath(s, p.name);
  const int log_fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) return util::FromErrno(errno, absl::StrCat("open ", log.string()));
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  std::vector<std::string> argv_s = {p.binary};
  argv_s.insert(argv_s.end(), p.args.begin(), p.args.end());
  if (!s.trace_dir.empty()) {
    argv_s.insert(argv_s.end(), {"--trace", (fs::path(s.trace_dir) / (p.name + ".json")).string()});
  }
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : p.cpus) CPU_SET(c, &set);
  const std::string header =
      absl::StrCat("==== tandem cluster: ", absl::StrJoin(argv_s, " "), "\n");
  if (write(log_fd, header.data(), header.size()) < 0) {
    // The log is best effort; the process itself reports into it too.
  }
  // The child reports a failed exec through this pipe; a successful exec closes it (CLOEXEC),
  // so once the parent reads end-of-file the pid runs the new binary.
  int exec_pipe[2];
  if (pipe2(exec_pipe, O_CLOEXEC) != 0) {
    close(log_fd);
    if (null_fd >= 0) close(null_fd);
    return util::FromErrno(errno, "pipe2");
  }
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(log_fd);
    if (null_fd >= 0) close(null_fd);
    close(exec_pipe[0]);
    close(exec_pipe[1]);
    return util::FromErrno(err, "fork");
  }
  if (pid == 0) {
    // Child: only async-signal-safe calls from here to exec.
    setsid();  // its own session: a terminal's Ctrl-C aimed at `tandem` does not reach it
    if (null_fd >= 0) dup2(null_fd, 0);
    dup2(log_fd, 1);
    dup2(log_fd, 2);
    if (!p.cpus.empty()) sched_setaffinity(0, sizeof(set), &set);
    execv(argv[0], argv.data());
    const int err = errno;
    if (write(exec_pipe[1], &err, sizeof(err)) < 0) {
    }
    _exit(127);
  }
  close(log_fd);
  if (null_fd >= 0) close(null_fd);
  close(exec_pipe[1]);
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(exec_pipe[0], &child_errno, sizeof(child_errno));
  } while (n < 0 && errno == EINTR);
  close(exec_pipe[0]);
  if (n > 0) {
    int status = 0;
    waitpid(pid, &status, 0);
    return util::FromErrno(child_errno, absl::StrCat("exec ", p.binary));
  }
  TANDEM_RETURN_IF_ERROR(WriteAtomically(PidPath(s, p.name), absl::StrCat(pid, "\n")));
  return pid;
}

// Waits for the port file a process writes once it serves.
absl::StatusOr<int> WaitForPortFile(const State& s, const Proc& p, absl::Time deadline) {
  const fs::path path = PortPath(s, p.name);
  while (true) {
    std::ifstream f(path);
    int port = 0;
    if (f && (f >> port) && port > 0) return port;
    Reap(p.pid);
    if (!Alive(p.pid, p.binary)) {
      return absl::UnavailableError(absl::StrCat(p.name, " exited before serving"));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(p.name, " did not start serving in time"));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// Asks the worker itself: heartbeat copies in the registry can be a lease period old.
void RefreshStats(v1::WorkerInfo* w) {
  auto channel = services::CreateClientChannel(w->address());
  grpc::ClientContext cc;
  cc.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  v1::WorkerStats stats;
  const grpc::Status gs =
      w->role() == v1::WORKER_ROLE_PREFILL
          ? v1::PrefillWorker::NewStub(channel)->Stats(&cc, v1::WorkerStatsRequest(), &stats)
          : v1::DecodeWorker::NewStub(channel)->Stats(&cc, v1::WorkerStatsRequest(), &stats);
  if (gs.ok()) *w->mutable_stats() = stats;
}

const char* BinaryFor(const std::string& role) {
  if (role == "router") return "tandem-router";
  if (role == "kvstore") return "tandem-kvstore";
  if (role == "prefill") return "tandem-prefill";
  return "tandem-decode";  // decode and colocated
}

// The worker's command line from the cluster's settings.
Proc MakeWorker(State& s, const std::string& role, const std::string& name, int ep = 1) {
  Proc p;
  p.name = name;
  p.role = role;
  p.binary = (fs::path(s.bin_dir) / BinaryFor(role)).string();
  p.args = {"--model",     s.model,
            "--host",      "127.0.0.1",
            "--port",      "0",
            "--port-file", PortPath(s, name).string(),
            "--worker-id", name,
            "--router",    absl::StrJoin(s.router_addresses, ","),
            "--threads",   std::to_string(s.threads)};
  if (role == "colocated") {
    // One engine prefills and decodes; no KV ever crosses a transport, only an expert
    // group's activations do.
    p.args.insert(p.args.end(), {"--role", "both", "--transport", ep > 1 ? s.transport : "none"});
    if (ep > 1) p.args.insert(p.args.end(), {"--ucx-tls", s.ucx_tls});
  } else {
    if (role == "decode") p.args.insert(p.args.end(), {"--role", "decode"});
    p.args.insert(p.args.end(), {"--transport", s.transport, "--ucx-tls", s.ucx_tls});
    // Prefill workers onboard shared prefixes from the kvstore and publish to it.
    if (role == "prefill" && !s.kvstore_address.empty()) {
      p.args.insert(p.args.end(), {"--kvstore", s.kvstore_address});
    }
  }
  if (s.ctx_size > 0) p.args.insert(p.args.end(), {"--ctx-size", std::to_string(s.ctx_size)});
  if (role != "prefill") {
    if (s.kv_blocks > 0) p.args.insert(p.args.end(), {"--kv-blocks", std::to_string(s.kv_blocks)});
    if (s.max_seqs > 0) p.args.insert(p.args.end(), {"--max-seqs", std::to_string(s.max_seqs)});
  }
  if (ep > 1) p.args.insert(p.args.end(), {"--ep-size", std::to_string(ep)});
  p.args.insert(p.args.end(), s.worker_args.begin(), s.worker_args.end());
  if (s.pin) p.cpus = TakeCpus(s, s.threads);
  return p;
}

// SIGTERM to each, then wait; SIGKILL whatever outlives `grace`.
void StopProcs(const State& s, const std::vector<const Proc*>& procs, absl::Duration grace) {
  for (const Proc* p : procs) {
    if (Alive(p->pid, p->binary)) kill(p->pid, SIGTERM);
  }
  const absl::Time deadline = absl::Now() + grace;
  while (true) {
    bool any = false;
    for (const Proc* p : procs) {
      Reap(p->pid);
      any = any || Alive(p->pid, p->binary);
    }
    if (!any) break;
    if (absl::Now() >= deadline) {
      for (const Proc* p : procs) {
        if (Alive(p->pid, p->binary)) {
          std::fprintf(stderr,
                       "tandem cluster: %s (pid %d) outlived %.0f s after SIGTERM: SIGKILL\n",
                       p->name.c_str(), p->pid, absl::ToDoubleSeconds(grace));
          kill(p->pid, SIGKILL);
        }
      }
      for (int i = 0; i < 100; ++i) {
        bool left = false;
        for (const Proc* p : procs) {
          Reap(p->pid);
          left = left || Alive(p->pid, p->binary);
        }
        if (!left) break;
        absl::SleepFor(absl::Milliseconds(20));
      }
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  for (const Proc* p : procs) {
    std::error_code ec;
    fs::remove(PidPath(s, p->name), ec);
    fs::remove(PortPath(s, p->name), ec);
  }
}

std::string LogList(const State& s) {
  std::vector<std::string> logs;
  for (const Proc& p : s.procs) logs.push_back(LogPath(s, p.name).string());
  return absl::StrJoin(logs, ", ");
}

// Waits until every worker in `names` is registered; fails early when one of them exits.
absl::Status WaitRegistered(const State& s, const std::set<std::string>& names,
                            absl::Time deadline) {
  std::string missing;
  absl::Status last;
  while (true) {
    // Every worker must be known to every router.
    std::set<std::string> pending;
    for (const std::string& router : s.router_addresses) {
      std::set<std::string> here = names;
      absl::StatusOr<std::vector<v1::WorkerInfo>> workers = ListWorkers(router, absl::Seconds(2));
      if (workers.ok()) {
        for (const v1::WorkerInfo& w : *workers) here.erase(w.worker_id());
      } else {
        last = workers.status();
      }
      for (const std::string& n : here) pending.insert(s.router_addresses.size() == 1
                                                           ? n
                                                           : absl::StrCat(n, " (at ", router, ")"));
    }
    if (pending.empty()) return absl::OkStatus();
    for (const Proc& p : s.procs) {
      if (!names.contains(p.name) && p.role != "router" && p.role != "kvstore") continue;
      Reap(p.pid);
      if (!Alive(p.pid, p.binary)) {
        return absl::UnavailableError(
            absl::StrCat(p.name, " exited while the cluster was starting; end of ",
                         LogPath(s, p.name).string(), ":\n", Tail(LogPath(s, p.name), 15)));
      }
    }
    if (absl::Now() >= deadline) {
      std::string detail;
      for (const std::string& n : names) {
        absl::StrAppend(&detail, "end of ", LogPath(s, n).string(), ":\n", Tail(LogPath(s, n), 10));
      }
      return absl::DeadlineExceededError(
          absl::StrCat("not registered with the router in time: ", absl::StrJoin(pending, ", "),
                       last.ok() ? "" : absl::StrCat(" (last router error: ", last.ToString(), ")"),
                       "\n", detail));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

std::string SelfDir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

absl::Status CheckBinaries(const State& s, const std::vector<std::string>& roles) {
  for (const std::string& r : roles) {
    const fs::path b = fs::path(s.bin_dir) / BinaryFor(r);
    if (access(b.c_str(), X_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("cannot run ", b.string(),
                                              ": build it (ninja tandem-router tandem-prefill "
                                              "tandem-decode) or pass --bin-dir"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<v1::WorkerInfo>> ListWorkers(const std::string& router,
                                                        absl::Duration timeout) {
  auto stub =
      v1::Registry::NewStub(services::CreateClientChannel(router));
  grpc::ClientContext cc;
  cc.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::ListWorkersResponse resp;
  const grpc::Status gs = stub->ListWorkers(&cc, v1::ListWorkersRequest(), &resp);
  if (!gs.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(gs.error_code()),
                        absl::StrCat("router ", router, ": ", gs.error_message()));
  }
  return std::vector<v1::WorkerInfo>(resp.workers().begin(), resp.workers().end());
}

absl::StatusOr<bool> CheckHealth(const std::string& address, absl::Duration timeout,
                                 const std::string& service) {
  grpc::GenericStub stub(services::CreateClientChannel(address));
  grpc::ClientContext cc;
  cc.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::CompletionQueue cq;
  // HealthCheckRequest{service}: field 1, length-delimited (nothing at all for "").
  std::string wire;
  if (!service.empty() && service.size() < 128) {
    wire = std::string("\x0a") + static_cast<char>(service.size()) + service;
  }
  grpc::Slice slice(wire);
  grpc::ByteBuffer request(&slice, 1);
  auto call = stub.PrepareUnaryCall(&cc, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("health check of ", address, ": ", status.error_message()));
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("unreadable health response");
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // HealthCheckResponse{status = 1 (SERVING)}: field 1, varint -> 0x08 0x01. Absent = UNKNOWN.
  return bytes.size() >= 2 && bytes[0] == 0x08 && bytes[1] == 0x01;
}

absl::Status ClusterUp(const ClusterUpOptions& o) {
  if (o.model.empty()) return absl::InvalidArgumentError("--model is required");
  if (o.dir.empty()) return absl::InvalidArgumentError("--dir is required");
  if (o.prefill < 0 || o.decode < 0 || o.colocated < 0) {
    return absl::InvalidArgumentError("--prefill, --decode and --colocated must be >= 0");
  }
  if (o.ep < 1 || o.prefill_ep < 1) {
    return absl::InvalidArgumentError("--ep and --prefill-ep must be >= 1");
  }
  if (o.colocated == 0 && (o.prefill == 0 || o.decode == 0)) {
    return absl::InvalidArgumentError(
        "a cluster needs at least one prefill and one decode worker, or --colocated >= 1");
  }
  if (o.threads < 1) return absl::InvalidArgumentError("--threads must be >= 1");
  if (o.routers < 1) return absl::InvalidArgumentError("--routers must be >= 1");
  if (o.kvstore_host_mb < 1) return absl::InvalidArgumentError("--kvstore-host-mb must be >= 1");
  if (o.transport != "ucx" && o.transport != "inproc") {
    return absl::InvalidArgumentError("--transport must be ucx or inproc");
  }
  std::error_code ec;
  if (!fs::is_regular_file(o.model, ec)) {
    return absl::NotFoundError(absl::StrCat("--model: no such file ", o.model));
  }
  fs::create_directories(o.dir, ec);
  if (ec)
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", o.dir, ": ", ec.message()));
  if (absl::StatusOr<State> old = LoadState(o.dir); old.ok()) {
    for (const Proc& p : old->procs) {
      if (Alive(p.pid, p.binary)) {
        return absl::FailedPreconditionError(
            absl::StrCat("a cluster is already running in ", o.dir, " (", p.name, " is pid ", p.pid,
                         "); stop it first: tandem cluster down --dir ", o.dir));
      }
    }
  }
  State s;
  s.dir = fs::absolute(o.dir).lexically_normal().string();
  s.model = fs::absolute(o.model).lexically_normal().string();
  s.bin_dir = o.bin_dir.empty() ? SelfDir() : fs::absolute(o.bin_dir).string();
  s.http_port = o.http_port;
  s.threads = o.threads;
  s.pin = o.pin;
  s.transport = o.transport;
  s.ucx_tls = o.ucx_tls;
  s.ctx_size = o.ctx_size;
  s.kv_blocks = o.kv_blocks;
  s.max_seqs = o.max_seqs;
  s.worker_args = o.worker_args;
  if (!o.trace_dir.empty()) {
    fs::create_directories(o.trace_dir, ec);
    if (ec) {
      return absl::PermissionDeniedError(
          absl::StrCat("--trace-dir: cannot create ", o.trace_dir, ": ", ec.message()));
    }
    s.trace_dir = fs::absolute(o.trace_dir).lexically_normal().string();
  }
  // Refused here, before any process starts, rather than by each worker at its start.
  TANDEM_RETURN_IF_ERROR(engine::ParseSpeculative(o.speculative, o.spec_tokens).status());
  if (o.speculative != "off") {
    s.worker_args.insert(s.worker_args.end(), {"--speculative", o.speculative, "--spec-tokens",
                                               std::to_string(o.spec_tokens)});
  }
  for (const std::string& a : services::TlsFlagArgs(o.tls)) s.worker_args.push_back(a);
  std::vector<std::string> roles = {"router"};
  if (o.kvstore) roles.push_back("kvstore");
  if (o.prefill > 0) roles.push_back("prefill");
  if (o.decode + o.colocated > 0) roles.push_back("decode");
  TANDEM_RETURN_IF_ERROR(CheckBinaries(s, roles));
  const absl::Time t0 = absl::Now();
  const absl::Time deadline = t0 + o.ready_timeout;

  // On any failure: stop what was started, keep the logs, say where they are.
  auto fail = [&](const absl::Status& st) {
    std::vector<const Proc*> all;
    for (const Proc& p : s.procs) all.push_back(&p);
    StopProcs(s, all, absl::Seconds(3));
    (void)SaveState(s);
    return absl::Status(st.code(),
                        absl::StrCat("cluster up failed: ", st.message(), "\nlogs: ", LogList(s)));
  };

  // The routers first: workers register with them. Router i > 0 takes a free gRPC port and,
  // with --http-port Q, HTTP port Q + i.
  for (int i = 0; i < o.routers; ++i) {
    Proc router;
    router.name = i == 0 ? "router" : absl::StrCat("router-", i);
    router.role = "router";
    router.binary = (fs::path(s.bin_dir) / BinaryFor("router")).string();
    const int http_port = o.http_port > 0 ? o.http_port + i : 0;
    router.args = {"--model",     s.model,
                   "--host",      "127.0.0.1",
                   "--port",      std::to_string(i == 0 ? o.router_port : 0),
                   "--port-file", PortPath(s, router.name).string(),
                   "--http-port", std::to_string(http_port),
                   "--policy",    o.policy};
    if (o.lease_ms > 0)
      router.args.insert(router.args.end(), {"--lease-ms", std::to_string(o.lease_ms)});
    if (o.ctx_size > 0)
      router.args.insert(router.args.end(), {"--ctx-size", std::to_string(o.ctx_size)});
    router.args.insert(router.args.end(), o.router_args.begin(), o.router_args.end());
    for (const std::string& a : services::TlsFlagArgs(o.tls)) router.args.push_back(a);
    if (s.pin) router.cpus = TakeCpus(s, 1);
    fs::remove(PortPath(s, router.name), ec);
    absl::StatusOr<pid_t> pid = Spawn(s, router);
    if (!pid.ok()) return fail(pid.status());
    router.pid = *pid;
    s.procs.push_back(router);
    Proc& r = s.procs.back();
    absl::StatusOr<int> port = WaitForPortFile(s, r, deadline);
    if (!port.ok()) {
      return fail(absl::Status(
          port.status().code(),
          absl::StrCat(port.status().message(), "; end of ", LogPath(s, r.name).string(), ":\n",
                       Tail(LogPath(s, r.name), 15))));
    }
    r.port = *port;
    s.router_addresses.push_back(absl::StrCat("127.0.0.1:", *port));
    while (true) {
      absl::StatusOr<bool> healthy = CheckHealth(s.router_addresses.back(), absl::Seconds(1));
      if (healthy.ok() && *healthy) break;
      if (absl::Now() >= deadline) {
        return fail(absl::DeadlineExceededError(
            absl::StrCat(r.name, " never reported SERVING")));
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  s.router_port = s.procs[0].port;
  s.router_address = s.router_addresses[0];

  // The kvstore next: prefill workers are told where it is. No device tier on a CPU-only
  // machine; a host tier and a staging region sized for a local cluster. Its data plane uses
  // the workers' transport.
  if (o.kvstore) {
    Proc kv;
    kv.name = kv.role = "kvstore";
    kv.binary = (fs::path(s.bin_dir) / BinaryFor("kvstore")).string();
    kv.args = {"--host",       "127.0.0.1",
               "--port",       "0",
               "--port-file",  PortPath(s, kv.name).string(),
               "--transport",  s.transport,
               "--ucx-tls",    s.ucx_tls,
               "--device-mb",  "0",
               "--host-mb",    std::to_string(o.kvstore_host_mb),
               "--ssd-mb",     "0",
               "--staging-mb", "16",
               "--model-name", fs::path(s.model).stem().string()};
    for (const std::string& a : services::TlsFlagArgs(o.tls)) kv.args.push_back(a);
    if (s.pin) kv.cpus = TakeCpus(s, 1);
    fs::remove(PortPath(s, kv.name), ec);
    absl::StatusOr<pid_t> pid = Spawn(s, kv);
    if (!pid.ok()) return fail(pid.status());
    kv.pid = *pid;
    s.procs.push_back(kv);
    absl::StatusOr<int> port = WaitForPortFile(s, s.procs.back(), deadline);
    if (!port.ok()) {
      return fail(absl::Status(
          port.status().code(),
          absl::StrCat(port.status().message(), "; end of ", LogPath(s, kv.name).string(), ":\n",
                       Tail(LogPath(s, kv.name), 15))));
    }
    s.procs.back().port = *port;
    s.kvstore_address = absl::StrCat("127.0.0.1:", *port);
  }

  std::set<std::string> names;
  auto start = [&](const std::string& role, int n) -> absl::Status {
    const int ep = role == "prefill" ? o.prefill_ep : o.ep;
    for (int i = 0; i < n; ++i) {
      const std::string name = absl::StrCat(role, "-", i);
      Proc p = MakeWorker(s, role, name, ep);
      fs::remove(PortPath(s, name), ec);
      TANDEM_ASSIGN_OR_RETURN(p.pid, Spawn(s, p));
      s.procs.push_back(p);
      names.insert(name);
      if (ep <= 1) continue;
      // The expert ranks join rank 0 at its gRPC port; it registers once they all have.
      TANDEM_ASSIGN_OR_RETURN(const int leader_port, WaitForPortFile(s, s.procs.back(), deadline));
      s.procs.back().port = leader_port;
      for (int r = 1; r < ep; ++r) {
        Proc rank = MakeWorker(s, role, absl::StrCat(name, "-ep", r), ep);
        rank.role = "expert-rank";
        rank.args.insert(rank.args.end(), {"--ep-rank", std::to_string(r), "--ep-leader",
                                           absl::StrCat("127.0.0.1:", leader_port)});
        TANDEM_ASSIGN_OR_RETURN(rank.pid, Spawn(s, rank));
        s.procs.push_back(rank);
      }
    }
    return absl::OkStatus();
  };
  for (const auto& [role, n] : std::vector<std::pair<std::string, int>>{
           {"prefill", o.prefill}, {"decode", o.decode}, {"colocated", o.colocated}}) {
    if (absl::Status st = start(role, n); !st.ok()) return fail(st);
  }
  if (absl::Status st = WaitRegistered(s, names, deadline); !st.ok()) return fail(st);
  for (Proc& p : s.procs) {
    if (p.role == "router" || p.role == "kvstore" || p.role == "expert-rank") continue;
    absl::StatusOr<int> wp = WaitForPortFile(s, p, deadline);
    if (wp.ok()) p.port = *wp;
  }
  TANDEM_RETURN_IF_ERROR(SaveState(s));
  std::printf(
      "tandem cluster: up in %.1f s: router%s %s, %d prefill, %d decode, %d colocated, %s; "
      "state and logs in %s\n",
      absl::ToDoubleSeconds(absl::Now() - t0), s.router_addresses.size() > 1 ? "s" : "",
      absl::StrJoin(s.router_addresses, ",").c_str(), o.prefill, o.decode, o.colocated,
      s.kvstore_address.empty() ? "no kvstore" : ("kvstore " + s.kvstore_address).c_str(),
      s.dir.c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

absl::Status ClusterDown(const std::string& dir, absl::Duration grace) {
  absl::StatusOr<State> s = LoadState(dir);
  if (!s.ok()) {
    if (absl::IsNotFound(s.status())) {
      std::printf("tandem cluster: nothing to stop in %s\n", dir.c_str());
      return absl::OkStatus();
    }
    return s.status();
  }
  // Workers first, so they can deregister from a router that is still there.
  std::vector<const Proc*> workers, router;
  for (const Proc& p : s->procs) {
    (p.role == "router" || p.role == "kvstore" ? router : workers).push_back(&p);
  }
  int alive = 0;
  for (const Proc& p : s->procs) alive += Alive(p.pid, p.binary) ? 1 : 0;
  StopProcs(*s, workers, grace);
  StopProcs(*s, router, grace);
  std::printf("tandem cluster: stopped %d process%s in %s\n", alive, alive == 1 ? "" : "es",
              s->dir.c_str());
  return absl::OkStatus();
}

absl::Status ClusterStatus(const std::string& dir, bool as_json) {
  TANDEM_ASSIGN_OR_RETURN(State s, LoadState(dir));
  // Every router's health and how many workers it knows; the worker table comes from the
  // first router that answers.
  struct RouterView {
    std::string address;
    absl::StatusOr<bool> healthy;
    absl::StatusOr<std::vector<v1::WorkerInfo>> workers;
  };
  std::vector<RouterView> routers;
  for (const std::string& a : s.router_addresses) {
    routers.push_back({a, CheckHealth(a, absl::Seconds(2)), ListWorkers(a, absl::Seconds(2))});
  }
  absl::StatusOr<bool> healthy = routers[0].healthy;
  absl::StatusOr<std::vector<v1::WorkerInfo>> workers = routers[0].workers;
  for (const RouterView& r : routers) {
    if (r.workers.ok()) {
      workers = r.workers;
      break;
    }
  }
  std::map<std::string, v1::WorkerInfo> registered;
  if (workers.ok()) {
    for (v1::WorkerInfo& w : *workers) {
      RefreshStats(&w);
      registered[w.worker_id()] = w;
    }
  }
  if (as_json) {
    json j = ToJson(s);
    j["router_healthy"] = healthy.ok() && *healthy;
    json rs = json::array();
    for (const RouterView& r : routers) {
      json ids = json::array();
      if (r.workers.ok()) {
        for (const v1::WorkerInfo& w : *r.workers) ids.push_back(w.worker_id());
      }
      rs.push_back({{"address", r.address},
                    {"healthy", r.healthy.ok() && *r.healthy},
                    {"workers", ids}});
    }
    j["routers"] = rs;
    if (!s.kvstore_address.empty()) {
      bool alive = false;
      for (const Proc& p : s.procs) alive = alive || (p.role == "kvstore" && Alive(p.pid, p.binary));
      j["kvstore"] = {{"address", s.kvstore_address}, {"alive", alive}};
    } else {
      j["kvstore"] = nullptr;
    }
    for (json& p : j["processes"]) {
      const std::string name = p["name"].get<std::string>();
      p["alive"] = Alive(p["pid"].get<pid_t>(), p["binary"].get<std::string>());
      auto it = registered.find(name);
      p["registered"] = it != registered.end();
    }
    json ws = json::array();
    for (const auto& [id, w] : registered) {
      const v1::WorkerStats& st = w.stats();
      ws.push_back({{"worker_id", id},
                    {"role", v1::WorkerRole_Name(w.role())},
                    {"address", w.address()},
                    {"draining", w.draining()},
                    {"lease_remaining_ms", w.lease_remaining_ms()},
                    {"router_inflight", w.router_inflight()},
                    {"requests_routed", w.requests_routed()},
                    {"stats",
                     {{"running", st.running()},
                      {"waiting", st.waiting()},
                      {"kv_blocks_total", st.kv_blocks_total()},
                      {"kv_blocks_free", st.kv_blocks_free()},
                      {"reservations", st.reservations()},
                      {"transport_bytes_written", st.transport_bytes_written()},
                      {"transport_bytes_received", st.transport_bytes_received()},
                      {"kv_integrity_failures", st.kv_integrity_failures()}}}});
    }
    j["workers"] = ws;
    if (!workers.ok()) j["router_error"] = workers.status().ToString();
    std::printf("%s\n", j.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("cluster %s: model %s\n", s.dir.c_str(), s.model.c_str());
  for (const RouterView& r : routers) {
    std::printf("router %s: %s, %s\n", r.address.c_str(),
                r.healthy.ok() ? (*r.healthy ? "SERVING" : "NOT SERVING")
                               : std::string(r.healthy.status().message()).c_str(),
                r.workers.ok() ? absl::StrCat(r.workers->size(), " workers registered").c_str()
                               : "registry unreachable");
  }
  std::printf("kvstore: %s\n", s.kvstore_address.empty() ? "none" : s.kvstore_address.c_str());
  std::printf("%-14s %-10s %8s %-6s %-17s %-10s %7s %7s %11s %12s %12s %8s %7s\n", "NAME", "ROLE",
              "PID", "STATE", "ADDRESS", "REGISTERED", "RUNNING", "WAITING", "KV_FREE", "XFER_OUT",
              "XFER_IN", "INFLIGHT", "ROUTED");
  for (const Proc& p : s.procs) {
    const bool alive = Alive(p.pid, p.binary);
    auto it = registered.find(p.name);
    const bool service = p.role == "router" || p.role == "kvstore" || p.role == "expert-rank";
    std::string reg = service ? "-" : (it == registered.end() ? "no" : "yes");
    if (it != registered.end() && it->second.draining()) reg = "draining";
    std::string running = "-", waiting = "-", kv = "-", out = "-", in = "-", inflight = "-",
                routed = "-";
    if (it != registered.end()) {
      const v1::WorkerStats& st = it->second.stats();
      running = std::to_string(st.running());
      waiting = std::to_string(st.waiting());
      if (p.role != "prefill") kv = absl::StrCat(st.kv_blocks_free(), "/", st.kv_blocks_total());
      out = std::to_string(st.transport_bytes_written());
      in = std::to_string(st.transport_bytes_received());
      inflight = std::to_string(it->second.router_inflight());
      routed = std::to_string(it->second.requests_routed());
    }
    std::printf("%-14s %-10s %8d %-6s %-17s %-10s %7s %7s %11s %12s %12s %8s %7s\n", p.name.c_str(),
                p.role.c_str(), p.pid, alive ? "up" : "down",
                absl::StrCat("127.0.0.1:", p.port).c_str(), reg.c_str(), running.c_str(),
                waiting.c_str(), kv.c_str(), out.c_str(), in.c_str(), inflight.c_str(),
                routed.c_str());
  }
  for (const auto& [id, w] : registered) {
    const bool ours =
        std::any_of(s.procs.begin(), s.procs.end(), [&](const Proc& p) { return p.name == id; });
    if (!ours) {
      std::printf("(registered but not started by this tool: %s, %s at %s)\n", id.c_str(),
                  v1::WorkerRole_Name(w.role()).c_str(), w.address().c_str());
    }
  }
  if (!workers.ok()) {
    std::printf("router registry unreachable: %s\n", workers.status().ToString().c_str());
  }
  return absl::OkStatus();
}

absl::Status ClusterAdd(const ClusterAddOptions& o) {
  if (o.role != "prefill" && o.role != "decode" && o.role != "colocated") {
    return absl::InvalidArgumentError("--role must be prefill, decode or colocated");
  }
  TANDEM_ASSIGN_OR_RETURN(State s, LoadState(o.dir));
  TANDEM_RETURN_IF_ERROR(CheckBinaries(s, {o.role}));
  std::string name = o.name;
  if (name.empty()) {
    for (int i = 0;; ++i) {
      name = absl::StrCat(o.role, "-", i);
      const bool taken = std::any_of(s.procs.begin(), s.procs.end(),
                                     [&](const Proc& p) { return p.name == name; });
      if (!taken) break;
    }
  } else {
    for (const Proc& p : s.procs) {
      if (p.name == name) {
        return absl::AlreadyExistsError(absl::StrCat("the cluster already has a ", name));
      }
    }
  }
  const absl::Time deadline = absl::Now() + o.ready_timeout;
  Proc p = MakeWorker(s, o.role, name);
  std::error_code ec;
  fs::remove(PortPath(s, name), ec);
  TANDEM_ASSIGN_OR_RETURN(p.pid, Spawn(s, p));
  s.procs.push_back(p);
  absl::Status st = WaitRegistered(s, {name}, deadline);
  if (st.ok()) {
    absl::StatusOr<int> port = WaitForPortFile(s, s.procs.back(), deadline);
    if (port.ok()) s.procs.back().port = *port;
  } else {
    StopProcs(s, {&s.procs.back()}, absl::Seconds(3));
    s.procs.pop_back();
    return absl::Status(st.code(), absl::StrCat("cluster add failed: ", st.message(),
                                                "\nlog: ", LogPath(s, name).string()));
  }
  TANDEM_RETURN_IF_ERROR(SaveState(s));
  std::printf("tandem cluster: added %s (pid %d, port %d)\n", name.c_str(), p.pid,
              s.procs.back().port);
  return absl::OkStatus();
}

absl::Status ClusterRemove(const std::string& dir, const std::string& name, absl::Duration grace) {
  TANDEM_ASSIGN_OR_RETURN(State s, LoadState(dir));
  auto it =
      std::find_if(s.procs.begin(), s.procs.end(), [&](const Proc& p) { return p.name == name; });
  if (it == s.procs.end()) {
    return absl::NotFoundError(absl::StrCat("the cluster in ", dir, " has no process ", name));
  }
  if (it->role == "router" || it->role == "kvstore") {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", it->role, " cannot be removed; use tandem cluster down"));
  }
  StopProcs(s, {&*it}, grace);
  s.procs.erase(it);
  TANDEM_RETURN_IF_ERROR(SaveState(s));
  std::printf("tandem cluster: removed %s\n", name.c_str());
  return absl::OkStatus();
}

}  // namespace tandem::tools
