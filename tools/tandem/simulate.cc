#include "tools/tandem/simulate.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/util/status_util.h"
#include "engine/model/model.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/step_cost.h"
#include "nlohmann/json.hpp"
#include "tools/tandem/bench_report.h"
#include "tools/tandem/bench_stats.h"
#include "tools/tandem/bench_workload.h"
#include "tools/tandem/cluster.h"
#include "tools/tandem/device_costs.h"

namespace tandem::tools {
namespace {

using router::sim::Costs;
using router::sim::StepCoefficients;

nlohmann::json CoefficientsJson(const StepCoefficients& c) {
  return {{"intercept_s", c.intercept_s},
          {"prefill_token_s", c.prefill_token_s},
          {"decode_seq_s", c.decode_seq_s},
          {"decode_kv_token_s", c.decode_kv_token_s}};
}

absl::StatusOr<StepCoefficients> CoefficientsFrom(const nlohmann::json& j, const char* role) {
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("costs: \"", role, "\" must be an object"));
  }
  StepCoefficients c;
  const std::pair<const char*, double*> fields[] = {{"intercept_s", &c.intercept_s},
                                                    {"prefill_token_s", &c.prefill_token_s},
                                                    {"decode_seq_s", &c.decode_seq_s},
                                                    {"decode_kv_token_s", &c.decode_kv_token_s}};
  for (const auto& [name, out] : fields) {
    auto it = j.find(name);
    if (it == j.end()) continue;
    if (!it->is_number() || it->get<double>() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("costs: ", role, ".", name, " must be a number >= 0"));
    }
    *out = it->get<double>();
  }
  if (c.Seconds(1, 0, 0) <= 1e-7 && c.Seconds(0, 1, 1) <= 1e-7) {
    return absl::InvalidArgumentError(
        absl::StrCat("costs: ", role, " makes every step free; give its coefficients"));
  }
  return c;
}

nlohmann::json CostsJson(const Costs& c, const std::string& source) {
  return {{"source", source},
          {"prefill", CoefficientsJson(c.prefill)},
          {"decode", CoefficientsJson(c.decode)},
          {"colocated", CoefficientsJson(c.colocated)},
          {"dispatch_s", c.dispatch_s},
          {"transfer_s_per_token", c.transfer_s_per_token},
          {"prefill_request_s", c.prefill_request_s}};
}

absl::StatusOr<Costs> CostsFromFile(const std::string& path, std::string* source) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  Costs c;
  const nlohmann::json* fallback = j.contains("step") ? &j["step"] : nullptr;
  const std::pair<const char*, StepCoefficients*> roles[] = {
      {"prefill", &c.prefill}, {"decode", &c.decode}, {"colocated", &c.colocated}};
  for (const auto& [role, out] : roles) {
    const nlohmann::json* r = j.contains(role) ? &j[role] : fallback;
    if (r == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": no \"", role, "\" costs and no \"step\" for every role"));
    }
    TANDEM_ASSIGN_OR_RETURN(*out, CoefficientsFrom(*r, role));
  }
  for (const auto& [name, out] : {std::pair<const char*, double*>{"dispatch_s", &c.dispatch_s},
                                  {"transfer_s_per_token", &c.transfer_s_per_token},
                                  {"prefill_request_s", &c.prefill_request_s}}) {
    if (!j.contains(name)) continue;
    if (!j[name].is_number() || j[name].get<double>() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", name, " must be >= 0"));
    }
    *out = j[name].get<double>();
  }
  *source = j.value("source", path);
  return c;
}

