#include "tools/tandem/bench.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "services/common/sampling_convert.h"
#include "services/common/tls.h"
#include "tandem/v1/inference.grpc.pb.h"
#include "tools/tandem/bench_plot.h"
#include "tools/tandem/bench_report.h"
#include "tools/tandem/bench_stats.h"
#include "tools/tandem/bench_workload.h"

namespace tandem::tools {
namespace {

using Clock = std::chrono::steady_clock;
using bench::BenchStats;
using bench::PlannedRequest;
using bench::RequestResult;
using bench::Run;

double SecondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Progress on stderr: a redrawn bar on a terminal, a line at every 10% otherwise.
class Progress {
 public:
  Progress(int total, std::string label, bool quiet)
      : total_(total), label_(std::move(label)), quiet_(quiet), tty_(isatty(2) == 1) {}
  void Done(int n) {
    if (quiet_ || total_ <= 0) return;
    std::lock_guard<std::mutex> l(mu_);
    const int pct = n * 100 / total_;
    if (tty_) {
      constexpr int kWidth = 40;
      const int filled = n * kWidth / total_;
      std::fprintf(stderr, "\r%s [%s%s] %d/%d", label_.c_str(), std::string(filled, '#').c_str(),
                   std::string(kWidth - filled, ' ').c_str(), n, total_);
      if (n == total_) std::fprintf(stderr, "\n");
    } else if (pct / 10 > last_decile_) {
      last_decile_ = pct / 10;
      std::fprintf(stderr, "%s: %d/%d requests (%d%%)\n", label_.c_str(), n, total_, pct);
    }
    std::fflush(stderr);
  }

 private:
  const int total_;
  const std::string label_;
  const bool quiet_;
  const bool tty_;
  std::mutex mu_;
  int last_decile_ = 0;
};

// Multi-turn ordering: a session's turn k waits until turn k-1 has ended.
class SessionGate {
 public:
  explicit SessionGate(const std::vector<PlannedRequest>& reqs) {
    int sessions = 0;
    for (const PlannedRequest& r : reqs) sessions = std::max(sessions, r.session + 1);
    done_.assign(static_cast<size_t>(sessions), 0);
  }
  void WaitTurn(const PlannedRequest& r) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return done_[r.session] >= r.turn; });
  }
  void EndTurn(const PlannedRequest& r) {
    {
      std::lock_guard<std::mutex> l(mu_);
      done_[r.session] = std::max(done_[r.session], r.turn + 1);
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> done_;
};

// `prompt`: p's, or with --sessions the conversation as it happened.
RequestResult SendOne(v1::Inference::Stub& stub, const BenchOptions& o,
                      const std::vector<bench::RequestClass>& classes, const PlannedRequest& p,
                      const std::vector<int32_t>& prompt, Clock::time_point run_start) {
  RequestResult r;
  v1::GenerateRequest req;
  req.set_model(o.model);
  if (o.sessions) req.set_session_id(absl::StrCat("bench-", o.seed, "-", p.session));
  if (p.cls >= 0) {
    const bench::RequestClass& c = classes[static_cast<size_t>(p.cls)];
    req.set_priority(*services::PriorityFromName(c.name));  // checked in RunBench
    if (o.send_targets) {
      req.set_ttft_target_ms(static_cast<uint32_t>(std::ceil(c.ttft_ms)));
      req.set_tpot_target_ms(static_cast<uint32_t>(std::ceil(c.tpot_ms)));
    }
  }
  req.mutable_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
  v1::SamplingParams* s = req.mutable_sampling();
  s->set_max_tokens(p.max_tokens);
  s->set_temperature(0);
  s->set_ignore_eos(true);
  s->set_seed(o.seed);
  grpc::ClientContext cc;
  if (!o.api_key.empty()) cc.AddMetadata("authorization", "Bearer " + o.api_key);
  if (o.timeout_ms > 0) {
    cc.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(o.timeout_ms));
  }
  const Clock::time_point sent = Clock::now();
  r.start_s = SecondsBetween(run_start, sent);
  r.prompt_tokens = static_cast<int>(prompt.size());
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub.Generate(&cc, req);
  v1::GenerateResponse m;
  Clock::time_point last{};
  bool have_first = false;
  while (reader->Read(&m)) {
    const Clock::time_point now = Clock::now();
    if (m.token_ids_size() > 0) {
      if (!have_first) {
        r.ttft_s = SecondsBetween(sent, now);
        have_first = true;
      } else {
        r.itl_s.push_back(SecondsBetween(last, now));
      }
      last = now;
      r.output_tokens += m.token_ids_size();
      if (o.sessions) r.output_ids.insert(r.output_ids.end(), m.token_ids().begin(), m.token_ids().end());
    }
    if (m.finished() && m.has_ttft()) {
      const v1::TtftBreakdown& t = m.ttft();
      r.server_queue_s = t.queue();
      r.server_prefill_s = t.prefill_compute();
      r.server_kv_transfer_s = t.kv_transfer();
      r.server_onboarding_s = t.prefix_onboarding();
      r.server_first_decode_s = t.first_decode_step();
    }
    if (m.finished() && m.has_usage()) {
      r.spec_verify_steps = m.usage().spec_verify_steps();
      r.spec_draft_tokens = m.usage().spec_draft_tokens();
      r.spec_accepted_tokens = m.usage().spec_accepted_tokens();
      r.kv_transfer_bytes = m.usage().kv_transfer_bytes();
      r.decode_held_tokens = m.usage().decode_held_tokens();
    }
  }
  const grpc::Status gs = reader->Finish();
  r.e2e_s = SecondsBetween(sent, Clock::now());
  r.ok = gs.ok();
  r.status_code = static_cast<int>(gs.error_code());
  if (!gs.ok()) {
    r.error = absl::StrCat(static_cast<int>(gs.error_code()), ": ", gs.error_message());
  }
  return r;
}

