// KV-cache quantisation quality: greedy agreement and logit error of int8 and fp8-e4m3 KV
// against an f32 KV cache on the same model (not a test: nothing is asserted; see run.sh and
// docs/perf/kv-quant.md).
//
// For each prompt, the f32-KV engine decodes `tokens` greedy tokens and keeps every step's
// logits. Each quantised engine is then measured two ways:
//  * teacher-forced: it is fed the f32 run's tokens, so every step sees the same context, and
//    its logits are compared step by step (max and mean |error|, and whether its argmax is the
//    f32 run's token);
//  * free-running: it decodes greedily on its own, and the first position where its tokens
//    leave the f32 run's is reported (a single flip changes everything after it, so the
//    teacher-forced agreement is the better per-token figure).
// --model PATH evaluates a GGUF file; --tiny writes the synthetic test model
// (tests/fakes/tiny_model.h, random weights) to a temporary file and evaluates that.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"
#include "engine/model/model.h"
#include "engine/runtime/engine.h"
#include "nlohmann/json.hpp"
#include "tandem/kernels/kv_quant.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::bench {
namespace {

struct Options {
  std::string model_path;
  bool tiny = false;
  int tokens = 256;
  int threads = 1;
  std::vector<std::string> prompts;
  std::vector<std::string> types = {"f16", "int8", "fp8"};
};

struct Run {
  std::vector<int32_t> tokens;              // generated (or fed) tokens
  std::vector<std::vector<float>> logits;   // logits before each generated token
};

// KL(softmax(p) || softmax(q)) in nats.
double KlDivergence(const std::vector<float>& p, const std::vector<float>& q) {
  const double mp = *std::max_element(p.begin(), p.end());
  const double mq = *std::max_element(q.begin(), q.end());
  double sp = 0, sq = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    sp += std::exp(p[i] - mp);
    sq += std::exp(q[i] - mq);
  }
  const double lp = mp + std::log(sp), lq = mq + std::log(sq);
  double kl = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double a = p[i] - lp, b = q[i] - lq;
    kl += std::exp(a) * (a - b);
  }
  return kl;
}

int32_t Argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// Prefills `prompt`, then decodes `n` tokens: greedily, or the given `forced` tokens.
absl::StatusOr<Run> Decode(engine::Engine& e, const std::vector<int32_t>& prompt, int n,
                           const std::vector<int32_t>* forced) {
  const int32_t bs = e.kv().block_size();
  std::vector<int32_t> blocks((prompt.size() + n + bs) / bs);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<int32_t>(i);
  Run r;
  std::vector<float> logits;
  const int32_t max_chunk = e.options().max_batch_tokens;
  for (size_t start = 0; start < prompt.size(); start += max_chunk) {
    engine::SeqChunk ch;
    const size_t len = std::min<size_t>(max_chunk, prompt.size() - start);
    ch.tokens = std::span<const int32_t>(prompt).subspan(start, len);
    ch.start_pos = static_cast<int32_t>(start);
    ch.block_table = blocks;
    ch.want_logits = start + len == prompt.size();
    TANDEM_RETURN_IF_ERROR(e.Step({&ch, 1}, &logits));
  }
  for (int i = 0; i < n; ++i) {
    r.logits.push_back(logits);
    const int32_t next = forced ? (*forced)[i] : Argmax(logits);
    r.tokens.push_back(next);
    if (i + 1 == n) break;
    engine::SeqChunk ch;
    ch.tokens = std::span<const int32_t>(&r.tokens.back(), 1);
    ch.start_pos = static_cast<int32_t>(prompt.size()) + i;
    ch.block_table = blocks;
    ch.want_logits = true;
    TANDEM_RETURN_IF_ERROR(e.Step({&ch, 1}, &logits));
  }
  return r;
}

