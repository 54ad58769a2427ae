// The `tandem` command line: model tools and single-node generation. This is the only file of
// the CLI that reads flags; everything else takes option structs.
#include <cstdio>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/trace/trace.h"
#include "tools/tandem/bench.h"
#include "tools/tandem/client.h"
#include "services/common/tls.h"
#include "tandem/kernels/kv_quant.h"
#include "tools/tandem/cluster.h"
#include "tools/tandem/expert_placement.h"
#include "tools/tandem/generate.h"
#include "tools/tandem/model_tools.h"
#include "tools/tandem/simulate.h"

namespace {

int Report(const absl::Status& st) {
  if (st.ok()) return 0;
  std::fprintf(stderr, "tandem: error: %s\n", std::string(st.ToString()).c_str());
  return st.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

absl::StatusOr<tandem::kernels::DType> ParseType(const std::string& name) {
  auto t = tandem::kernels::DTypeFromName(name);
  if (!t) return absl::InvalidArgumentError("unknown type '" + name + "'");
  return *t;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tandem: disaggregated LLM serving (CLI)"};
  app.require_subcommand(1);
  int rc = 0;

  // generate
  tandem::tools::GenerateOptions gen;
  std::string gen_kv_type = "f32";
  std::string gen_device = "cpu";
  std::string gen_spec = "off";
  int32_t gen_spec_tokens = 4;
  auto* g = app.add_subcommand("generate", "Generate text in-process on this node");
  g->add_option("--model", gen.model_path, "GGUF model file")->required();
  g->add_option("--prompt", gen.prompt, "Prompt text");
  g->add_option("--max-tokens", gen.sampling.max_tokens, "Tokens to generate");
  g->add_option("--temperature", gen.sampling.temperature, "0 = greedy");
  g->add_option("--seed", gen.sampling.seed, "Sampling seed");
  g->add_option("--threads", gen.threads, "Compute threads");
  g->add_option("--top-k", gen.sampling.top_k);
  g->add_option("--top-p", gen.sampling.top_p);
  g->add_option("--min-p", gen.sampling.min_p);
  g->add_option("--repeat-penalty", gen.sampling.repetition_penalty);
  g->add_option("--presence-penalty", gen.sampling.presence_penalty);
  g->add_option("--frequency-penalty", gen.sampling.frequency_penalty);
  g->add_option("--penalty-last-n", gen.sampling.penalty_last_n);
  g->add_option("--stop", gen.sampling.stop_strings, "Stop string (repeatable)");
  g->add_option("--stop-token", gen.sampling.stop_token_ids, "Stop token id (repeatable)");
  g->add_flag("--ignore-eos", gen.sampling.ignore_eos);
  g->add_option("--ctx-size", gen.ctx_size, "Context size (0: model's, at most 4096)");
  g->add_option("--batch-tokens", gen.batch_tokens, "Tokens per step (prefill chunk)");
  g->add_option("--kv-type,--kv-dtype", gen_kv_type, "KV cache type: f32, f16, int8 or fp8");
  g->add_option("--device", gen_device,
                "cpu, or cuda: weights and KV cache on the GPU (needs a CUDA build and a GPU)");
  g->add_option("--speculative", gen_spec,
                "off, ngram (prompt lookup), self:TYPE (the model converted to TYPE) or draft:PATH");
  g->add_option("--spec-tokens", gen_spec_tokens, "Most draft tokens verified per step (1-16)");
  g->add_flag("--json", gen.json, "Print token ids, text and timings as JSON");
  g->callback([&] {
    auto dev = tandem::engine::DeviceFromName(gen_device);
    if (!dev) {
      rc = Report(absl::InvalidArgumentError("unknown device '" + gen_device + "' (cpu or cuda)"));
      return;
    }
    gen.device = *dev;
    auto t = tandem::kernels::KvTypeFromName(gen_kv_type);
    if (!t) {
      rc = Report(absl::InvalidArgumentError("unknown KV type '" + gen_kv_type +
                                             "' (f32, f16, int8 or fp8)"));
      return;
    }
    gen.kv_type = *t;
    auto spec = tandem::engine::ParseSpeculative(gen_spec, gen_spec_tokens);
    if (!spec.ok()) {
      rc = Report(spec.status());
      return;
    }
    gen.speculative = *spec;
    rc = Report(tandem::tools::RunGenerate(gen));
  });

  // convert llama2c
  auto* conv = app.add_subcommand("convert", "Convert a model to GGUF");
  conv->require_subcommand(1);
  tandem::tools::ConvertLlama2cOptions l2c;
  auto* l2 = conv->add_subcommand("llama2c", "llama2.c checkpoint + tokenizer.bin to GGUF");
  l2->add_option("--model", l2c.model_path)->required();
  l2->add_option("--tokenizer", l2c.tokenizer_path)->required();
  l2->add_option("--out", l2c.out_path)->required();
  l2->callback([&] { rc = Report(tandem::tools::ConvertLlama2c(l2c)); });

  // synth
  tandem::tools::SynthOptions syn;
  syn.vocab_dir = TANDEM_DEFAULT_VOCAB_DIR;
  std::string syn_type = "f32";
  auto* s = app.add_subcommand("synth", "Random-weight GGUF of a named real shape");
  s->add_option("--shape", syn.shape, "Shape name")->required();
  s->add_option("--type", syn_type, "Weight type (f32, f16, bf16, q8_0, q4_0, q4_K, q6_K, mxfp4)");
  s->add_option("--out", syn.out_path)->required();
  s->add_option("--seed", syn.seed);
  s->add_option("--vocab-dir", syn.vocab_dir, "Folder of llama.cpp vocab GGUFs");
  s->callback([&] {
    auto t = ParseType(syn_type);
    if (!t.ok()) {
      rc = Report(t.status());
      return;
    }
    syn.type = *t;
    rc = Report(tandem::tools::Synthesize(syn));
  });

  // quantize
  std::string q_in, q_out, q_type = "q8_0";
  auto* q = app.add_subcommand("quantize", "Convert a GGUF's weight matrices to another type");
  q->add_option("input", q_in)->required();
  q->add_option("output", q_out)->required();
  q->add_option("--type", q_type)->required();
  q->callback([&] {
    auto t = ParseType(q_type);
    if (!t.ok()) {
      rc = Report(t.status());
      return;
    }
    rc = Report(tandem::tools::QuantizeModel(q_in, q_out, *t));
  });

  // place-experts
  tandem::tools::PlaceExpertsOptions pe;
  auto* pex = app.add_subcommand(
      "place-experts", "Expert placement for expert parallelism from measured expert load");
  pex->add_option("--load", pe.load_paths,
                  "/metrics scrapes holding tandem_expert_tokens_total (summed)")
      ->required();
  pex->add_option("--ranks", pe.ranks, "Ranks of the expert-parallel group")->required();
  pex->add_option("--redundant", pe.redundant, "Extra expert replicas per layer");
  pex->add_option("--out", pe.out_path, "Placement JSON to write")->required();
  pex->callback([&] { rc = Report(tandem::tools::RunPlaceExperts(pe)); });

  // cluster up|down|status|add|remove
  auto* cl = app.add_subcommand("cluster", "Run a local cluster of real processes on loopback");
  cl->require_subcommand(1);
  tandem::tools::ClusterUpOptions up;
  int64_t up_timeout_ms = 60000;
  auto* cu = cl->add_subcommand("up", "Start routers, kvstore and workers; return when all are ready");
  cu->add_option("--model", up.model, "GGUF model file")->required();
  cu->add_option("--prefill", up.prefill, "Prefill workers");
  cu->add_option("--decode", up.decode, "Decode workers");
  cu->add_option("--colocated", up.colocated, "Colocated (prefill+decode) workers");
  cu->add_option("--ep", up.ep,
                 "MoE expert parallelism: each decode and colocated worker is a group of this "
                 "many processes splitting the experts");
  cu->add_option("--prefill-ep", up.prefill_ep,
                 "the same for each prefill worker (set apart from --ep)");
  cu->add_option("--dir", up.dir, "Run folder: logs, pid files, cluster.json")->required();
  cu->add_option("--routers", up.routers,
                 "Routers (every worker registers with all; router i > 0 takes a free gRPC "
                 "port and HTTP port --http-port + i)")
      ->check(CLI::PositiveNumber);
  cu->add_option("--router-port", up.router_port, "First router's gRPC port (0: any free port)");
  cu->add_option("--http-port", up.http_port,
                 "First router's OpenAI-compatible HTTP port (0: none)");
  int kvstore = 1;
  cu->add_option("--kvstore", kvstore,
                 "1: start a tandem-kvstore for prefix sharing (prefill workers use it); 0: none")
      ->check(CLI::Range(0, 1));
  cu->add_option("--kvstore-host-mb", up.kvstore_host_mb, "The kvstore's host-tier MiB")
      ->check(CLI::PositiveNumber);
  cu->add_option("--threads", up.threads, "Compute threads per worker");
  cu->add_flag("--pin", up.pin, "Pin each process to its own CPUs (round-robin)");
  cu->add_option("--transport", up.transport, "KV transport: ucx or inproc");
  cu->add_option("--ucx-tls", up.ucx_tls, "UCX transports: shm or tcp (or a UCX_TLS list)");
  cu->add_option("--policy", up.policy, "Router worker selection: least-load, round-robin or kv-aware");
  cu->add_option("--lease-ms", up.lease_ms, "Router worker lease (0: default)");
  cu->add_option("--ctx-size", up.ctx_size, "Context per sequence (0: min(model's, 4096))");
  cu->add_option("--kv-blocks", up.kv_blocks, "Decode KV pool blocks (0: worker default)");
  cu->add_option("--max-seqs", up.max_seqs, "Decode batch size (0: worker default)");
  cu->add_option("--router-arg", up.router_args, "Extra router flag (repeatable)");
  cu->add_option("--worker-arg", up.worker_args, "Extra worker flag (repeatable)");
  cu->add_option("--speculative", up.speculative,
                 "Speculative decoding of every worker: off, ngram, self:TYPE or draft:PATH");
  cu->add_option("--spec-tokens", up.spec_tokens, "Most draft tokens verified per step (1-16)");
  cu->add_option("--trace-dir", up.trace_dir,
                 "Every process writes a Chrome/Perfetto trace here, NAME.json (join them with "
                 "tandem trace merge)");
  cu->add_option("--bin-dir", up.bin_dir, "Folder of the service binaries (default: tandem's)");
  cu->add_option("--timeout-ms", up_timeout_ms, "How long to wait for readiness");
  tandem::services::AddTlsFlags(*cu, &up.tls);
  cu->callback([&] {
    up.ready_timeout = absl::Milliseconds(up_timeout_ms);
    up.kvstore = kvstore != 0;
    // This tool's own readiness checks speak to the cluster as its processes do.
    if (absl::Status st = tandem::services::SetProcessTls(up.tls); !st.ok()) {
      rc = Report(st);
      return;
    }
    rc = Report(tandem::tools::ClusterUp(up));
  });
  std::string cl_dir, cl_name, cl_role;
  int64_t cl_grace_ms = 15000;
  bool cl_json = false;
  auto* cd = cl->add_subcommand("down", "Stop a cluster (SIGTERM, then SIGKILL after a grace)");
  cd->add_option("--dir", cl_dir)->required();
  cd->add_option("--grace-ms", cl_grace_ms);
  cd->callback([&] {
    rc = Report(tandem::tools::ClusterDown(cl_dir, absl::Milliseconds(cl_grace_ms)));
  });
  auto* cs = cl->add_subcommand("status", "Processes, registrations and worker stats");
  cs->add_option("--dir", cl_dir)->required();
  cs->add_flag("--json", cl_json);
  cs->callback([&] { rc = Report(tandem::tools::ClusterStatus(cl_dir, cl_json)); });
  auto* ca = cl->add_subcommand("add", "Start one more worker in a running cluster");
  ca->add_option("--dir", cl_dir)->required();
  ca->add_option("--role", cl_role, "prefill, decode or colocated")->required();
  ca->add_option("--name", cl_name, "Worker name (default: ROLE-N)");
  ca->callback([&] {
    tandem::tools::ClusterAddOptions ao;
    ao.dir = cl_dir;
    ao.role = cl_role;
    ao.name = cl_name;
    rc = Report(tandem::tools::ClusterAdd(ao));
  });
  auto* cr = cl->add_subcommand("remove", "Stop one worker (it drains first)");
  cr->add_option("--dir", cl_dir)->required();
  cr->add_option("--name", cl_name)->required();
  cr->add_option("--grace-ms", cl_grace_ms);
  cr->callback([&] {
    rc = Report(tandem::tools::ClusterRemove(cl_dir, cl_name, absl::Milliseconds(cl_grace_ms)));
  });

  // client
  tandem::tools::ClientOptions cli;
  auto* tr = app.add_subcommand("trace", "Work with the services' --trace files");
  tr->require_subcommand(1);
  std::vector<std::string> trace_inputs;
  std::string trace_out;
  auto* tm = tr->add_subcommand(
      "merge", "Join services' traces into one that Perfetto opens (each process keeps a track)");
  tm->add_option("traces", trace_inputs, "Trace files written by --trace")->required();
  tm->add_option("--out", trace_out, "Merged trace file")->required();
  tm->callback([&] { rc = Report(tandem::trace::MergeTraces(trace_inputs, trace_out)); });

  auto* c = app.add_subcommand("client", "Stream one request from a cluster's router");
  c->add_option("--router", cli.router, "Router host:port")->required();
  c->add_option("--prompt", cli.prompt, "Prompt text");
  c->add_option("--model", cli.model, "Model id (default: the cluster's)");
  c->add_option("--request-id", cli.request_id);
  c->add_option("--priority", cli.priority,
                 "Admission class at the router: interactive, standard or batch");
  c->add_option("--session", cli.session,
                "Conversation id: its turns go to the decode worker that holds its KV");
  c->add_option("--ttft-target-ms", cli.ttft_target_ms,
                "Time-to-first-token target: the router refuses the request at once when it "
                "predicts a miss (0: none)");
  c->add_option("--tpot-target-ms", cli.tpot_target_ms,
                "Time-per-output-token target the decode batch must keep (0: none)");
  c->add_option("--max-tokens", cli.sampling.max_tokens, "Tokens to generate");
  c->add_option("--temperature", cli.sampling.temperature, "0 = greedy");
  c->add_option("--seed", cli.sampling.seed, "Sampling seed");
  c->add_option("--top-k", cli.sampling.top_k);
  c->add_option("--top-p", cli.sampling.top_p);
  c->add_option("--min-p", cli.sampling.min_p);
  c->add_option("--repeat-penalty", cli.sampling.repetition_penalty);
  c->add_option("--presence-penalty", cli.sampling.presence_penalty);
  c->add_option("--frequency-penalty", cli.sampling.frequency_penalty);
  c->add_option("--penalty-last-n", cli.sampling.penalty_last_n);
  c->add_option("--stop", cli.sampling.stop_strings, "Stop string (repeatable)");
  c->add_option("--stop-token", cli.sampling.stop_token_ids, "Stop token id (repeatable)");
  c->add_flag("--ignore-eos", cli.sampling.ignore_eos);
  c->add_option("--timeout-ms", cli.timeout_ms, "Request deadline (0: none)");
  c->add_flag("--json", cli.json, "Print token ids, text and timings as JSON");
  c->add_option("--api-key", cli.api_key, "API key of a router run with --api-keys");
  tandem::services::TlsOptions client_tls;
  tandem::services::AddTlsFlags(*c, &client_tls);
  c->callback([&] {
    if (absl::Status st = tandem::services::SetProcessTls(client_tls); !st.ok()) {
      rc = Report(st);
      return;
    }
    rc = Report(tandem::tools::RunClient(cli));
  });

  // bench
  tandem::tools::BenchOptions bo;
  std::string bench_rates;
  auto* b = app.add_subcommand("bench", "Load-generate against a router; JSON results, PNG plots");
  b->add_option("--router", bo.router, "Router host:port")->required();
  b->add_option("--model", bo.model, "Model id (default: the router's)");
  b->add_option("--num-requests", bo.num_requests, "Requests per run");
  b->add_option("--out", bo.out_json, "Write JSON results here");
  b->add_option("--plot", bo.plot_png, "Write PNG plots here (needs gnuplot)");
  b->add_option("--concurrency", bo.concurrency,
                "Closed loop: clients in flight (open loop: cap on requests in flight)");
  b->add_option("--request-rate", bench_rates,
                "Open loop: requests/s; a comma list runs once per rate (latency against load)");
  b->add_option("--arrival", bo.arrival, "Open-loop arrivals: poisson, constant or burst");
  b->add_option("--burst-size", bo.burst_size, "Requests per burst (--arrival burst)");
  b->add_option("--workload", bo.workload, "random, shared-prefix or multi-turn");
  b->add_option("--input-len", bo.input_len, "Fresh prompt tokens per request (per turn)");
  b->add_option("--output-len", bo.output_len, "Tokens generated per request");
  b->add_option("--prefix-len", bo.prefix_len, "Shared prefix tokens (shared-prefix)");
  b->add_option("--turns", bo.turns, "Turns per conversation (multi-turn)");
  b->add_option("--first-turn-len", bo.first_turn_len,
                "Tokens opening each conversation before its first turn's input (multi-turn)");
  b->add_flag("--sessions", bo.sessions,
              "Multi-turn: send a session id, and the real replies as the history");
  b->add_option("--slo", bo.slo, "SLOs for goodput, e.g. ttft:500,tpot:50 (ms; also e2e)");
  b->add_option("--seed", bo.seed, "Workload and arrival seed");
  b->add_option("--timeout-ms", bo.timeout_ms, "Per-request deadline (0: none)");
  b->add_flag("--quiet", bo.quiet, "No progress output");
  b->add_option("--api-key", bo.api_key, "API key of a router run with --api-keys");
  b->add_option("--mix", bo.mix,
                "Request classes, e.g. interactive:1:ttft=400,batch:3 (priority:weight[:targets])");
  b->add_flag("!--no-send-targets", bo.send_targets,
              "Judge goodput by the --mix targets without sending them");
  tandem::services::TlsOptions bench_tls;
  tandem::services::AddTlsFlags(*b, &bench_tls);
  b->callback([&] {
    if (absl::Status st = tandem::services::SetProcessTls(bench_tls); !st.ok()) {
      rc = Report(st);
      return;
    }
    if (!bench_rates.empty()) {
      if (absl::Status st = tandem::tools::ParseRates(bench_rates, &bo.request_rates); !st.ok()) {
        rc = Report(st);
        return;
      }
    }
    rc = Report(tandem::tools::RunBench(bo));
  });

  // simulate and plan share the cost sources and the per-worker settings.
  auto add_costs = [](CLI::App* c, tandem::tools::CostSources* s) {
    c->add_option("--cost", s->cost_file, "Step costs JSON (docs/perf/costs/)");
    c->add_option("--cost-from", s->cost_from,
                  "Router host:port: the step costs its workers have fitted");
    c->add_option("--model", s->model,
                  "GGUF model: fit the step costs on this machine (with --device: price it there)");
    c->add_option("--device", s->device,
                  "Price --model on a GPU from its published peaks: h100, h200, a100 or l40s");
    c->add_option("--device-memory-efficiency", s->device_memory_efficiency,
                  "Fraction of the device's peak bandwidth reached (default 0.75)");
    c->add_option("--device-compute-efficiency", s->device_compute_efficiency,
                  "Fraction of the device's peak BF16 FLOP rate reached (default 0.5)");
    c->add_option("--threads", s->threads, "Engine threads when fitting with --model");
    c->add_option("--save-cost", s->save_cost, "Write the step costs used to this JSON");
    c->add_option("--dispatch-ms", s->dispatch_ms, "Router to worker time per request (ms)");
    c->add_option("--transfer-us-per-token", s->transfer_us_per_token,
                  "KV transfer time compute does not hide, per prompt token (us)");
  };
  auto add_shape = [](CLI::App* c, tandem::router::sim::Topology* t,
                      tandem::router::sim::RouterConfig* r, std::string* policy) {
    c->add_option("--max-batch-tokens", t->max_batch_tokens, "Tokens per engine step")
        ->check(CLI::PositiveNumber);
    c->add_option("--max-seqs", t->max_seqs, "Sequences per worker")->check(CLI::PositiveNumber);
    c->add_option("--ctx-size", t->ctx_size, "Positions per sequence")->check(CLI::PositiveNumber);
    c->add_option("--kv-blocks", t->kv_blocks, "KV blocks per worker (0: max-seqs full contexts)");
    c->add_option("--policy", *policy, "Router policy: least-load, round-robin or kv-aware");
    c->add_option("--max-inflight", r->max_inflight, "Router admission slots")
        ->check(CLI::PositiveNumber);
    c->add_option("--max-queue", r->max_queue, "Router admission queue");
  };

  // simulate
  tandem::tools::SimulateOptions so;
  auto* sim = app.add_subcommand(
      "simulate", "Simulate a cluster under a workload; writes tandem bench's JSON");
  sim->add_option("--prefill", so.topology.prefill, "Prefill workers");
  sim->add_option("--decode", so.topology.decode, "Decode workers");
  sim->add_option("--colocated", so.topology.colocated, "Colocated workers (no P or D)");
  sim->add_option("--rate", so.rate, "Requests/s (open loop)");
  sim->add_option("--duration", so.duration_s, "Seconds of arrivals (without --num-requests)");
  sim->add_option("--num-requests", so.num_requests, "Requests in the run");
  sim->add_option("--trace", so.trace, "Replay the requests of a tandem bench JSON");
  sim->add_option("--arrival", so.arrival, "poisson, constant or burst");
  sim->add_option("--burst-size", so.burst_size, "Requests per burst (--arrival burst)");
  sim->add_option("--workload", so.workload, "random or shared-prefix");
  sim->add_option("--input-len", so.input_len, "Fresh prompt tokens per request");
  sim->add_option("--output-len", so.output_len, "Tokens generated per request");
  sim->add_option("--prefix-len", so.prefix_len, "Shared prefix tokens (shared-prefix)");
  sim->add_option("--slo", so.slo, "SLOs for goodput, e.g. ttft:500,tpot:50 (ms)");
  sim->add_option("--mix", so.mix, "Request classes, as tandem bench --mix");
  sim->add_option("--seed", so.seed, "Workload and arrival seed");
  sim->add_option("--out", so.out_json, "Write JSON results here");
  sim->add_flag("--quiet", so.quiet, "No summary table");
  add_costs(sim, &so.costs);
  add_shape(sim, &so.topology, &so.router, &so.policy);
  sim->callback([&] { rc = Report(tandem::tools::RunSimulate(so)); });

  // plan
  tandem::tools::PlanOptions po;
  auto* plan = app.add_subcommand(
      "plan", "Prefill and decode pool sizes (and the colocated alternative) for a workload");
  plan->add_option("--rate", po.rate, "Requests/s")->required();
  plan->add_option("--isl", po.isl, "Input lengths: N, or N:WEIGHT,... (a histogram)");
  plan->add_option("--osl", po.osl, "Output lengths: N, or N:WEIGHT,...");
  plan->add_option("--prefix-hit", po.prefix_hit, "Fraction of prompt tokens cached, [0, 1)");
  plan->add_option("--slo", po.slo, "Targets, e.g. ttft:500,tpot:50 (ms)")->required();
  plan->add_option("--attainment", po.attainment,
                   "Fraction of requests that must meet the targets");
  plan->add_option("--max-workers", po.max_workers, "Largest cluster considered");
  plan->add_option("--seed", po.seed, "Simulated workload seed");
  plan->add_flag("--json", po.json, "Print JSON");
  add_costs(plan, &po.costs);
  add_shape(plan, &po.shape, &po.router, &po.policy);
  plan->callback([&] { rc = Report(tandem::tools::RunPlan(po)); });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return rc;
}
