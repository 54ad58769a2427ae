// engine_bench: llama-bench's measurements for tandem's engine (CPU, or CUDA with --device cuda),
// in one process that loads the model once.
//
//   decode   batch-1 decode of --n-gen tokens (after an untimed --decode-prompt tokens; 0 starts
//            at position 0 like `llama-bench -p 0 -n N`), one Engine::Step per token, the next
//            token the argmax of the last logits.
//   prefill  one Engine::Step over --n-prefill random tokens from position 0, logits of the last
//            token only (like `llama-bench -p N -n 0`).
//   batch    --n-seqs concurrent requests of --seq-prompt random tokens and --n-gen generated
//            tokens each (greedy, ignore_eos) through engine::Scheduler: aggregate generated
//            tokens per second from submission until the last request finishes, the measure the
//            llama-server client of run.sh also reports.
//   verify   speculative verification's cost: one Engine::Step of --verify-batch sequences, each
//            a chunk of k+1 tokens with k+1 logit rows at position --decode-prompt, for k = 0 ..
//            --verify-max, the median step time of each and its ratio to k = 0 (a plain decode
//            step of that batch).
//   matmul   only the weight matmuls of one step (every layer's seven and the classifier) at
//            batch --matmul-batch: the kernel ceiling that decode's other work eats into.
//   kernel   one thread, no pool: the first --kernel-kib KiB of rows of layer 0's gate matrix
//            (small enough to stay in L2) multiplied by --matmul-batch rows again and again: the
//            matmul kernel's compute ceiling, to set against the DRAM roofline.
//   pool     cost of one ThreadPool::RunOnAll hand-off with a trivial body (microseconds), with
//            the default spin before sleeping and with none (every wait a futex sleep).
//
// Every mode first runs a small untimed case (it faults in the mapped weights and grows the
// scratch buffers), then --reps timed repetitions; the JSON on stdout holds every repetition and the median. Not a test: it
// measures, the comparison with llama.cpp lives in run.sh.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/util/status_util.h"
#include "common/util/thread_pool.h"
#include "engine/model/model.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/draft_proposer.h"
#include "engine/runtime/scheduler.h"
#include "engine/runtime/step_cost.h"
#include "engine/sampling/constraint.h"
#include "nlohmann/json.hpp"
#include "tandem/kernels/matmul.h"

