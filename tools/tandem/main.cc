// The `tandem` command line: model tools and single-node generation. This is the only file of
// the CLI that reads flags; everything else takes option structs.
#include <cstdio>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tools/tandem/generate.h"
#include "tools/tandem/model_tools.h"

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
  g->add_option("--kv-type", gen_kv_type, "KV cache type: f32 or f16");
  g->add_flag("--json", gen.json, "Print token ids, text and timings as JSON");
  g->callback([&] {
    auto t = ParseType(gen_kv_type);
    if (!t.ok()) {
      rc = Report(t.status());
      return;
    }
    gen.kv_type = *t;
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

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return rc;
}
