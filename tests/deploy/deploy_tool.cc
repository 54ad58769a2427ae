// deploy_tool: the pod harness's probe and client (tests/deploy/pod_harness.py runs it inside
// pod and client network namespaces). A test binary: nothing here is part of the product.
//
//   deploy_tool probe grpc|http|tcp HOST:PORT [PATH] [--timeout-ms N]
//       Kubernetes probe semantics: grpc.health.v1 Check of service "" is SERVING; an HTTP GET
//       answers 200..399; a TCP connect succeeds. Exit 0 on success, 1 otherwise.
//   deploy_tool get HOST:PORT PATH          prints the body of an HTTP GET (metrics scrapes)
//   deploy_tool workers --router HOST:PORT  prints Registry.ListWorkers as JSON
//   deploy_tool stats --worker HOST:PORT --role prefill|decode   prints the worker's Stats
//   deploy_tool generate --router HOST:PORT --prompts FILE --max-tokens N [--ignore-eos]
//       [--progress FILE] --out FILE [--retry-ms N]
//       One greedy stream per line of FILE, all at once. While they run, FILE --progress holds
//       [{"seen": tokens, "decode_worker": id, "done": bool}] (rewritten atomically every 20 ms).
//       --retry-ms: a stream that fails with UNAVAILABLE before its first token is sent again
//       until this much time has passed (a client's retry on another router).
//   deploy_tool load --router HOST:PORT --prompts FILE --max-tokens N --concurrency C
//       --stop-file FILE --out FILE
//       A closed loop: C threads each send the next prompt as soon as their last request
//       ended, until the stop file exists. The out file lists every request (start and end
//       wall time, status, workers) and the totals.
// Every command that dials gRPC takes [--tls-ca F [--tls-cert F --tls-key F]] [--server-name N]
// and generate/load take [--api-key KEY] (sent as `authorization: Bearer KEY`).
// Channels to a router use the round_robin policy, so a name that resolves to several router
// pods spreads the streams over all of them (as a client of a headless Service would).
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "google/protobuf/util/json_util.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "tandem/v1/inference.grpc.pb.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace {

using Clock = std::chrono::system_clock;
using json = nlohmann::json;

struct Args {
  std::vector<std::string> positional;
  std::map<std::string, std::string> flags;
  std::string Get(const std::string& k, const std::string& def = "") const {
    auto it = flags.find(k);
    return it == flags.end() ? def : it->second;
  }
  int GetInt(const std::string& k, int def) const {
    auto it = flags.find(k);
    return it == flags.end() ? def : std::stoi(it->second);
  }
  bool Has(const std::string& k) const { return flags.count(k) > 0; }
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s.rfind("--", 0) == 0) {
      std::string key = s.substr(2), value;
      const size_t eq = key.find('=');
      if (eq != std::string::npos) {
        value = key.substr(eq + 1);
        key = key.substr(0, eq);
      } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        value = argv[++i];
      } else {
        value = "1";
      }
      a.flags[key] = value;
    } else {
      a.positional.push_back(s);
    }
  }
  return a;
}

double Now() {
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

std::chrono::system_clock::time_point Deadline(int ms) {
  return Clock::now() + std::chrono::milliseconds(ms);
}

void WriteAtomically(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << content;
  }
  std::filesystem::rename(tmp, path);
}

std::vector<std::string> ReadLines(const std::string& path) {
  std::vector<std::string> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

std::string Slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Plaintext, or TLS with --tls-ca (and --tls-cert/--tls-key for mTLS); --server-name is the
// name the server's certificate must carry (servers are dialled by IP or Service name).
std::shared_ptr<grpc::ChannelCredentials> Credentials(const Args& a) {
  if (!a.Has("tls-ca")) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = Slurp(a.Get("tls-ca"));
  if (a.Has("tls-cert")) {
    o.pem_cert_chain = Slurp(a.Get("tls-cert"));
    o.pem_private_key = Slurp(a.Get("tls-key"));
  }
  return grpc::SslCredentials(o);
}

grpc::ChannelArguments BaseArgs(const Args& a) {
  grpc::ChannelArguments args;
  if (a.Has("server-name")) args.SetSslTargetNameOverride(a.Get("server-name"));
  return args;
}

std::shared_ptr<grpc::Channel> Channel(const Args& a, const std::string& target) {
  return grpc::CreateCustomChannel(target, Credentials(a), BaseArgs(a));
}

// The distinct IP addresses HOST of HOST:PORT resolves to (the pod's /etc/hosts), as text.
std::vector<std::string> ResolveAll(std::string hostport) {
  std::vector<std::string> ips;
  if (hostport.rfind("dns:///", 0) == 0) hostport = hostport.substr(7);
  const size_t colon = hostport.rfind(':');
  if (colon == std::string::npos) return ips;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(hostport.substr(0, colon).c_str(), nullptr, &hints, &res) != 0) return ips;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    const void* addr = ai->ai_family == AF_INET
                           ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(ai->ai_addr)->sin_addr)
                           : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(ai->ai_addr)->sin6_addr);
    if (inet_ntop(ai->ai_family, addr, buf, sizeof(buf)) == nullptr) continue;
    if (std::find(ips.begin(), ips.end(), buf) == ips.end()) ips.emplace_back(buf);
  }
  freeaddrinfo(res);
  return ips;
}