namespace tandem::bench {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Options {
  std::string model_path;
  int32_t threads = 2;
  std::vector<std::string> modes = {"decode", "prefill", "batch"};
  int32_t reps = 3;
  int32_t n_gen = 64;
  int32_t decode_prompt = 0;
  int32_t n_prefill = 512;
  int32_t n_seqs = 32;
  int32_t seq_prompt = 32;
  int32_t matmul_batch = 1;
  int32_t kernel_kib = 256;
  int32_t batch_tokens = 512;
  int32_t verify_max = 8;
  int32_t verify_batch = 1;
  bool mbu = false;
  // Batch mode: the scheduler's speculation (off, or ngram with its draft length and gate).
  engine::SpeculativeOptions speculative;
  // Made once (a draft model loads at start), shared by every batch run in turn.
  std::shared_ptr<engine::Proposer> proposer;
  std::string kv_type = "f16";
  // Batch mode: every request's output constrained by this JSON Schema (empty: none), and
  // its sampling temperature (0: greedy; otherwise request i samples with seed + i).
  std::string json_schema;
  float batch_temperature = 0;
  uint64_t seed = 1;
  bool pack_weights = true;
  engine::Device device = engine::Device::kCpu;  // --device cuda: the CUDA engine (gpu-check)
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int32_t Argmax(const float* x, int32_t n) {
  return static_cast<int32_t>(std::max_element(x, x + n) - x);
}

// Random ids away from the special tokens at both ends of the vocabulary.
std::vector<int32_t> RandomTokens(std::mt19937_64& rng, int32_t n, int32_t vocab) {
  const int32_t lo = std::min(vocab - 1, 1000);
  const int32_t hi = std::max(lo, std::min(vocab - 1, 30000));
  std::uniform_int_distribution<int32_t> dist(lo, hi);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = dist(rng);
  return t;
}

int32_t BlocksFor(const engine::Engine& eng, int64_t positions) {
  const int64_t bs = eng.options().block_size;
  return static_cast<int32_t>((positions + bs - 1) / bs);
}

absl::StatusOr<std::unique_ptr<engine::Engine>> MakeEngine(
    std::shared_ptr<const engine::Model> model, const Options& o, int32_t ctx, int32_t max_seqs) {
  engine::EngineOptions eo;
  eo.threads = o.threads;
  eo.ctx_size = (ctx + 15) / 16 * 16;
  eo.max_seqs = max_seqs;
  eo.max_batch_tokens = std::max(o.batch_tokens, 1);
  auto t = kernels::DTypeFromName(o.kv_type);
  if (!t) return absl::InvalidArgumentError(absl::StrCat("unknown kv type ", o.kv_type));
  eo.kv_type = *t;
  eo.device = o.device;
  return engine::Engine::Create(std::move(model), eo);
}

// Tokens per second of `n_gen` single-token steps. With `step_bytes` and `step_seconds`, adds
// the engine's own record of each step (the bytes it had to move, its wall time): what the
// workers' model bandwidth utilisation gauge divides.
absl::StatusOr<double> DecodeOnce(engine::Engine& eng, const Options& o, int32_t n_gen,
                                  std::mt19937_64& rng, double* step_bytes = nullptr,
                                  double* step_seconds = nullptr) {
  const int32_t vocab = eng.model().config().n_vocab;
  TANDEM_ASSIGN_OR_RETURN(std::vector<int32_t> blocks,
                          eng.kv().pool().AllocateN(BlocksFor(eng, o.decode_prompt + n_gen)));
  std::vector<float> logits;
  int32_t next = RandomTokens(rng, 1, vocab)[0];
  absl::Status st;
  if (o.decode_prompt > 0) {
    const std::vector<int32_t> prompt = RandomTokens(rng, o.decode_prompt, vocab);
    engine::SeqChunk ch{prompt, 0, blocks, true};
    st = eng.Step(std::span<const engine::SeqChunk>(&ch, 1), &logits);
    if (st.ok()) next = Argmax(logits.data(), vocab);
  }
  const auto t0 = Clock::now();
  for (int32_t i = 0; i < n_gen && st.ok(); ++i) {
    engine::SeqChunk ch{std::span<const int32_t>(&next, 1), o.decode_prompt + i, blocks, true};
    st = eng.Step(std::span<const engine::SeqChunk>(&ch, 1), &logits);
    if (st.ok()) next = Argmax(logits.data(), vocab);
    if (st.ok() && step_bytes != nullptr) {
      *step_bytes += eng.last_step().work.bytes;
      *step_seconds += eng.last_step().seconds;
    }
  }
  const double secs = SecondsSince(t0);
  TANDEM_RETURN_IF_ERROR(eng.kv().pool().UnrefAll(blocks));
  TANDEM_RETURN_IF_ERROR(st);
  return n_gen / secs;
}

absl::StatusOr<double> PrefillOnce(engine::Engine& eng, int32_t n, std::mt19937_64& rng) {
  const std::vector<int32_t> prompt = RandomTokens(rng, n, eng.model().config().n_vocab);
  TANDEM_ASSIGN_OR_RETURN(std::vector<int32_t> blocks, eng.kv().pool().AllocateN(BlocksFor(eng, n)));
  std::vector<float> logits;
  // Chunks of max_batch_tokens, as the scheduler would split a longer prompt.
  const int32_t step = eng.options().max_batch_tokens;
  absl::Status st;
  const auto t0 = Clock::now();
  for (int32_t p = 0; p < n && st.ok(); p += step) {
    const int32_t len = std::min(step, n - p);
    engine::SeqChunk ch{std::span<const int32_t>(prompt).subspan(p, len), p, blocks, p + len == n};
    st = eng.Step(std::span<const engine::SeqChunk>(&ch, 1), &logits);
  }
  const double secs = SecondsSince(t0);
  TANDEM_RETURN_IF_ERROR(eng.kv().pool().UnrefAll(blocks));
  TANDEM_RETURN_IF_ERROR(st);
  return n / secs;
}

struct BatchResult {
  double tokens_per_s = 0;         // all generated tokens over the whole wall time
  double decode_tokens_per_s = 0;  // tokens after the last first token, over that span
  double wall_s = 0;
  int64_t generated = 0;
  int64_t steps = 0;
  int64_t spec_steps = 0;
  int64_t spec_accepted = 0;
};

absl::StatusOr<BatchResult> BatchOnce(engine::Engine& eng, const Options& o, int32_t n_seqs,
                                      int32_t n_gen, std::mt19937_64& rng) {
  const int32_t vocab = eng.model().config().n_vocab;
  engine::SchedulerOptions so;
  so.speculative = o.speculative;
  so.proposer = o.proposer;
  engine::Scheduler sched(&eng, so);
  int64_t generated = 0, generated_at_last_first = 0;
  int32_t started = 0;
  absl::Status failure;
  Clock::time_point last_first{};
  for (int32_t i = 0; i < n_seqs; ++i) {
    engine::GenerationRequest req;
    req.id = absl::StrCat("s", i);
    req.prompt = RandomTokens(rng, o.seq_prompt, vocab);
    req.sampling.temperature = o.batch_temperature;
    req.sampling.seed = o.seed + static_cast<uint64_t>(i);
    req.sampling.max_tokens = n_gen;
    req.sampling.ignore_eos = true;
    if (!o.json_schema.empty()) {
      req.sampling.constraint.kind = engine::Constraint::Kind::kJsonSchema;
      req.sampling.constraint.text = o.json_schema;
    }
    bool first = true;
    req.on_event = [&, first](const engine::TokenEvent& ev) mutable {
      if (ev.token >= 0) {
        ++generated;
        if (first) {
          first = false;
          if (++started == n_seqs) {
            last_first = Clock::now();
            generated_at_last_first = generated;
          }
        }
      }
      if (ev.finished && !ev.status.ok() && failure.ok()) failure = ev.status;
    };
    TANDEM_RETURN_IF_ERROR(sched.Submit(std::move(req)));
  }
  const auto t0 = Clock::now();
  TANDEM_RETURN_IF_ERROR(sched.RunUntilIdle());
  BatchResult r;
  r.wall_s = SecondsSince(t0);
  TANDEM_RETURN_IF_ERROR(failure);
  r.generated = generated;
  r.steps = sched.stats().steps;
  r.spec_steps = sched.stats().spec_steps;
  r.spec_accepted = sched.stats().spec_accepted_tokens;
  r.tokens_per_s = generated / r.wall_s;
  const double decode_s = SecondsSince(last_first);
  if (decode_s > 0) r.decode_tokens_per_s = (generated - generated_at_last_first) / decode_s;
  return r;
}

// Median seconds of one step verifying k drafts in each sequence (a chunk of k+1 tokens and k+1
// logit rows per sequence of `blocks`) after `prefix` positions, over `iters` steps that
// rewrite the same positions.
absl::StatusOr<double> VerifyStepSeconds(engine::Engine& eng,
                                         const std::vector<std::vector<int32_t>>& blocks,
                                         int32_t prefix, int32_t k, int32_t iters,
                                         std::mt19937_64& rng) {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<engine::SeqChunk> chunks;
  for (size_t s = 0; s < blocks.size(); ++s) {
    tokens.push_back(RandomTokens(rng, k + 1, eng.model().config().n_vocab));
  }
  for (size_t s = 0; s < blocks.size(); ++s) {
    engine::SeqChunk ch{tokens[s], prefix, blocks[s], true};
    ch.n_logits = k + 1;
    chunks.push_back(ch);
  }
  std::vector<float> logits;
  std::vector<double> secs;
  for (int32_t i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    TANDEM_RETURN_IF_ERROR(eng.Step(chunks, &logits));
    secs.push_back(SecondsSince(t0));
  }
  return Median(secs);
}

// Every weight matmul of one step at batch `b`, through the same kernels::Matmul the engine calls.
struct MatmulSweep {
  std::vector<const engine::WeightView*> weights;
  std::vector<float> in, out;
  int32_t batch = 1;
};

MatmulSweep PrepareSweep(const engine::Model& m, int32_t batch) {
  MatmulSweep s;
  s.batch = batch;
  int64_t max_cols = 0, max_rows = 0;
  for (int32_t l = 0; l < m.config().n_layer; ++l) {
    const engine::LayerWeights& w = m.layer(l);
    for (const engine::WeightView* v : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w_gate, &w.w_up, &w.w_down,
                                        &w.ffn_gate_inp, &w.sh_gate, &w.sh_up, &w.sh_down}) {
      if (v->data != nullptr) s.weights.push_back(v);
    }
    // An MoE layer: the experts one token reads (the first n_expert_used stand in).
    for (int32_t e = 0; e < m.config().n_expert_used && !w.exp_gate.empty(); ++e) {
      for (const engine::WeightView* v : {&w.exp_gate[e], &w.exp_up[e], &w.exp_down[e]}) {
        s.weights.push_back(v);
      }
    }
  }
  s.weights.push_back(&m.output());
  for (const auto* v : s.weights) {
    max_cols = std::max(max_cols, v->cols);
    max_rows = std::max(max_rows, v->rows);
  }
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  s.in.resize(max_cols * batch);
  for (float& x : s.in) x = nd(rng);
  s.out.resize(max_rows * batch);
  return s;
}

double SweepOnce(MatmulSweep& s, util::ThreadPool& pool) {
  const auto t0 = Clock::now();
  for (const engine::WeightView* w : s.weights) {
    kernels::MatmulParams p;
    p.weight_type = w->type;
    p.weight = w->data;
    p.packed = w->packed;
    p.rows = w->rows;
    p.cols = w->cols;
    p.input = s.in.data();
    p.batch = s.batch;
    p.output = s.out.data();
    kernels::Matmul(p, &pool);
  }
  return SecondsSince(t0);
}

struct KernelRate {
  double weight_gb_per_s = 0;  // weight bytes consumed per second
  double gmac_per_s = 0;       // multiply-adds per second (weights x batch)
};

KernelRate KernelOnce(const engine::WeightView& w, int64_t rows, MatmulSweep& s) {
  kernels::MatmulParams p;
  p.weight_type = w.type;
  p.weight = w.data;
  p.packed = w.packed;
  p.rows = rows;
  p.cols = w.cols;
  p.input = s.in.data();
  p.batch = s.batch;
  p.output = s.out.data();
  const double bytes = static_cast<double>(kernels::RowBytes(w.type, w.cols)) * rows;
  // About 0.2 s of work, whatever the type and batch.
  int iters = 1;
  for (auto t0 = Clock::now(); SecondsSince(t0) < 0.02; iters *= 2) {
    for (int i = 0; i < iters; ++i) kernels::Matmul(p, nullptr);
  }
  iters *= 5;
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) kernels::Matmul(p, nullptr);
  const double secs = SecondsSince(t0);
  KernelRate r;
  r.weight_gb_per_s = bytes * iters / secs / 1e9;
  r.gmac_per_s = static_cast<double>(rows) * w.cols * s.batch * iters / secs / 1e9;
  return r;
}