// The mean of the fits each worker reports, per role; a role with none takes the other kind's
// (a colocated fit for the disaggregated roles and the other way round).
absl::StatusOr<Costs> CostsFromRouter(const std::string& router, std::string* source) {
  TANDEM_ASSIGN_OR_RETURN(std::vector<v1::WorkerInfo> workers,
                          ListWorkers(router, absl::Seconds(5)));
  StepCoefficients sum[3];
  int n[3] = {0, 0, 0};
  for (const v1::WorkerInfo& w : workers) {
    const v1::StepCost& c = w.stats().step_cost();
    if (c.steps() < 8) continue;  // not fitted yet
    const int role = w.role() == v1::WORKER_ROLE_PREFILL  ? 0
                     : w.role() == v1::WORKER_ROLE_DECODE ? 1
                                                          : 2;
    sum[role].intercept_s += c.intercept_s();
    sum[role].prefill_token_s += c.prefill_token_s();
    sum[role].decode_seq_s += c.decode_seq_s();
    sum[role].decode_kv_token_s += c.decode_kv_token_s();
    n[role]++;
  }
  if (n[0] + n[1] + n[2] == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "router ", router, ": no worker has fitted its step cost yet (send it some requests)"));
  }
  StepCoefficients mean[3];
  // A fit over a narrow range of shapes (every prompt the same length, say) can give a
  // coefficient below 0; a cost is never negative, so those count as 0.
  for (int r = 0; r < 3; ++r) {
    if (n[r] == 0) continue;
    const double k = 1.0 / n[r];
    mean[r] = {std::max(0.0, sum[r].intercept_s * k), std::max(0.0, sum[r].prefill_token_s * k),
               std::max(0.0, sum[r].decode_seq_s * k), std::max(0.0, sum[r].decode_kv_token_s * k)};
  }
  Costs c;
  c.prefill = n[0] > 0 ? mean[0] : mean[2];
  c.decode = n[1] > 0 ? mean[1] : mean[2];
  c.colocated = n[2] > 0 ? mean[2]
                         : (n[0] > 0 && n[1] > 0
                                ? StepCoefficients{mean[0].intercept_s, mean[0].prefill_token_s,
                                                   mean[1].decode_seq_s, mean[1].decode_kv_token_s}
                                : (n[0] > 0 ? mean[0] : mean[1]));
  *source = absl::StrCat("fits reported by the workers of router ", router, " (", n[0],
                         " prefill, ", n[1], " decode, ", n[2], " colocated)");
  return c;
}

// Runs engine steps of many shapes on this machine and fits the step cost over them.
absl::StatusOr<Costs> CostsFromModel(const CostSources& s, std::string* source) {
  engine::ModelLoadOptions lo;
  lo.pack_weights = true;
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<engine::Model> model, engine::Model::Load(s.model, lo));
  engine::EngineOptions eo;
  eo.threads = s.threads;
  eo.max_seqs = 16;
  eo.ctx_size =
      std::min(2048, model->config().n_ctx_train > 0 ? model->config().n_ctx_train : 2048);
  eo.max_batch_tokens = s.max_batch_tokens;
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<engine::Engine> eng, engine::Engine::Create(model, eo));
  const int32_t bs = eng->kv().block_size();
  const int32_t per_seq = (eo.ctx_size + bs - 1) / bs;
  std::vector<std::vector<int32_t>> tables;
  for (int i = 0; i < eo.max_seqs; ++i) {
    TANDEM_ASSIGN_OR_RETURN(std::vector<int32_t> b, eng->kv().pool().AllocateN(per_seq));
    tables.push_back(std::move(b));
  }
  std::mt19937 rng(1);
  const int32_t vocab = model->config().n_vocab;
  std::vector<int32_t> tokens(static_cast<size_t>(eo.max_batch_tokens) + eo.max_seqs);
  for (int32_t& t : tokens) t = 3 + static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab - 3));
  struct Shape {
    int prefill;  // tokens of one prompt chunk, 0 for none
    int decode;   // sequences
    int kv;       // positions each decoding sequence already holds
  };
  std::vector<Shape> shapes;
  const int ctx = eo.ctx_size;
  for (int p : {8, 32, 64, 128, 256, 512}) {
    if (p <= eo.max_batch_tokens) shapes.push_back({p, 0, 0});
  }
  for (int d : {1, 2, 4, 8, 16}) {
    for (int kv : {32, ctx / 4, ctx / 2 - 1}) shapes.push_back({0, d, kv});
  }
  for (int d : {2, 8}) shapes.push_back({std::min(64, eo.max_batch_tokens - d), d, ctx / 4});
  engine::StepCostModel fit;
  std::vector<float> logits;
  for (int round = 0; round < 4; ++round) {
    std::shuffle(shapes.begin(), shapes.end(), rng);
    for (const Shape& sh : shapes) {
      std::vector<engine::SeqChunk> chunks;
      for (int i = 0; i < sh.decode; ++i) {
        engine::SeqChunk c;
        c.tokens = std::span<const int32_t>(tokens).subspan(static_cast<size_t>(i), 1);
        c.start_pos = sh.kv;
        c.block_table = tables[static_cast<size_t>(i)];
        c.want_logits = true;
        chunks.push_back(c);
      }
      if (sh.prefill > 0) {
        engine::SeqChunk c;
        c.tokens = std::span<const int32_t>(tokens).first(static_cast<size_t>(sh.prefill));
        c.start_pos = 0;
        c.block_table = tables.back();
        c.want_logits = true;
        chunks.push_back(c);
      }
      TANDEM_RETURN_IF_ERROR(eng->Step(chunks, &logits));
      if (round > 0) fit.Observe(eng->last_step().shape, eng->last_step().seconds);  // warm
    }
  }
  const engine::StepCostModel::Coefficients k = fit.coefficients();
  Costs c;
  c.prefill = c.decode =
      c.colocated = {std::max(0.0, k.intercept_s), std::max(0.0, k.prefill_token_s),
                     std::max(0.0, k.decode_seq_s), std::max(0.0, k.decode_kv_token_s)};
  *source = absl::StrCat("fitted on this machine from ", fit.steps(), " engine steps of ", s.model,
                         " with ", s.threads, " thread(s); relative RMSE ", fit.relative_rmse());
  return c;
}

