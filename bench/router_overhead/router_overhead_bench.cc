// What the router adds to a request's latency: the same open-loop trace of 1-token requests
// sent straight to a colocated worker (DecodeWorker.Decode with prefill_locally, as the router
// itself calls it) and through the router (Inference.Generate), in alternating rounds, and the
// latency quantiles of each and their difference. Not a test; see run.sh and
// docs/perf/router-overhead.md.
//
// Every request is sent from one thread at its Poisson arrival time with gRPC's callback API, so
// the client holds no thread per request and a slow reply never delays the next send. Latency is
// from the send to the end of the stream (the one token, then the status).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "tandem/v1/inference.grpc.pb.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "tools/tandem/bench_stats.h"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
namespace v1 = tandem::v1;

struct Options {
  std::string router, worker;
  double rate = 1000;
  double seconds = 10;
  int rounds = 3;
  int prompt_len = 4;
  int vocab = 256;  // below every real vocabulary's size
  uint64_t seed = 1;
  double timeout_s = 10;
  std::string out;
};

// One round's results for one target.
struct Results {
  std::vector<double> latency_ms;  // completed requests only
  int errors = 0;
  std::string first_error;
};

class Round;

// One request in flight: its own context, request and reply, freed when the stream ends.
class Call final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  Call(Round* round, int index) : round_(round), index_(index) {}
  grpc::ClientContext ctx;
  v1::GenerateRequest generate;
  v1::DecodeRequest decode;
  v1::GenerateResponse reply;
  Clock::time_point sent;
  int tokens = 0;

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows
    tokens += reply.token_ids_size();
    StartRead(&reply);
  }
  void OnDone(const grpc::Status& status) override;

 private:
  Round* round_;
  int index_;
};

class Round {
 public:
  Round(int n) : latency_ms_(n, -1), status_(n) {}

  void Done(int index, Clock::time_point sent, const grpc::Status& status, int tokens) {
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - sent).count();
    std::lock_guard<std::mutex> lock(mu_);
    if (status.ok() && tokens == 1) {
      latency_ms_[index] = ms;
    } else {
      status_[index] = status.ok()
                           ? "expected 1 token, got " + std::to_string(tokens)
                           : std::to_string(status.error_code()) + ": " + status.error_message();
    }
    if (++done_ == static_cast<int>(latency_ms_.size())) cv_.notify_all();
  }

  // Waits for every request (each has its own deadline, so this ends).
  Results Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ == static_cast<int>(latency_ms_.size()); });
    Results r;
    for (size_t i = 0; i < latency_ms_.size(); ++i) {
      if (latency_ms_[i] >= 0) {
        r.latency_ms.push_back(latency_ms_[i]);
      } else {
        if (r.errors++ == 0) r.first_error = status_[i];
      }
    }
    return r;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<double> latency_ms_;
  std::vector<std::string> status_;
  int done_ = 0;
};

void Call::OnDone(const grpc::Status& status) {
  round_->Done(index_, sent, status, tokens);
  delete this;
}

// The trace: arrival offsets (seconds) and prompts, the same for both targets.
struct Trace {
  std::vector<double> at_s;
  std::vector<std::vector<int32_t>> prompts;
};

Trace MakeTrace(const Options& o, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(o.rate);
  // Tokens away from the special ids at the start of the vocabulary.
  std::uniform_int_distribution<int32_t> token(std::min(100, o.vocab - 1), o.vocab - 1);
  Trace t;
  for (double s = gap(rng); s < o.seconds; s += gap(rng)) {
    t.at_s.push_back(s);
    std::vector<int32_t> p(o.prompt_len);
    for (int32_t& id : p) id = token(rng);
    t.prompts.push_back(std::move(p));
  }
  return t;
}

v1::SamplingParams OneToken() {
  v1::SamplingParams s;
  s.set_temperature(0);
  s.set_max_tokens(1);
  s.set_ignore_eos(true);
  return s;
}

Results RunRound(const Options& o, const Trace& t, bool via_router, v1::Inference::Stub* router,
                 v1::DecodeWorker::Stub* worker, int round_no) {
  const int n = static_cast<int>(t.at_s.size());
  Round round(n);
  const Clock::time_point start = Clock::now() + std::chrono::milliseconds(50);
  for (int i = 0; i < n; ++i) {
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(t.at_s[i])));
    auto* c = new Call(&round, i);
    c->ctx.set_deadline(std::chrono::system_clock::now() +
                        std::chrono::duration_cast<std::chrono::system_clock::duration>(
                            std::chrono::duration<double>(o.timeout_s)));
    const std::string id = "ovh-" + std::to_string(round_no) + "-" + std::to_string(i);
    if (via_router) {
      c->generate.set_request_id(id);
      *c->generate.mutable_token_ids()->mutable_ids() = {t.prompts[i].begin(), t.prompts[i].end()};
      *c->generate.mutable_sampling() = OneToken();
      c->sent = Clock::now();
      router->async()->Generate(&c->ctx, &c->generate, c);
    } else {
      c->decode.set_request_id(id);
      *c->decode.mutable_prompt_token_ids() = {t.prompts[i].begin(), t.prompts[i].end()};
      *c->decode.mutable_sampling() = OneToken();
      c->decode.set_prefill_locally(true);
      c->sent = Clock::now();
      worker->async()->Decode(&c->ctx, &c->decode, c);
    }
    c->StartRead(&c->reply);
    c->StartCall();
  }
  return round.Wait();
}

constexpr double kPercentiles[] = {50, 90, 99, 99.9};
constexpr const char* kNames[] = {"p50_ms", "p90_ms", "p99_ms", "p999_ms"};