double PoolOverheadUs(util::ThreadPool& pool) {
  constexpr int kCalls = 20000;
  std::atomic<int64_t> sink{0};
  const std::function<void(int)> body = [&](int t) { sink.fetch_add(t + 1); };
  const auto t0 = Clock::now();
  for (int i = 0; i < kCalls; ++i) pool.RunOnAll(body);
  return SecondsSince(t0) * 1e6 / kCalls;
}

nlohmann::json Series(const std::vector<double>& v) {
  return {{"runs", v}, {"median", Median(v)}};
}

absl::Status Run(const Options& o) {
  const auto t_load = Clock::now();
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<engine::Model> model, engine::Model::Load(o.model_path, {.pack_weights = o.pack_weights}));
  const double load_s = SecondsSince(t_load);
  const engine::ModelConfig& c = model->config();
  const double wbytes = static_cast<double>(model->weight_bytes_per_token());
  std::mt19937_64 rng(o.seed);

  nlohmann::json j;
  j["tool"] = "tandem-engine-bench";
  j["model"] = o.model_path;
  j["arch"] = c.arch_name;
  j["weight_type"] = std::string(kernels::Traits(model->layer(0).wq.type).name);
  j["packed_weights"] = model->layer(0).wq.packed;
  j["n_layer"] = c.n_layer;
  j["n_embd"] = c.n_embd;
  j["n_vocab"] = c.n_vocab;
  j["weight_bytes_per_token"] = model->weight_bytes_per_token();
  j["threads"] = o.threads;
  j["kv_type"] = o.kv_type;
  j["reps"] = o.reps;
  j["load_s"] = load_s;

  for (const std::string& mode : o.modes) {
    if (mode == "decode") {
      TANDEM_ASSIGN_OR_RETURN(auto eng, MakeEngine(model, o, o.decode_prompt + o.n_gen, 1));
      TANDEM_RETURN_IF_ERROR(DecodeOnce(*eng, o, std::min(o.n_gen, 4), rng).status());
      std::vector<double> tps, step_gbps;
      for (int r = 0; r < o.reps; ++r) {
        double bytes = 0, secs = 0;
        TANDEM_ASSIGN_OR_RETURN(double v, DecodeOnce(*eng, o, o.n_gen, rng, &bytes, &secs));
        tps.push_back(v);
        step_gbps.push_back(secs > 0 ? bytes / secs / 1e9 : 0);
      }
      std::vector<double> gbps;
      for (double v : tps) gbps.push_back(v * wbytes / 1e9);
      j["decode"] = {{"n_gen", o.n_gen}, {"prompt", o.decode_prompt},
                     {"tokens_per_s", Series(tps)}, {"weight_gb_per_s", Series(gbps)},
                     {"engine_step_gb_per_s", Series(step_gbps)}};
      if (o.mbu) {
        // The workers' gauge: the engine's step bytes over its step time, against the peak a
        // worker measures at start with these threads.
        const engine::DevicePeaks peaks = engine::MeasureCpuPeaks(o.threads);
        std::vector<double> mbu;
        for (double g : step_gbps) mbu.push_back(g / peaks.read_gbs);
        j["decode"]["peak_read_gbs"] = peaks.read_gbs;
        j["decode"]["mbu"] = Series(mbu);
      }
    } else if (mode == "prefill") {
      TANDEM_ASSIGN_OR_RETURN(auto eng, MakeEngine(model, o, o.n_prefill, 1));
      TANDEM_RETURN_IF_ERROR(PrefillOnce(*eng, std::min(o.n_prefill, 64), rng).status());
      std::vector<double> tps;
      for (int r = 0; r < o.reps; ++r) {
        TANDEM_ASSIGN_OR_RETURN(double v, PrefillOnce(*eng, o.n_prefill, rng));
        tps.push_back(v);
      }
      j["prefill"] = {{"n_prompt", o.n_prefill}, {"tokens_per_s", Series(tps)}};
    } else if (mode == "batch") {
      TANDEM_ASSIGN_OR_RETURN(auto eng, MakeEngine(model, o, o.seq_prompt + o.n_gen, o.n_seqs));
      Options bo = o;
      TANDEM_ASSIGN_OR_RETURN(bo.proposer, engine::MakeSpecProposer(o.speculative, *eng));
      TANDEM_RETURN_IF_ERROR(BatchOnce(*eng, bo, std::min(o.n_seqs, 2), 2, rng).status());
      std::vector<double> tps, dtps;
      BatchResult last;
      for (int r = 0; r < o.reps; ++r) {
        TANDEM_ASSIGN_OR_RETURN(last, BatchOnce(*eng, bo, o.n_seqs, o.n_gen, rng));
        tps.push_back(last.tokens_per_s);
        dtps.push_back(last.decode_tokens_per_s);
      }
      j["batch"] = {{"n_seqs", o.n_seqs},
                    {"prompt", o.seq_prompt},
                    {"n_gen", o.n_gen},
                    {"steps", last.steps},
                    {"speculative", engine::SpecMethodName(o.speculative.method)},
                    {"spec_steps", last.spec_steps},
                    {"spec_accepted_tokens", last.spec_accepted},
                    {"generated", last.generated},
                    {"tokens_per_s", Series(tps)},
                    {"decode_phase_tokens_per_s", Series(dtps)}};
      if (!o.json_schema.empty()) {
        engine::Constraint c;
        c.kind = engine::Constraint::Kind::kJsonSchema;
        c.text = o.json_schema;
        TANDEM_ASSIGN_OR_RETURN(auto tc, engine::CompileConstraint(c, model->tokenizer()));
        j["batch"]["constraint"] = {{"masks_computed", tc->masks_computed()},
                                    {"masks_cached", tc->masks_cached()}};
      }
    } else if (mode == "verify") {
      const int32_t prefix = std::max(o.decode_prompt, 1);
      const int32_t batch = o.verify_batch;
      TANDEM_ASSIGN_OR_RETURN(auto eng, MakeEngine(model, o, prefix + o.verify_max + 1, batch));
      std::vector<std::vector<int32_t>> blocks;
      std::vector<float> logits;
      for (int32_t s = 0; s < batch; ++s) {
        TANDEM_ASSIGN_OR_RETURN(
            std::vector<int32_t> b,
            eng->kv().pool().AllocateN(BlocksFor(*eng, prefix + o.verify_max + 1)));
        blocks.push_back(std::move(b));
        // Each prompt alone: a step takes at most --batch-tokens tokens.
        const std::vector<int32_t> prompt = RandomTokens(rng, prefix, c.n_vocab);
        engine::SeqChunk pre{prompt, 0, blocks.back(), false};
        TANDEM_RETURN_IF_ERROR(eng->Step(std::span<const engine::SeqChunk>(&pre, 1), &logits));
      }
      TANDEM_RETURN_IF_ERROR(VerifyStepSeconds(*eng, blocks, prefix, o.verify_max, 2, rng).status());
      // Rounds over k = 0..max in turn, so drift in the machine's speed spreads over every k.
      std::vector<std::vector<double>> ms(o.verify_max + 1);
      for (int r = 0; r < o.reps; ++r) {
        for (int32_t k = 0; k <= o.verify_max; ++k) {
          TANDEM_ASSIGN_OR_RETURN(double v, VerifyStepSeconds(*eng, blocks, prefix, k, 8, rng));
          ms[k].push_back(v * 1e3);
        }
      }
      nlohmann::json rows = nlohmann::json::array();
      const double base = Median(ms[0]);
      for (int32_t k = 0; k <= o.verify_max; ++k) {
        rows.push_back({{"k", k}, {"step_ms", Series(ms[k])},
                        {"ratio_to_decode", base > 0 ? Median(ms[k]) / base : 0}});
      }
      for (const auto& b : blocks) TANDEM_RETURN_IF_ERROR(eng->kv().pool().UnrefAll(b));
      j["verify"] = {{"prefix", prefix}, {"batch", batch}, {"steps", rows}};
    } else if (mode == "matmul") {
      util::ThreadPool pool(o.threads);
      MatmulSweep s = PrepareSweep(*model, o.matmul_batch);
      SweepOnce(s, pool);
      std::vector<double> ms, gbps;
      for (int r = 0; r < o.reps; ++r) {
        const double secs = SweepOnce(s, pool);
        ms.push_back(secs * 1e3);
        gbps.push_back(wbytes / secs / 1e9);
      }
      j["matmul"] = {{"batch", o.matmul_batch}, {"calls", s.weights.size()},
                     {"sweep_ms", Series(ms)}, {"weight_gb_per_s", Series(gbps)}};
    } else if (mode == "kernel") {
      // The FFN gate, or an MoE model's first expert's.
      const engine::LayerWeights& l0 = model->layer(0);
      const engine::WeightView& w = l0.w_gate.data != nullptr ? l0.w_gate : l0.exp_gate.at(0);
      const int64_t row_bytes = static_cast<int64_t>(kernels::RowBytes(w.type, w.cols));
      const int64_t rows =
          std::clamp<int64_t>(int64_t{o.kernel_kib} * 1024 / row_bytes / 16 * 16, 16, w.rows);
      MatmulSweep s = PrepareSweep(*model, o.matmul_batch);
      std::vector<double> gbps, gmacs;
      for (int r = 0; r < o.reps; ++r) {
        const KernelRate k = KernelOnce(w, rows, s);
        gbps.push_back(k.weight_gb_per_s);
        gmacs.push_back(k.gmac_per_s);
      }
      j["kernel"] = {{"batch", o.matmul_batch}, {"rows", rows}, {"cols", w.cols},
                     {"weight_kib", rows * row_bytes / 1024}, {"weight_gb_per_s", Series(gbps)},
                     {"gmac_per_s", Series(gmacs)}};
    } else if (mode == "pool") {
      std::vector<double> us, sleep_us;
      {
        util::ThreadPool pool(o.threads);
        PoolOverheadUs(pool);
        for (int r = 0; r < o.reps; ++r) us.push_back(PoolOverheadUs(pool));
      }
      {
        util::ThreadPool pool(o.threads, std::chrono::nanoseconds(0));
        PoolOverheadUs(pool);
        for (int r = 0; r < o.reps; ++r) sleep_us.push_back(PoolOverheadUs(pool));
      }
      j["pool"] = {{"run_on_all_us", Series(us)}, {"run_on_all_no_spin_us", Series(sleep_us)}};
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown mode '", mode,
                                                     "' (decode, prefill, batch, verify, matmul, kernel, pool)"));
    }
  }
  std::printf("%s\n", j.dump().c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace tandem::bench

int main(int argc, char** argv) {
  tandem::bench::Options o;
  std::string modes = "decode,prefill,batch";
  CLI::App app{
      "tandem engine benchmark, CPU or CUDA (decode, prefill, batched decode); JSON on stdout"};
  app.add_option("--model", o.model_path, "GGUF model")->required();
  app.add_option("--threads,-t", o.threads, "Compute threads");
  app.add_option("--modes", modes,
                 "Comma list of decode,prefill,batch,verify,matmul,kernel,pool");
  app.add_option("--verify-max", o.verify_max, "Largest draft count k of the verify mode");
  app.add_flag("--mbu", o.mbu,
               "decode mode: also measure the peak read bandwidth as a worker does at start and "
               "report the model bandwidth utilisation gauge's figure");
  app.add_option("--verify-batch", o.verify_batch, "Sequences verified together in the verify mode")
      ->check(CLI::Range(1, 256));
  std::string spec = "off";
  int32_t spec_tokens = 4, spec_max_batch = 8;
  app.add_option("--speculative", spec, "Batch mode: off, ngram, self:TYPE or draft:PATH");
  app.add_option("--spec-tokens", spec_tokens, "Batch mode: most draft tokens per step");
  bool spec_fixed = false;
  app.add_flag("--spec-fixed", spec_fixed,
               "Batch mode: always draft --spec-tokens (no adaptive draft length)");
  app.add_option("--spec-max-batch", spec_max_batch,
                 "Batch mode: no speculation with more decoding sequences than this");
  app.add_option("--reps,-r", o.reps, "Timed repetitions per mode (after one untimed)");
  app.add_option("--n-gen,-n", o.n_gen, "Generated tokens per sequence (decode, batch)");
  app.add_option("--decode-prompt", o.decode_prompt, "Untimed prompt tokens before decode");
  app.add_option("--n-prefill,-p", o.n_prefill, "Prompt tokens of the prefill case");
  app.add_option("--n-seqs", o.n_seqs, "Concurrent sequences of the batch case");
  app.add_option("--seq-prompt", o.seq_prompt, "Prompt tokens of each batch-case sequence");
  app.add_option("--matmul-batch", o.matmul_batch, "Activation rows of the matmul sweep");
  app.add_option("--kernel-kib", o.kernel_kib, "Weight KiB of the kernel mode (fits in L2)");
  app.add_option("--batch-tokens", o.batch_tokens, "Engine max_batch_tokens (prefill chunk)");
  app.add_option("--kv-type,--kv-dtype", o.kv_type,
                 "KV cache type: f16 (llama.cpp's default), f32, int8 or fp8");
  app.add_option("--seed", o.seed, "Seed of the random prompts (and of sampled batch runs)");
  app.add_option("--batch-temperature", o.batch_temperature,
                 "Batch mode: sampling temperature (default 0, greedy)")
      ->check(CLI::Range(0.0f, 2.0f));
  std::string schema_file;
  app.add_option("--json-schema", schema_file,
                 "Batch mode: constrain every output by the JSON Schema in this file")
      ->check(CLI::ExistingFile);
  bool no_pack = false;
  app.add_flag("--no-pack", no_pack, "Use the GGUF rows as they are (no packed weights)");
  std::string device = "cpu";
  app.add_option("--device", device,
                 "cpu, or cuda: decode, prefill and batch on the CUDA engine (matmul and kernel "
                 "modes measure CPU kernels only)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  CLI11_PARSE(app, argc, argv);
  o.device = tandem::engine::DeviceFromName(device).value_or(tandem::engine::Device::kCpu);
  // The CUDA engine reads GGUF rows as stored: packing is a CPU layout.
  o.pack_weights = !no_pack && o.device == tandem::engine::Device::kCpu;
  o.modes = absl::StrSplit(modes, ',', absl::SkipEmpty());
  auto parsed = tandem::engine::ParseSpeculative(spec, spec_tokens);
  if (!parsed.ok()) {
    std::fprintf(stderr, "engine_bench: %s\n", std::string(parsed.status().ToString()).c_str());
    return 2;
  }
  o.speculative = *parsed;
  if (!schema_file.empty()) {
    std::ifstream in(schema_file);
    o.json_schema.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  o.speculative.max_batch = spec_max_batch;
  o.speculative.adaptive = !spec_fixed;
  if (o.verify_max < 0 || o.verify_max > 16) {
    std::fprintf(stderr, "engine_bench: --verify-max must be in [0, 16]\n");
    return 2;
  }
  if (o.threads < 1 || o.reps < 1 || o.n_gen < 1 || o.n_prefill < 1 || o.n_seqs < 1 ||
      o.seq_prompt < 1 || o.matmul_batch < 1) {
    std::fprintf(stderr, "engine_bench: counts must be >= 1\n");
    return 2;
  }
  const absl::Status st = tandem::bench::Run(o);
  if (!st.ok()) {
    std::fprintf(stderr, "engine_bench: %s\n", std::string(st.ToString()).c_str());
    return 1;
  }
  return 0;
}