int PriorityOf(const std::string& name) {
  if (name == "interactive") return 0;
  if (name == "batch") return 2;
  return 1;
}

struct Workload {
  std::vector<router::sim::Request> requests;
  std::vector<int> cls;
  std::vector<bench::RequestClass> classes;
};

absl::StatusOr<Workload> TraceWorkload(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("runs") || !j["runs"].is_array() || j["runs"].empty() ||
      !j["runs"][0].contains("requests")) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a tandem bench JSON (no runs[0].requests)"));
  }
  Workload w;
  // The classes in the run's order (its "classes"), with their targets.
  for (const nlohmann::json& c : j["runs"][0].value("classes", nlohmann::json::array())) {
    w.classes.push_back({c.value("name", ""), c.value("weight", 1.0),
                         c.value("ttft_target_ms", 0.0), c.value("tpot_target_ms", 0.0)});
  }
  for (const nlohmann::json& r : j["runs"][0]["requests"]) {
    router::sim::Request q;
    q.arrival_s = r.value("start_s", 0.0);
    q.prompt_tokens = r.value("prompt_tokens", 0);
    // A failed request reports no output: replay it with the run's configured length.
    q.output_tokens = r.value("output_tokens", 0);
    if (q.output_tokens <= 0)
      q.output_tokens = j.value("config", nlohmann::json::object()).value("output_len", 1);
    int cls = -1;
    if (r.contains("class")) {
      const std::string name = r["class"].get<std::string>();
      auto it = std::find_if(w.classes.begin(), w.classes.end(),
                             [&](const bench::RequestClass& c) { return c.name == name; });
      if (it == w.classes.end()) {
        w.classes.push_back({name, 1, 0, 0});
        it = w.classes.end() - 1;
      }
      cls = static_cast<int>(it - w.classes.begin());
      q.priority = PriorityOf(name);
    }
    w.requests.push_back(q);
    w.cls.push_back(cls);
  }
  return w;
}