// settle: before the first real call, make sure every router the name resolves to is in the
// round_robin rotation. round_robin picks among the subchannels that are READY, so calls made
// while only the first router had connected would all go to it; cheap ListModels calls are
// sent until each resolved address has answered one (ClientContext::peer()), for at most 10 s.
// Long-lived clients are past this point anyway.
std::shared_ptr<grpc::Channel> RouterChannel(const Args& a, const std::string& target,
                                             bool settle) {
  grpc::ChannelArguments args = BaseArgs(a);
  args.SetServiceConfigJSON(R"({"loadBalancingConfig": [{"round_robin": {}}]})");
  // Rejoin a restarted router quickly (gRPC's default backoff grows to minutes).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto channel = grpc::CreateCustomChannel(target, Credentials(a), args);
  channel->WaitForConnected(Deadline(5000));
  if (!settle) return channel;
  const std::vector<std::string> want = ResolveAll(target);
  auto stub = tandem::v1::Inference::NewStub(channel);
  std::vector<std::string> seen;
  for (const auto until = Deadline(10000); seen.size() < want.size() && Clock::now() < until;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(1000));
    if (a.Has("api-key")) ctx.AddMetadata("authorization", "Bearer " + a.Get("api-key"));
    tandem::v1::ListModelsRequest req;
    tandem::v1::ListModelsResponse resp;
    stub->ListModels(&ctx, req, &resp);  // refused or not, it reached the router peer() names
    const std::string peer = ctx.peer();  // "ipv4:10.1.0.5:50051", "ipv6:[fd00::5]:50051"
    for (const std::string& ip : want) {
      const bool match = peer.find(":" + ip + ":") != std::string::npos ||
                         peer.find("[" + ip + "]") != std::string::npos;
      if (match && std::find(seen.begin(), seen.end(), ip) == seen.end()) seen.push_back(ip);
    }
    if (seen.size() < want.size()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (seen.size() < want.size()) {
    std::fprintf(stderr, "deploy_tool: %zu of %zu router addresses of %s answered in 10 s\n",
                 seen.size(), want.size(), target.c_str());
  }
  return channel;
}

// host:port -> a connected TCP socket, or -1.
int Connect(const std::string& hostport, int timeout_ms) {
  const size_t colon = hostport.rfind(':');
  if (colon == std::string::npos) return -1;
  const std::string host = hostport.substr(0, colon), port = hostport.substr(colon + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) return -1;
  int fd = -1;
  for (addrinfo* ai = res; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    if (fd < 0) continue;
    timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  return fd;
}

// HTTP/1.0 GET; returns the status code (0 when the request failed) and the body.
int HttpGet(const std::string& hostport, const std::string& path, int timeout_ms,
            std::string* body) {
  const int fd = Connect(hostport, timeout_ms);
  if (fd < 0) return 0;
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: " + hostport + "\r\n\r\n";
  if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return 0;
  }
  std::string resp;
  char buf[65536];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) resp.append(buf, n);
  close(fd);
  int code = 0;
  if (std::sscanf(resp.c_str(), "HTTP/%*s %d", &code) != 1) return 0;
  const size_t start = resp.find("\r\n\r\n");
  if (body != nullptr) *body = start == std::string::npos ? "" : resp.substr(start + 4);
  return code;
}