json Summary(const std::vector<double>& ms, int errors, double offered_s) {
  json j = {{"completed", ms.size()},
            {"errors", errors},
            {"throughput_rps", static_cast<double>(ms.size()) / offered_s}};
  double sum = 0;
  for (double v : ms) sum += v;
  j["mean_ms"] = ms.empty() ? NAN : sum / static_cast<double>(ms.size());
  for (size_t k = 0; k < std::size(kPercentiles); ++k) {
    j[kNames[k]] = tandem::tools::bench::PercentileLinear(ms, kPercentiles[k]);
  }
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Latency the router adds to 1-token requests, against calling a worker directly"};
  app.add_option("--router", o.router, "Router host:port")->required();
  app.add_option("--worker", o.worker, "Colocated worker host:port")->required();
  app.add_option("--rate", o.rate, "Requests per second (Poisson)")->check(CLI::PositiveNumber);
  app.add_option("--seconds", o.seconds, "Length of each round")->check(CLI::PositiveNumber);
  app.add_option("--rounds", o.rounds, "Rounds per target, alternating")
      ->check(CLI::PositiveNumber);
  app.add_option("--prompt-len", o.prompt_len, "Prompt tokens")->check(CLI::Range(1, 4096));
  app.add_option("--vocab", o.vocab, "Token ids are drawn below this")
      ->check(CLI::Range(2, 1 << 24));
  app.add_option("--seed", o.seed);
  app.add_option("--timeout-s", o.timeout_s, "Deadline of each request")
      ->check(CLI::PositiveNumber);
  app.add_option("--out", o.out, "JSON results");
  CLI11_PARSE(app, argc, argv);

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  auto router = v1::Inference::NewStub(
      grpc::CreateCustomChannel(o.router, grpc::InsecureChannelCredentials(), args));
  auto worker = v1::DecodeWorker::NewStub(
      grpc::CreateCustomChannel(o.worker, grpc::InsecureChannelCredentials(), args));

  std::vector<double> all[2];
  int errors[2] = {0, 0};
  json rounds = json::array();
  int round_no = 0;
  // Warm both paths (connections, the engine's first steps) with a short round each, unrecorded.
  {
    Options warm = o;
    warm.seconds = std::min(1.0, o.seconds);
    const Trace t = MakeTrace(warm, o.seed + 1000);
    for (bool via_router : {false, true}) {
      const Results r = RunRound(warm, t, via_router, router.get(), worker.get(), round_no++);
      if (r.latency_ms.empty()) {
        std::fprintf(stderr, "%s: no request completed in the warm-up (%d failed; first: %s)\n",
                     via_router ? "router" : "worker", r.errors, r.first_error.c_str());
        return 1;
      }
    }
  }
  for (int k = 0; k < o.rounds; ++k) {
    const Trace t = MakeTrace(o, o.seed + static_cast<uint64_t>(k));
    // Alternate which goes first, so drift within a pair does not favour either.
    for (int j = 0; j < 2; ++j) {
      const bool via_router = (j == 1) != (k % 2 == 1);
      const Results r = RunRound(o, t, via_router, router.get(), worker.get(), round_no++);
      const int target = via_router ? 1 : 0;
      all[target].insert(all[target].end(), r.latency_ms.begin(), r.latency_ms.end());
      errors[target] += r.errors;
      json s = Summary(r.latency_ms, r.errors, o.seconds);
      s["round"] = k;
      s["target"] = via_router ? "router" : "worker";
      if (r.errors > 0) s["first_error"] = r.first_error;
      std::fprintf(stderr, "round %d %-6s p50 %.2f p99 %.2f ms, %d errors\n", k,
                   via_router ? "router" : "worker", s["p50_ms"].get<double>(),
                   s["p99_ms"].get<double>(), r.errors);
      rounds.push_back(std::move(s));
    }
  }
  const double offered = o.seconds * o.rounds;
  json direct = Summary(all[0], errors[0], offered), routed = Summary(all[1], errors[1], offered);
  json added;
  for (const char* name : kNames)
    added[name] = routed[name].get<double>() - direct[name].get<double>();
  json result = {{"config",
                  {{"rate", o.rate},
                   {"seconds", o.seconds},
                   {"rounds", o.rounds},
                   {"prompt_len", o.prompt_len},
                   {"seed", o.seed}}},
                 {"worker", direct},
                 {"router", routed},
                 {"added_by_router", added},
                 {"rounds", rounds}};
  std::printf("%-8s %9s %9s %9s %9s %9s %7s\n", "", "mean_ms", "p50_ms", "p90_ms", "p99_ms",
              "p999_ms", "errors");
  for (const auto& [name, s] : {std::pair{"worker", &direct}, std::pair{"router", &routed}}) {
    std::printf("%-8s %9.3f %9.3f %9.3f %9.3f %9.3f %7d\n", name, (*s)["mean_ms"].get<double>(),
                (*s)["p50_ms"].get<double>(), (*s)["p90_ms"].get<double>(),
                (*s)["p99_ms"].get<double>(), (*s)["p999_ms"].get<double>(),
                (*s)["errors"].get<int>());
  }
  std::printf("%-8s %9s %9.3f %9.3f %9.3f %9.3f\n", "added", "", added["p50_ms"].get<double>(),
              added["p90_ms"].get<double>(), added["p99_ms"].get<double>(),
              added["p999_ms"].get<double>());
  if (!o.out.empty()) std::ofstream(o.out) << result.dump(2) << "\n";
  return errors[0] + errors[1] > 0 ? 2 : 0;
}