absl::StatusOr<Workload> GeneratedWorkload(const SimulateOptions& o) {
  if (!(o.rate > 0)) return absl::InvalidArgumentError("--rate must be > 0");
  int64_t n = o.num_requests;
  if (n <= 0) {
    if (!(o.duration_s > 0)) {
      return absl::InvalidArgumentError("give --num-requests or --duration");
    }
    n = static_cast<int64_t>(std::llround(o.rate * o.duration_s));
  }
  if (n < 1 || n > INT32_MAX) return absl::InvalidArgumentError("the run has no requests");
  if (o.input_len < 1 || o.output_len < 1) {
    return absl::InvalidArgumentError("--input-len and --output-len must be >= 1");
  }
  TANDEM_ASSIGN_OR_RETURN(bench::Workload kind, bench::ParseWorkload(o.workload));
  int prompt = o.input_len;
  if (kind == bench::Workload::kSharedPrefix) {
    prompt += o.prefix_len;
  } else if (kind == bench::Workload::kMultiTurn) {
    return absl::InvalidArgumentError(
        "--workload multi-turn: turns wait on each other's replies; replay a measured run's "
        "JSON with --trace instead");
  }
  TANDEM_ASSIGN_OR_RETURN(bench::Arrival arrival, bench::ParseArrival(o.arrival));
  TANDEM_ASSIGN_OR_RETURN(
      std::vector<double> times,
      bench::ArrivalTimes(static_cast<int>(n), o.rate, arrival, o.seed, o.burst_size));
  Workload w;
  TANDEM_ASSIGN_OR_RETURN(w.classes, bench::ParseMix(o.mix));
  w.requests.resize(static_cast<size_t>(n));
  w.cls.assign(static_cast<size_t>(n), -1);
  if (!w.classes.empty()) {
    // The same draw as `tandem bench` makes for the same seed.
    std::vector<bench::PlannedRequest> planned(static_cast<size_t>(n));
    bench::AssignClasses(w.classes, o.seed, &planned);
    for (size_t i = 0; i < planned.size(); ++i) w.cls[i] = planned[i].cls;
  }
  for (size_t i = 0; i < w.requests.size(); ++i) {
    router::sim::Request& q = w.requests[i];
    q.arrival_s = times[i];
    q.prompt_tokens = prompt;
    q.output_tokens = o.output_len;
    if (w.cls[i] >= 0) q.priority = PriorityOf(w.classes[static_cast<size_t>(w.cls[i])].name);
  }
  return w;
}

}  // namespace

absl::StatusOr<Costs> LoadCosts(const CostSources& s, std::string* source) {
  const int given = !s.cost_file.empty() + !s.cost_from.empty() + !s.model.empty();
  if (given != 1) {
    return absl::InvalidArgumentError(
        "give the step costs by exactly one of --cost FILE, --cost-from ROUTER, --model M.gguf");
  }
  Costs c;
  if (!s.device.empty()) {
    if (s.model.empty()) {
      return absl::InvalidArgumentError("--device needs --model: the model whose shape it prices");
    }
    for (double e : {s.device_memory_efficiency, s.device_compute_efficiency}) {
      if (!(e > 0 && e <= 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--device-memory-efficiency and --device-compute-efficiency must be in "
                         "(0, 1], got ", e));
      }
    }
    TANDEM_ASSIGN_OR_RETURN(DeviceSpec d, FindDevice(s.device));
    TANDEM_ASSIGN_OR_RETURN(ModelDemand m, DemandOf(s.model));
    c = CostsFromDevice(m, d, {s.device_memory_efficiency, s.device_compute_efficiency});
    *source = absl::StrFormat(
        "device %s from published peaks (%s) at %.2f of bandwidth and %.2f of FLOP rate, model %s",
        d.name, d.published, s.device_memory_efficiency, s.device_compute_efficiency, s.model);
  } else if (!s.cost_file.empty()) {
    TANDEM_ASSIGN_OR_RETURN(c, CostsFromFile(s.cost_file, source));
  } else if (!s.cost_from.empty()) {
    TANDEM_ASSIGN_OR_RETURN(c, CostsFromRouter(s.cost_from, source));
  } else {
    if (s.threads < 1) return absl::InvalidArgumentError("--threads must be >= 1");
    TANDEM_ASSIGN_OR_RETURN(c, CostsFromModel(s, source));
  }
  if (s.dispatch_ms >= 0) c.dispatch_s = s.dispatch_ms / 1000;
  if (s.transfer_us_per_token >= 0) c.transfer_s_per_token = s.transfer_us_per_token / 1e6;
  if (!s.save_cost.empty()) {
    std::ofstream f(s.save_cost);
    f << CostsJson(c, *source).dump(2) << "\n";
    if (!f.good()) return absl::PermissionDeniedError(absl::StrCat("cannot write ", s.save_cost));
  }
  return c;
}

