// llama_ref: the reference side of the fidelity check (scripts/fidelity.sh). It runs the
// pinned llama.cpp on a GGUF model, decodes greedily, and prints one JSON object:
//
//   {"prompt_tokens":[...], "tokens":[...], "gaps":[...], "top2":[...], "spreads":[...],
//    "router_gaps":[...], "stopped":"eog"|"length", "text":"..."}
//
// gaps[i] is the top-1 minus top-2 logit at step i, top2[i] the runner-up id, spreads[i] the
// max minus min logit; the checker uses them to tell a near-tie from a real divergence.
// router_gaps[i] (MoE models only) is step i's smallest routing margin (see RouterGaps).
//
// Defaults are chosen to be closest to tandem's reference path: F32 KV cache, flash attention
// off, the whole prompt in one batch. Built only by scripts/build_llama_cpp.sh against the
// cached llama.cpp build; it is not part of tandem's CMake build.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "llama.h"

namespace {

struct Options {
  std::string model;
  std::string prompt;
  int n = 64;
  int threads = 2;
  ggml_type type_k = GGML_TYPE_F32;
  ggml_type type_v = GGML_TYPE_F32;
  bool flash_attn = false;
  bool ignore_eos = false;
  bool repack = true;  // llama.cpp's default (weight repacking for the CPU's best kernels)
  bool verbose = false;
};

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr,
               "llama_ref: %s\n"
               "usage: llama_ref --model M.gguf [--prompt P] [--n 64] [--threads 2]\n"
               "                 [--type-k f32] [--type-v f32] [--flash-attn on|off]\n"
               "                 [--ignore-eos] [--no-repack] [--verbose]\n",
               why);
  std::exit(2);
}

bool ParseType(const std::string& s, ggml_type* out) {
  static const struct {
    const char* name;
    ggml_type type;
  } kTypes[] = {{"f32", GGML_TYPE_F32},   {"f16", GGML_TYPE_F16},   {"bf16", GGML_TYPE_BF16},
                {"q8_0", GGML_TYPE_Q8_0}, {"q4_0", GGML_TYPE_Q4_0}, {"q4_1", GGML_TYPE_Q4_1},
                {"q5_0", GGML_TYPE_Q5_0}, {"q5_1", GGML_TYPE_Q5_1}};
  for (const auto& t : kTypes) {
    if (s == t.name) {
      *out = t.type;
      return true;
    }
  }
  return false;
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Usage(("missing value for " + a).c_str());
      return argv[++i];
    };
    if (a == "--model") {
      o.model = value();
    } else if (a == "--prompt") {
      o.prompt = value();
    } else if (a == "--n") {
      o.n = std::atoi(value().c_str());
    } else if (a == "--threads") {
      o.threads = std::atoi(value().c_str());
    } else if (a == "--type-k" || a == "--type-v") {
      const std::string v = value();
      if (!ParseType(v, a == "--type-k" ? &o.type_k : &o.type_v)) {
        Usage(("unknown KV cache type " + v).c_str());
      }
    } else if (a == "--flash-attn") {
      const std::string v = value();
      if (v != "on" && v != "off") Usage("--flash-attn takes on or off");
      o.flash_attn = v == "on";
    } else if (a == "--ignore-eos") {
      o.ignore_eos = true;
    } else if (a == "--no-repack") {
      o.repack = false;
    } else if (a == "--verbose") {
      o.verbose = true;
    } else {
      Usage(("unknown argument " + a).c_str());
    }
  }
  if (o.model.empty()) Usage("--model is required");
  if (o.n < 1) Usage("--n must be >= 1");
  if (o.threads < 1) Usage("--threads must be >= 1");
  return o;
}

// Mixture-of-experts models: the smallest margin, over layers and the step's tokens, between
// the router logits of the last expert a token chose and the first it did not. A margin near
// zero is a near-tie in routing: a rounding difference can flip the expert, and the output
// with it, while the output logits themselves show no near-tie.
struct RouterGaps {
  int k = 0;  // experts per token (0: not an MoE model)
  float step_min = 0;
};