// Sends every planned request once; fills run.results (in plan order) and run.stats.
void Execute(const BenchOptions& o, const std::vector<PlannedRequest>& plan,
             const std::vector<bench::RequestClass>& classes, const std::vector<double>& arrivals,
             const bench::Slo& slo, const std::shared_ptr<grpc::Channel>& channel, Run& run) {
  const int n = static_cast<int>(plan.size());
  run.results.assign(plan.size(), RequestResult{});
  SessionGate gate(plan);
  // --sessions: each conversation's last prompt plus its reply, the next turn's history. A
  // conversation's turns run one after another (the gate), so each entry has one user at a time.
  std::vector<std::vector<int32_t>> history;
  if (o.sessions) {
    for (const PlannedRequest& p : plan) {
      history.resize(std::max(history.size(), static_cast<size_t>(p.session) + 1));
    }
  }
  Progress progress(n, run.label, o.quiet);
  std::atomic<int> finished{0};
  auto stub = v1::Inference::NewStub(channel);
  const Clock::time_point start = Clock::now();
  std::vector<double> ends(plan.size(), 0);
  // An in-flight cap for open loop (0: none).
  std::mutex cap_mu;
  std::condition_variable cap_cv;
  int in_flight = 0;
  auto send = [&](int i) {
    gate.WaitTurn(plan[i]);
    const PlannedRequest& p = plan[i];
    std::vector<int32_t> prompt = p.prompt;
    if (o.sessions && p.turn > 0) {
      // The history as it happened, then this turn's fresh tokens (the plan's last input_len).
      std::vector<int32_t>& h = history[static_cast<size_t>(p.session)];
      prompt = h;
      prompt.insert(prompt.end(), p.prompt.end() - o.input_len, p.prompt.end());
    }
    run.results[i] = SendOne(*stub, o, classes, p, prompt, start);
    if (o.workload == "multi-turn") {
      run.results[i].session = p.session;
      run.results[i].turn = p.turn;
    }
    if (o.sessions) {
      std::vector<int32_t>& h = history[static_cast<size_t>(p.session)];
      h = std::move(prompt);
      h.insert(h.end(), run.results[i].output_ids.begin(), run.results[i].output_ids.end());
    }
    ends[i] = SecondsBetween(start, Clock::now());
    gate.EndTurn(plan[i]);
    progress.Done(++finished);
  };
  std::vector<std::thread> threads;
  if (!run.open_loop) {
    std::atomic<int> next{0};
    for (int c = 0; c < run.concurrency; ++c) {
      threads.emplace_back([&] {
        for (int i = next++; i < n; i = next++) send(i);
      });
    }
  } else {
    for (int i = 0; i < n; ++i) {
      std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(arrivals[i])));
      if (run.concurrency > 0) {
        std::unique_lock<std::mutex> l(cap_mu);
        cap_cv.wait(l, [&] { return in_flight < run.concurrency; });
        in_flight++;
      }
      threads.emplace_back([&, i] {
        send(i);
        if (run.concurrency > 0) {
          {
            std::lock_guard<std::mutex> l(cap_mu);
            in_flight--;
          }
          cap_cv.notify_all();
        }
      });
    }
  }
  for (std::thread& t : threads) t.join();
  const double duration = *std::max_element(ends.begin(), ends.end());
  std::vector<int> cls(plan.size());
  for (size_t i = 0; i < plan.size(); ++i) cls[i] = plan[i].cls;
  bench::ComputeRunStats(run, cls, classes, duration, slo);
}

}  // namespace