int Probe(const Args& a) {
  if (a.positional.size() < 3) {
    std::fprintf(stderr, "usage: deploy_tool probe grpc|http|tcp HOST:PORT [PATH]\n");
    return 2;
  }
  const std::string& kind = a.positional[1];
  const std::string& target = a.positional[2];
  const int timeout_ms = a.GetInt("timeout-ms", 1000);
  if (kind == "tcp") {
    const int fd = Connect(target, timeout_ms);
    if (fd >= 0) close(fd);
    return fd >= 0 ? 0 : 1;
  }
  if (kind == "http") {
    const int code =
        HttpGet(target, a.positional.size() > 3 ? a.positional[3] : "/", timeout_ms, nullptr);
    return code >= 200 && code < 400 ? 0 : 1;
  }
  if (kind == "grpc") {
    // grpc.health.v1.Health/Check with an empty request (service ""), answered with
    // HealthCheckResponse{status = SERVING (1)}: field 1, varint 1.
    auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
    grpc::GenericStub stub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(timeout_ms));
    grpc::ByteBuffer request, response;
    std::string service = a.Get("service");
    std::string payload;
    if (!service.empty()) {
      payload.push_back(0x0a);
      payload.push_back(static_cast<char>(service.size()));
      payload += service;
    }
    grpc::Slice slice(payload);
    request = grpc::ByteBuffer(&slice, 1);
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                   [&](grpc::Status s) {
                     std::lock_guard<std::mutex> l(mu);
                     status = s;
                     done = true;
                     cv.notify_all();
                   });
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
    if (!status.ok()) {
      std::fprintf(stderr, "probe grpc %s: %s\n", target.c_str(), status.error_message().c_str());
      return 1;
    }
    std::vector<grpc::Slice> slices;
    (void)response.Dump(&slices);
    std::string bytes;
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    return bytes == std::string("\x08\x01", 2) ? 0 : 1;
  }
  std::fprintf(stderr, "unknown probe kind %s\n", kind.c_str());
  return 2;
}

int Get(const Args& a) {
  if (a.positional.size() < 3) return 2;
  std::string body;
  const int code = HttpGet(a.positional[1], a.positional[2], a.GetInt("timeout-ms", 2000), &body);
  std::fwrite(body.data(), 1, body.size(), stdout);
  return code == 200 ? 0 : 1;
}

std::string ToJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

int Workers(const Args& a) {
  auto stub = tandem::v1::Registry::NewStub(Channel(a, a.Get("router")));
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(a.GetInt("timeout-ms", 2000)));
  tandem::v1::ListWorkersResponse resp;
  grpc::Status st = stub->ListWorkers(&ctx, tandem::v1::ListWorkersRequest(), &resp);
  if (!st.ok()) {
    std::fprintf(stderr, "ListWorkers %s: %s\n", a.Get("router").c_str(),
                 st.error_message().c_str());
    return 1;
  }
  std::printf("%s\n", ToJson(resp).c_str());
  return 0;
}

int Stats(const Args& a) {
  auto channel = Channel(a, a.Get("worker"));
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(a.GetInt("timeout-ms", 2000)));
  tandem::v1::WorkerStats resp;
  grpc::Status st;
  if (a.Get("role") == "prefill") {
    st = tandem::v1::PrefillWorker::NewStub(channel)->Stats(&ctx, {}, &resp);
  } else {
    st = tandem::v1::DecodeWorker::NewStub(channel)->Stats(&ctx, {}, &resp);
  }
  if (!st.ok()) {
    std::fprintf(stderr, "Stats %s: %s\n", a.Get("worker").c_str(), st.error_message().c_str());
    return 1;
  }
  std::printf("%s\n", ToJson(resp).c_str());
  return 0;
}

struct StreamResult {
  std::atomic<int> seen{0};
  std::atomic<bool> done{false};
  std::mutex mu;
  std::string decode_worker;  // of the latest message
  json out;
};

tandem::v1::GenerateRequest Greedy(const std::string& prompt, int max_tokens, bool ignore_eos) {
  tandem::v1::GenerateRequest req;
  req.set_text(prompt);
  tandem::v1::SamplingParams* s = req.mutable_sampling();
  s->set_temperature(0);
  s->set_max_tokens(max_tokens);
  s->set_ignore_eos(ignore_eos);
  return req;
}