absl::Status RunSimulate(const SimulateOptions& o) {
  SimulateOptions opts = o;
  TANDEM_RETURN_IF_ERROR(router::ParsePolicy(o.policy, &opts.router.policy));
  if (o.topology.prefill + o.topology.decode + o.topology.colocated == 0) {
    return absl::InvalidArgumentError("give workers: --prefill N --decode M, or --colocated N");
  }
  if ((o.topology.prefill > 0) != (o.topology.decode > 0) && o.topology.colocated == 0) {
    return absl::InvalidArgumentError(
        "a disaggregated cluster needs both --prefill and --decode workers");
  }
  TANDEM_ASSIGN_OR_RETURN(bench::Slo slo, bench::ParseSlo(o.slo));
  Workload w;
  if (!o.trace.empty()) {
    TANDEM_ASSIGN_OR_RETURN(w, TraceWorkload(o.trace));
  } else {
    TANDEM_ASSIGN_OR_RETURN(w, GeneratedWorkload(o));
  }
  std::string source;
  router::sim::Options so;
  TANDEM_ASSIGN_OR_RETURN(so.costs, LoadCosts(o.costs, &source));
  so.topology = o.topology;
  so.router = opts.router;
  so.keep_itl = w.requests.size() <= 200000;

  const auto t0 = std::chrono::steady_clock::now();
  router::sim::Stats st;
  TANDEM_ASSIGN_OR_RETURN(std::vector<router::sim::Result> sim,
                          router::sim::Simulate(so, w.requests, &st));
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  bench::Run run;
  run.open_loop = true;
  run.rate = o.trace.empty() ? o.rate : 0;
  run.label = o.trace.empty() ? absl::StrCat("simulated rate ", o.rate, "/s")
                              : absl::StrCat("simulated replay of ", o.trace);
  run.results.resize(sim.size());
  double duration = 0;
  for (size_t i = 0; i < sim.size(); ++i) {
    bench::RequestResult& r = run.results[i];
    const router::sim::Request& q = w.requests[i];
    r.ok = sim[i].ok;
    r.status_code = sim[i].status_code;
    r.error = std::move(sim[i].error);
    r.start_s = q.arrival_s;
    r.ttft_s = sim[i].ttft_s;
    r.e2e_s = sim[i].e2e_s;
    r.prompt_tokens = q.prompt_tokens;
    r.output_tokens = r.ok ? q.output_tokens : 0;
    r.itl_s = std::move(sim[i].itl_s);
    duration = std::max(duration, r.start_s + r.e2e_s);
  }
  sim.clear();
  bench::ComputeRunStats(run, w.cls, w.classes, duration, slo);
  if (!o.quiet) bench::PrintSummary(run, slo, w.classes, "tandem simulate");
  std::printf(
      "simulated %zu requests on %d prefill + %d decode + %d colocated workers: "
      "%lld events, %.1f simulated s, in %.2f s\n",
      w.requests.size(), o.topology.prefill, o.topology.decode, o.topology.colocated,
      static_cast<long long>(st.events), st.end_s, wall);
  if (o.out_json.empty()) return absl::OkStatus();
  nlohmann::json j = bench::StatsJson(run.stats);
  j["config"] = {
      {"num_requests", w.requests.size()},
      {"request_rates", o.trace.empty() ? std::vector<double>{o.rate} : std::vector<double>{}},
      {"arrival", o.arrival},
      {"burst_size", o.burst_size},
      {"workload", o.workload},
      {"input_len", o.input_len},
      {"output_len", o.output_len},
      {"prefix_len", o.prefix_len},
      {"slo", {{"ttft_ms", slo.ttft_ms}, {"tpot_ms", slo.tpot_ms}, {"e2e_ms", slo.e2e_ms}}},
      {"seed", o.seed},
      {"mix", o.mix},
      {"trace", o.trace}};
  j["runs"] = nlohmann::json::array();
  j["runs"].push_back(bench::RunJson(run, w.cls, w.classes, /*max_request_records=*/100000));
  j["simulated"] = {{"prefill", o.topology.prefill},
                    {"decode", o.topology.decode},
                    {"colocated", o.topology.colocated},
                    {"max_batch_tokens", o.topology.max_batch_tokens},
                    {"max_seqs", o.topology.max_seqs},
                    {"policy", o.policy},
                    {"costs", CostsJson(so.costs, source)},
                    {"itl_kept", so.keep_itl},
                    {"events", st.events},
                    {"engine_steps", st.steps},
                    {"simulated_s", st.end_s},
                    {"wall_s", wall}};
  std::ofstream f(o.out_json);
  if (!f) return absl::PermissionDeniedError(absl::StrCat("cannot write ", o.out_json));
  f << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  if (!f.good()) return absl::DataLossError(absl::StrCat("writing ", o.out_json, " failed"));
  std::printf("results: %s\n", o.out_json.c_str());
  return absl::OkStatus();
}

}  // namespace tandem::tools
