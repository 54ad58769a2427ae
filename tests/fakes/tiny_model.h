// Writes a tiny random GGUF with a SentencePiece byte-fallback vocabulary, so engine tests run
// without any downloaded model. Weights are deterministic for a seed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tandem/kernels/dtype.h"

namespace tandem::testing {

struct TinyModelOptions {
  // llama, qwen2 (biases, neox rope), qwen3 (q/k norms), qwen2moe (experts, a shared expert,
  // biases), qwen3moe (experts, q/k norms), mixtral (written as llama with experts), or
  // gpt-oss (experts with biases, sinks, a sliding window of 6, YaRN over a context of 64).
  std::string arch = "llama";
  int32_t n_embd = 64;
  int32_t n_layer = 2;
  int32_t n_head = 4;
  int32_t n_head_kv = 2;
  int32_t n_ff = 128;
  // Experts of the MoE archs (their n_ff is the expert width; qwen2moe's shared expert is
  // 2 * n_ff wide).
  int32_t n_expert = 8;
  int32_t n_expert_used = 3;
  int32_t n_ctx = 256;
  kernels::DType type = kernels::DType::kF32;  // type of the 2-D weight matrices
  bool tied_output = false;
  uint64_t seed = 1;
};

// Vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then a few words.
absl::Status WriteTinyModel(const TinyModelOptions& o, const std::string& path);

// n deterministic token ids in [3, vocab) (past <unk>, <s> and </s>) for a seed: test prompts.
std::vector<int32_t> RandomTokens(int n, int32_t vocab, uint32_t seed);

}  // namespace tandem::testing