bool ObserveRouter(ggml_tensor* t, bool ask, void* user_data) {
  auto* g = static_cast<RouterGaps*>(user_data);
  const bool router = std::strncmp(t->name, "ffn_moe_logits-", 15) == 0;
  if (ask) return router;
  if (!router || t->type != GGML_TYPE_F32) return true;
  const int64_t n_expert = t->ne[0];
  std::vector<float> row(static_cast<size_t>(n_expert));
  for (int64_t j = 0; j < t->ne[1]; ++j) {
    const char* base = static_cast<const char*>(t->data) + j * t->nb[1];
    for (int64_t e = 0; e < n_expert; ++e) {
      row[static_cast<size_t>(e)] = *reinterpret_cast<const float*>(base + e * t->nb[0]);
    }
    if (g->k >= n_expert) continue;
    std::nth_element(row.begin(), row.begin() + g->k, row.end(), std::greater<float>());
    const float first_out = row[static_cast<size_t>(g->k)];
    const float last_in = *std::min_element(row.begin(), row.begin() + g->k);
    g->step_min = std::min(g->step_min, last_in - first_out);
  }
  return true;
}

void QuietLog(ggml_log_level level, const char* text, void* verbose) {
  if (verbose != nullptr || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is not valid.
size_t Utf8Len(const std::string& s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return 0;
  }
  return n;
}

// A random-weight model emits arbitrary byte tokens, so the text may be invalid UTF-8; JSON
// must not be. Invalid bytes become U+FFFD (the text is informational; ids are compared).
std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = Utf8Len(s, i);
    if (n == 0) {
      out += "\\ufffd";
      ++i;
      continue;
    }
    if (n > 1) {
      out.append(s, i, n);
      i += n;
      continue;
    }
    ++i;
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

template <typename T>
std::string JsonArray(const std::vector<T>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += ",";
    if constexpr (std::is_floating_point_v<T>) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v[i]));
      out += buf;
    } else {
      out += std::to_string(v[i]);
    }
  }
  return out + "]";
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  llama_log_set(QuietLog, o.verbose ? reinterpret_cast<void*>(1) : nullptr);
  llama_backend_init();

  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;  // tandem's fidelity is checked on the CPU path
  mp.use_extra_bufts = o.repack;
  llama_model* model = llama_model_load_from_file(o.model.c_str(), mp);
  if (model == nullptr) {
    std::fprintf(stderr, "llama_ref: cannot load %s\n", o.model.c_str());
    return 1;
  }
  const llama_vocab* vocab = llama_model_get_vocab(model);
  RouterGaps router;
  {
    char arch[64] = {0}, used[32] = {0};
    if (llama_model_meta_val_str(model, "general.architecture", arch, sizeof arch) > 0 &&
        llama_model_meta_val_str(model, (std::string(arch) + ".expert_used_count").c_str(), used,
                                 sizeof used) > 0) {
      router.k = std::atoi(used);
    }
  }
  const int n_vocab = llama_vocab_n_tokens(vocab);

  // add_special: BOS (and EOS) exactly as the model's metadata asks. parse_special off: the
  // prompt is plain text, as tandem generate treats it.
  std::vector<llama_token> prompt(o.prompt.size() + 8);
  int n_prompt = llama_tokenize(vocab, o.prompt.data(), static_cast<int32_t>(o.prompt.size()),
                                prompt.data(), static_cast<int32_t>(prompt.size()), true, false);
  if (n_prompt < 0) {
    prompt.resize(static_cast<size_t>(-n_prompt));
    n_prompt = llama_tokenize(vocab, o.prompt.data(), static_cast<int32_t>(o.prompt.size()),
                              prompt.data(), static_cast<int32_t>(prompt.size()), true, false);
  }
  if (n_prompt <= 0) {
    std::fprintf(stderr, "llama_ref: the prompt tokenises to nothing (no BOS); give a prompt\n");
    return 1;
  }
  prompt.resize(static_cast<size_t>(n_prompt));

  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(n_prompt + o.n + 16);
  cp.n_batch = static_cast<uint32_t>(n_prompt + 1);  // whole prompt in one llama_decode
  cp.n_ubatch = cp.n_batch;
  cp.n_seq_max = 1;
  cp.n_threads = o.threads;
  cp.n_threads_batch = o.threads;
  cp.type_k = o.type_k;
  cp.type_v = o.type_v;
  cp.flash_attn_type = o.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
  cp.no_perf = true;
  if (router.k > 0) {
    cp.cb_eval = ObserveRouter;
    cp.cb_eval_user_data = &router;
  }
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "llama_ref: cannot create a context (KV types/flash attention?)\n");
    return 1;
  }

  std::vector<llama_token> tokens;
  std::vector<float> gaps, spreads, router_gaps;
  std::vector<llama_token> top2s;
  // The 8 best ids and their logits at each step: a near tie may involve more than two tokens.
  std::string topk_json = "[";
  std::string text;
  const char* stopped = "length";
  std::vector<llama_token> feed = prompt;
  for (int step = 0; step < o.n; ++step) {
    router.step_min = 1e30f;
    if (llama_decode(ctx, llama_batch_get_one(feed.data(), static_cast<int32_t>(feed.size()))) != 0) {
      std::fprintf(stderr, "llama_ref: llama_decode failed at step %d\n", step);
      return 1;
    }
    const float* logits = llama_get_logits_ith(ctx, -1);
    // Greedy with the lowest id winning ties, the same rule as tandem's sampler.
    int best = 0, second = -1;
    float lo = logits[0];
    for (int i = 1; i < n_vocab; ++i) {
      lo = logits[i] < lo ? logits[i] : lo;
      if (logits[i] > logits[best]) {
        second = best;
        best = i;
      } else if (second < 0 || logits[i] > logits[second]) {
        second = i;
      }
    }
    if (second < 0) second = best;  // a one-token vocabulary has no runner-up
    if (router.k > 0) router_gaps.push_back(router.step_min);
    tokens.push_back(best);
    top2s.push_back(second);
    gaps.push_back(logits[best] - logits[second]);
    spreads.push_back(logits[best] - lo);
    {
      std::vector<int> ids(static_cast<size_t>(n_vocab));
      for (int i = 0; i < n_vocab; ++i) ids[static_cast<size_t>(i)] = i;
      const int k = n_vocab < 8 ? n_vocab : 8;
      std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int a, int b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
      });
      if (step > 0) topk_json += ",";
      topk_json += "[";
      for (int j = 0; j < k; ++j) {
        char buf[64];
        std::snprintf(buf, sizeof buf, "%s[%d,%.9g]", j ? "," : "", ids[static_cast<size_t>(j)],
                      static_cast<double>(logits[ids[static_cast<size_t>(j)]]));
        topk_json += buf;
      }
      topk_json += "]";
    }
    char piece[256];
    const int len = llama_token_to_piece(vocab, best, piece, sizeof piece, 0, false);
    if (len > 0) text.append(piece, static_cast<size_t>(len));
    if (!o.ignore_eos && llama_vocab_is_eog(vocab, best)) {
      stopped = "eog";
      break;
    }
    feed.assign(1, best);
  }

  std::printf(
      "{\"prompt_tokens\":%s,\"tokens\":%s,\"gaps\":%s,\"top2\":%s,\"spreads\":%s,"
      "\"topk\":%s,\"router_gaps\":%s,\"stopped\":\"%s\",\"n_vocab\":%d,\"text\":%s}\n",
      JsonArray(prompt).c_str(), JsonArray(tokens).c_str(), JsonArray(gaps).c_str(),
      JsonArray(top2s).c_str(), JsonArray(spreads).c_str(), (topk_json + "]").c_str(),
      JsonArray(router_gaps).c_str(), stopped,
      n_vocab,
      JsonString(text).c_str());

  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