absl::Status ParseRates(const std::string& spec, std::vector<double>* out) {
  out->clear();
  for (absl::string_view part : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    double v = 0;
    if (!absl::SimpleAtod(part, &v) || !(v > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("--request-rate: '", std::string(part),
                                                     "' is not a positive number of requests/s"));
    }
    out->push_back(v);
  }
  if (out->empty()) return absl::InvalidArgumentError("--request-rate is empty");
  return absl::OkStatus();
}

absl::Status RunBench(const BenchOptions& o) {
  if (o.router.empty()) return absl::InvalidArgumentError("--router is required");
  if (o.concurrency < 0) return absl::InvalidArgumentError("--concurrency must be >= 0");
  absl::StatusOr<bench::Slo> slo = bench::ParseSlo(o.slo);
  if (!slo.ok()) return slo.status();
  absl::StatusOr<bench::Workload> workload = bench::ParseWorkload(o.workload);
  if (!workload.ok()) return workload.status();
  if (*workload != bench::Workload::kMultiTurn && (o.sessions || o.first_turn_len != 0)) {
    return absl::InvalidArgumentError("--sessions and --first-turn-len need --workload multi-turn");
  }
  if (o.first_turn_len < 0) return absl::InvalidArgumentError("--first-turn-len must be >= 0");
  absl::StatusOr<bench::Arrival> arrival = bench::ParseArrival(o.arrival);
  if (!arrival.ok()) return arrival.status();
  absl::StatusOr<std::vector<bench::RequestClass>> classes = bench::ParseMix(o.mix);
  if (!classes.ok()) return classes.status();
  for (const bench::RequestClass& c : *classes) {
    if (absl::StatusOr<v1::Priority> p = services::PriorityFromName(c.name); !p.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--mix: ", p.status().message()));
    }
  }

  // TLS when --tls-* were given; round_robin over every router the name resolves to.
  auto channel = services::CreateClientChannel(o.router, services::RouterChannelArgs());
  v1::ListModelsResponse models;
  {
    grpc::ClientContext cc;
    if (!o.api_key.empty()) cc.AddMetadata("authorization", "Bearer " + o.api_key);
    cc.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status gs =
        v1::Inference::NewStub(channel)->ListModels(&cc, v1::ListModelsRequest(), &models);
    if (!gs.ok()) {
      return absl::UnavailableError(
          absl::StrCat("router ", o.router, ": ListModels: ", gs.error_message()));
    }
  }
  int32_t vocab = 0;
  std::string model_id;
  for (const v1::ModelInfo& m : models.models()) {
    if (o.model.empty() || m.id() == o.model) {
      vocab = m.vocab_size();
      model_id = m.id();
      break;
    }
  }
  if (vocab == 0) {
    return absl::NotFoundError(
        absl::StrCat("router ", o.router, " does not serve model '", o.model, "'"));
  }

  bench::WorkloadOptions wo;
  wo.workload = *workload;
  wo.num_requests = o.num_requests;
  wo.input_len = o.input_len;
  wo.output_len = o.output_len;
  wo.prefix_len = o.prefix_len;
  wo.turns = o.turns;
  wo.first_turn_len = o.first_turn_len;
  wo.vocab_size = vocab;
  wo.seed = o.seed;
  absl::StatusOr<std::vector<PlannedRequest>> plan = bench::MakeRequests(wo);
  if (!plan.ok()) return plan.status();
  bench::AssignClasses(*classes, o.seed, &*plan);

  std::vector<Run> runs;
  if (o.request_rates.empty()) {
    Run r;
    r.concurrency = std::max(o.concurrency, 1);
    r.label = absl::StrCat("concurrency ", r.concurrency);
    runs.push_back(std::move(r));
  } else {
    for (double rate : o.request_rates) {
      Run r;
      r.open_loop = true;
      r.rate = rate;
      r.concurrency = o.concurrency;
      r.label = absl::StrCat("rate ", rate, "/s");
      runs.push_back(std::move(r));
    }
  }
  for (Run& run : runs) {
    std::vector<double> arrivals;
    if (run.open_loop) {
      absl::StatusOr<std::vector<double>> a =
          bench::ArrivalTimes(o.num_requests, run.rate, *arrival, o.seed, o.burst_size);
      if (!a.ok()) return a.status();
      arrivals = std::move(*a);
    }
    Execute(o, *plan, *classes, arrivals, *slo, channel, run);
    bench::PrintSummary(run, *slo, *classes);
  }

  std::string plot_note;
  if (!o.plot_png.empty()) {
    std::vector<bench::PlotRun> pr;
    for (const Run& r : runs) pr.push_back({r.label, r.rate, &r.stats});
    const absl::Status st = bench::WritePlot(pr, runs.size() > 1 && runs[0].open_loop, o.plot_png);
    if (st.ok()) {
      std::printf("plot: %s\n", o.plot_png.c_str());
    } else {
      plot_note = std::string(st.message());
      std::fprintf(stderr, "tandem bench: plot skipped: %s\n", plot_note.c_str());
    }
  }
  if (!o.out_json.empty()) {
    nlohmann::json j = bench::StatsJson(runs[0].stats);  // the first run, for quick reads
    j["router"] = o.router;
    j["model"] = model_id;
    j["config"] = {
        {"num_requests", o.num_requests},
        {"concurrency", o.concurrency},
        {"request_rates", o.request_rates},
        {"arrival", o.arrival},
        {"burst_size", o.burst_size},
        {"workload", o.workload},
        {"input_len", o.input_len},
        {"output_len", o.output_len},
        {"prefix_len", o.prefix_len},
        {"turns", o.turns},
        {"first_turn_len", o.first_turn_len},
        {"sessions", o.sessions},
        {"slo", {{"ttft_ms", slo->ttft_ms}, {"tpot_ms", slo->tpot_ms}, {"e2e_ms", slo->e2e_ms}}},
        {"seed", o.seed},
        {"mix", o.mix},
        {"send_targets", o.send_targets}};
    j["runs"] = nlohmann::json::array();
    std::vector<int> cls(plan->size());
    for (size_t i = 0; i < plan->size(); ++i) cls[i] = (*plan)[i].cls;
    for (const Run& r : runs) j["runs"].push_back(bench::RunJson(r, cls, *classes));
    j["plot"] = o.plot_png.empty() || !plot_note.empty() ? nlohmann::json(nullptr)
                                                         : nlohmann::json(o.plot_png);
    if (!plot_note.empty()) j["plot_skipped"] = plot_note;
    std::ofstream f(o.out_json);
    if (!f) return absl::PermissionDeniedError(absl::StrCat("cannot write ", o.out_json));
    f << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (!f.good()) return absl::DataLossError(absl::StrCat("writing ", o.out_json, " failed"));
    std::printf("results: %s\n", o.out_json.c_str());
  }
  size_t completed = 0;
  for (const Run& r : runs) completed += r.stats.completed;
  if (completed == 0) {
    const std::string why =
        runs[0].results.empty() ? std::string("no requests") : runs[0].results[0].error;
    return absl::UnavailableError(absl::StrCat("every request failed; first error: ", why));
  }
  return absl::OkStatus();
}

}  // namespace tandem::tools
