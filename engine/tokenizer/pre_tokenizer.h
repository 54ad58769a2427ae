// Pre-tokenizers of the byte-level BPE tokenizers: they split text into words before BPE
// merges run inside each word. Each kind reproduces the sequence of split regexes llama.cpp
// uses for a tokenizer.ggml.pre value, implemented by hand over code points and Unicode
// categories (no regex engine): every regex of the sequence re-splits every current piece, the
// matches and the gaps between them both becoming pieces.
//
// Pure functions, thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace tandem::engine {

enum class PreTokenizerKind {
  kDefault,        // "default" / missing: GPT-2 regex plus punctuation/number/digit splits
  kGpt2,           // "gpt-2", "mpt", "olmo", ...
  kLlama3,         // "llama-bpe", "llama3", "dbrx", "smaug-bpe", ...: digits in groups of 3
  kQwen2,          // "qwen2", "stablelm2", ...: single digits
  kQwen35,         // "qwen35": like qwen2 with combining marks kept in letter runs
  kStarcoder,      // "starcoder", "refact", "command-r", "smollm", ...: single digits + GPT-2
  kFalcon,         // "falcon"
  kDeepseekLlm,    // "deepseek-llm"
  kDeepseekCoder,  // "deepseek-coder"
  kLaguna,         // "laguna": split at newline runs, then qwen2
  kNewlines,       // Gemma 4 (tokenizer model "gemma4"): split at newline runs only
};

// Tokenizer-level settings llama.cpp ties to a pre-tokenizer name.
struct PreTokenizerInfo {
  PreTokenizerKind kind = PreTokenizerKind::kDefault;
  bool clean_spaces = true;    // detokenize removes spaces before punctuation etc.
  bool ignore_merges = false;  // a word that is a whole token skips BPE merges
  bool add_bos = false;        // default of add_bos_token when the file does not say
  bool force_add_bos = false;  // add BOS even when the file says not to (Gemma 4)
  // SentencePiece-flavoured BPE (Gemma 4): spaces are written as U+2581 and words stay raw
  // UTF-8 with <0xNN> byte fallback, instead of GPT-2's byte alphabet.
  bool spm_style = false;
};

// nullopt for a name tandem does not implement. The empty name means "default".
std::optional<PreTokenizerInfo> LookupPreTokenizer(std::string_view name);
// The fixed settings of tokenizer model "gemma4" (whose pre-tokenizer name is implied).
PreTokenizerInfo Gemma4PreTokenizer();

// Splits `cps` into words and appends their lengths, in code points, to *lengths (the lengths
// sum to cps.size(); no length is 0).
void PreTokenize(PreTokenizerKind kind, std::span<const uint32_t> cps,
                 std::vector<uint32_t>* lengths);

}  // namespace tandem::engine