absl::StatusOr<std::unique_ptr<engine::Engine>> MakeEngine(std::shared_ptr<const engine::Model> m,
                                                           kernels::DType t, int ctx,
                                                           int threads) {
  engine::EngineOptions o;
  o.threads = threads;
  o.ctx_size = ctx;
  o.max_seqs = 1;
  o.kv_type = t;
  return engine::Engine::Create(std::move(m), o);
}

absl::Status Main(const Options& o) {
  std::string path = o.model_path;
  std::string name = std::filesystem::path(path).stem().string();
  if (o.tiny) {
    path = (std::filesystem::temp_directory_path() /
            absl::StrCat("tandem-kvq-eval-", getpid(), ".gguf"))
               .string();
    testing::TinyModelOptions to;
    to.n_ctx = 1024;
    TANDEM_RETURN_IF_ERROR(testing::WriteTinyModel(to, path));
    name = "tiny-synthetic";
  }
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<engine::Model> model, engine::Model::Load(path));
  if (o.tiny) std::filesystem::remove(path);
  const engine::ModelConfig& cfg = model->config();

  nlohmann::json out;
  out["model"] = name;
  out["n_layer"] = cfg.n_layer;
  out["n_head_kv"] = cfg.n_head_kv;
  out["head_dim"] = cfg.head_dim;
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& p : o.prompts) {
    prompts.push_back(model->tokenizer().Encode(p, /*add_special=*/true, /*parse_special=*/false));
  }
  // Clip the generation to the model's context (stories15M has 256 positions).
  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  const int tokens = std::min<int>(o.tokens, cfg.n_ctx_train - static_cast<int>(longest) - 1);
  if (tokens < 1) return absl::InvalidArgumentError("the prompts fill the model's context");
  out["tokens_per_prompt"] = tokens;
  const int ctx = cfg.n_ctx_train;

  TANDEM_ASSIGN_OR_RETURN(auto ref_engine, MakeEngine(model, kernels::DType::kF32, ctx, o.threads));
  std::vector<Run> refs;
  for (const auto& p : prompts) {
    TANDEM_ASSIGN_OR_RETURN(Run r, Decode(*ref_engine, p, tokens, nullptr));
    refs.push_back(std::move(r));
  }
  {
    // Crest factor (max|x| / rms) of each (token, kv head) K and V vector of the last prompt's
    // f32 cache: per-vector scales spend their range on the largest element, so a high crest
    // factor means the typical element gets few quantisation levels.
    engine::KvCache& kv = ref_engine->kv();
    const int64_t positions = static_cast<int64_t>(prompts.back().size()) + tokens - 1;
    const int64_t hd = cfg.head_dim;
    double crest[2] = {0, 0};
    int64_t vecs = 0;
    for (int32_t l = 0; l < cfg.n_layer; ++l) {
      for (int kv_i = 0; kv_i < 2; ++kv_i) {
        const float* base =
            reinterpret_cast<const float*>(kv_i == 0 ? kv.k_layer(l) : kv.v_layer(l));
        for (int64_t t = 0; t < positions; ++t) {
          for (int64_t h = 0; h < cfg.n_head_kv; ++h) {
            const float* x = base + (t * cfg.n_head_kv + h) * hd;  // blocks 0.. in order
            double amax = 0, ss = 0;
            for (int64_t i = 0; i < hd; ++i) {
              amax = std::max(amax, std::fabs(double(x[i])));
              ss += double(x[i]) * x[i];
            }
            if (ss > 0) crest[kv_i] += amax / std::sqrt(ss / hd);
            if (kv_i == 0) ++vecs;
          }
        }
      }
    }
    out["k_crest_factor"] = crest[0] / vecs;
    out["v_crest_factor"] = crest[1] / vecs;
    std::printf("%s: mean crest factor (max|x|/rms per token and kv head) K %.2f, V %.2f\n",
                name.c_str(), crest[0] / vecs, crest[1] / vecs);
  }
  ref_engine.reset();

  std::printf("%-16s %-5s %8s %12s %12s %12s %10s %s\n", "model", "kv", "agree", "max|dlogit|",
              "mean|dlogit|", "max|logit|", "mean KL", "diverge@");
  for (const std::string& tname : o.types) {
    std::optional<kernels::DType> t = kernels::KvTypeFromName(tname);
    if (!t) return absl::InvalidArgumentError("unknown KV type " + tname);
    TANDEM_ASSIGN_OR_RETURN(auto eng, MakeEngine(model, *t, ctx, o.threads));
    int64_t agree = 0, steps = 0;
    double max_err = 0, sum_err = 0, max_logit = 0, kl = 0;
    int64_t n_err = 0;
    std::vector<int> diverge;
    for (size_t pi = 0; pi < prompts.size(); ++pi) {
      const Run& ref = refs[pi];
      TANDEM_ASSIGN_OR_RETURN(Run forced, Decode(*eng, prompts[pi], tokens, &ref.tokens));
      for (int i = 0; i < tokens; ++i) {
        const auto& a = ref.logits[i];
        const auto& b = forced.logits[i];
        agree += Argmax(b) == ref.tokens[i];
        ++steps;
        kl += KlDivergence(a, b);
        for (size_t j = 0; j < a.size(); ++j) {
          const double d = std::fabs(double(a[j]) - b[j]);
          max_err = std::max(max_err, d);
          sum_err += d;
          max_logit = std::max(max_logit, std::fabs(double(a[j])));
        }
        n_err += static_cast<int64_t>(a.size());
      }
      TANDEM_ASSIGN_OR_RETURN(Run free, Decode(*eng, prompts[pi], tokens, nullptr));
      int d = 0;
      while (d < tokens && free.tokens[d] == ref.tokens[d]) ++d;
      diverge.push_back(d);
    }
    const double agreement = double(agree) / steps;
    const double mean_err = sum_err / n_err;
    std::string div;
    for (int d : diverge) absl::StrAppend(&div, div.empty() ? "" : ",", d == tokens ? "-" : std::to_string(d));
    std::printf("%-16s %-5s %7.2f%% %12.4g %12.4g %12.4g %10.3g %s\n", name.c_str(),
                tname.c_str(), 100 * agreement, max_err, mean_err, max_logit, kl / steps,
                div.c_str());
    nlohmann::json j;
    j["teacher_forced_top1_agreement"] = agreement;
    j["steps"] = steps;
    j["max_abs_logit_error"] = max_err;
    j["mean_abs_logit_error"] = mean_err;
    j["max_abs_logit"] = max_logit;
    j["mean_kl_nats"] = kl / steps;
    j["free_running_first_divergence"] = diverge;  // == tokens_per_prompt: none
    out["kv"][tname] = j;
  }
  std::fprintf(stderr, "%s\n", out.dump().c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace tandem::bench

int main(int argc, char** argv) {
  tandem::bench::Options o;
  CLI::App app{"KV-cache quantisation quality against f32 KV"};
  app.add_option("--model", o.model_path, "GGUF model");
  app.add_flag("--tiny", o.tiny, "use the synthetic test model instead");
  app.add_option("--tokens", o.tokens, "greedy tokens per prompt")->check(CLI::PositiveNumber);
  app.add_option("-t,--threads", o.threads, "threads")->check(CLI::PositiveNumber);
  app.add_option("--prompt", o.prompts, "prompt text (repeatable)");
  app.add_option("--kv", o.types, "KV types to compare with f32 (default f16 int8 fp8)");
  CLI11_PARSE(app, argc, argv);
  if (o.model_path.empty() == !o.tiny) {
    std::fprintf(stderr, "give exactly one of --model and --tiny\n");
    return 2;
  }
  if (o.prompts.empty()) o.prompts = {""};
  absl::Status st = tandem::bench::Main(o);
  if (!st.ok()) {
    std::fprintf(stderr, "kv_quant_eval: %s\n", std::string(st.ToString()).c_str());
    return 1;
  }
  return 0;
}