// One streaming Generate; retried while it fails with UNAVAILABLE before its first token and
// `retry_until` has not passed.
void RunStream(tandem::v1::Inference::Stub* stub, const tandem::v1::GenerateRequest& req,
               double retry_until, const std::string& api_key, StreamResult* r) {
  json& o = r->out;
  o["prompt"] = req.text();
  o["attempts"] = 0;
  const double start = Now();
  for (;;) {
    o["attempts"] = o["attempts"].get<int>() + 1;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(120000));
    if (!api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + api_key);
    auto reader = stub->Generate(&ctx, req);
    tandem::v1::GenerateResponse m;
    std::vector<int32_t> tokens;
    std::string text;
    json decode_workers = json::array();
    std::string prefill_worker, finish;
    json onboarding;
    int cached = 0;
    double first_token = 0;
    while (reader->Read(&m)) {
      if (first_token == 0 && m.token_ids_size() > 0) first_token = Now();
      tokens.insert(tokens.end(), m.token_ids().begin(), m.token_ids().end());
      text += m.text();
      if (!m.prefill_worker().empty()) prefill_worker = m.prefill_worker();
      if (!m.decode_worker().empty()) {
        if (decode_workers.empty() || decode_workers.back() != m.decode_worker()) {
          decode_workers.push_back(m.decode_worker());
        }
        std::lock_guard<std::mutex> l(r->mu);
        r->decode_worker = m.decode_worker();
      }
      if (m.has_ttft()) {
        const auto& p = m.ttft().prefix_onboarding_tiers();
        onboarding = {{"device", p.device()}, {"host", p.host()}, {"ssd", p.ssd()}};
      }
      if (m.has_usage()) cached = m.usage().cached_prompt_tokens();
      if (m.finished()) finish = tandem::v1::FinishReason_Name(m.finish_reason());
      r->seen = static_cast<int>(tokens.size());
    }
    grpc::Status st = reader->Finish();
    if (!st.ok() && st.error_code() == grpc::StatusCode::UNAVAILABLE && tokens.empty() &&
        Now() < retry_until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    o["tokens"] = tokens;
    o["text"] = text;
    o["code"] = static_cast<int>(st.error_code());
    o["message"] = st.error_message();
    o["prefill_worker"] = prefill_worker;
    o["decode_workers"] = decode_workers;
    o["finish_reason"] = finish;
    o["onboarding_seconds"] = onboarding;
    o["cached_prompt_tokens"] = cached;
    o["start"] = start;
    o["first_token"] = first_token;
    o["end"] = Now();
    break;
  }
  r->done = true;
}

int Generate(const Args& a) {
  const std::vector<std::string> prompts = ReadLines(a.Get("prompts"));
  auto stub =
      tandem::v1::Inference::NewStub(RouterChannel(a, a.Get("router"), prompts.size() > 1));
  const int max_tokens = a.GetInt("max-tokens", 32);
  const bool ignore_eos = a.Has("ignore-eos");
  const double retry_until = Now() + a.GetInt("retry-ms", 0) / 1000.0;
  std::vector<std::unique_ptr<StreamResult>> results;
  std::vector<std::thread> threads;
  for (const std::string& p : prompts) {
    results.push_back(std::make_unique<StreamResult>());
    threads.emplace_back(RunStream, stub.get(), Greedy(p, max_tokens, ignore_eos), retry_until,
                         a.Get("api-key"), results.back().get());
  }
  const std::string progress = a.Get("progress");
  auto write_progress = [&] {
    if (progress.empty()) return;
    json arr = json::array();
    for (auto& r : results) {
      std::lock_guard<std::mutex> l(r->mu);
      arr.push_back({{"seen", r->seen.load()}, {"decode_worker", r->decode_worker},
                     {"done", r->done.load()}});
    }
    WriteAtomically(progress, arr.dump());
  };
  for (;;) {
    bool all = true;
    for (auto& r : results) all = all && r->done;
    write_progress();
    if (all) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (std::thread& t : threads) t.join();
  json out = json::array();
  int failed = 0;
  for (auto& r : results) {
    out.push_back(r->out);
    failed += r->out["code"].get<int>() != 0;
  }
  WriteAtomically(a.Get("out"), out.dump());
  return failed == 0 ? 0 : 1;
}

int Load(const Args& a) {
  const std::vector<std::string> prompts = ReadLines(a.Get("prompts"));
  if (prompts.empty()) return 2;
  auto stub = tandem::v1::Inference::NewStub(RouterChannel(a, a.Get("router"), true));
  const int max_tokens = a.GetInt("max-tokens", 16);
  const std::string stop_file = a.Get("stop-file");
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  json requests = json::array();
  std::vector<std::thread> threads;
  for (int t = 0; t < a.GetInt("concurrency", 4); ++t) {
    threads.emplace_back([&] {
      while (!std::filesystem::exists(stop_file)) {
        const uint64_t i = next++;
        StreamResult r;
        RunStream(stub.get(), Greedy(prompts[i % prompts.size()], max_tokens, false), 0,
                  a.Get("api-key"), &r);
        r.out.erase("tokens");
        r.out["index"] = i;
        std::lock_guard<std::mutex> l(mu);
        requests.push_back(std::move(r.out));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  int failed = 0;
  for (const json& r : requests) failed += r["code"].get<int>() != 0;
  json out = {{"total", requests.size()}, {"failed", failed}, {"requests", requests}};
  WriteAtomically(a.Get("out"), out.dump());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  const std::string cmd = a.positional.empty() ? "" : a.positional[0];
  if (cmd == "probe") return Probe(a);
  if (cmd == "get") return Get(a);
  if (cmd == "workers") return Workers(a);
  if (cmd == "stats") return Stats(a);
  if (cmd == "generate") return Generate(a);
  if (cmd == "load") return Load(a);
  std::fprintf(stderr,
               "usage: deploy_tool probe|get|workers|stats|generate|load ... (see the source)\n");
  return 2;
}
