// libFuzzer target: Encode and Decode of arbitrary bytes with real vocabularies (llama.cpp's
// llama-spm SentencePiece and llama-bpe byte-level BPE test vocabularies). The first input
// byte picks the vocabulary and the flags; the rest is the text, and also read as token ids.
// Checks, beyond "no crash": every id Encode returns is inside the vocabulary, and the streaming
// decoder's output is valid UTF-8 whatever ids it is fed.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/gguf/gguf.h"
#include "engine/tokenizer/tokenizer.h"

namespace {

std::unique_ptr<tandem::engine::Tokenizer> Load(const char* name) {
  const std::string path = std::string(TANDEM_VOCAB_DIR) + "/" + name;
  auto file = tandem::gguf::GgufFile::Open(path);
  if (!file.ok()) {
    std::fprintf(stderr, "tokenizer_fuzz: %s: %s (run scripts/fetch_vocab.sh)\n", path.c_str(),
                 file.status().ToString().c_str());
    std::abort();
  }
  auto tok = tandem::engine::Tokenizer::FromGguf(**file);
  if (!tok.ok()) {
    std::fprintf(stderr, "tokenizer_fuzz: %s: %s\n", path.c_str(), tok.status().ToString().c_str());
    std::abort();
  }
  return std::move(*tok);
}

const std::vector<std::unique_ptr<tandem::engine::Tokenizer>>& Tokenizers() {
  static auto* toks = [] {
    auto* v = new std::vector<std::unique_ptr<tandem::engine::Tokenizer>>();
    v->push_back(Load("ggml-vocab-llama-spm.gguf"));
    v->push_back(Load("ggml-vocab-llama-bpe.gguf"));
    return v;
  }();
  return *toks;
}

bool ValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<uint8_t>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

}  // namespace

// Loading the vocabularies takes seconds under ASan: done before the first input, so it does
// not count against libFuzzer's per-input timeout.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)Tokenizers();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || size > 4096) return 0;  // long inputs only slow the search down
  const uint8_t mode = data[0];
  const auto& toks = Tokenizers();
  const tandem::engine::Tokenizer& tok = *toks[mode % toks.size()];
  const bool add_special = mode & 2, parse_special = mode & 4, special = mode & 8;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const int32_t vocab = tok.vocab_size();

  std::vector<int32_t> ids = tok.Encode(text, add_special, parse_special);
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab) std::abort();
  }
  (void)tok.Decode(ids, special);

  // The same bytes as raw ids (out-of-range ones included: Decode must tolerate them).
  std::vector<int32_t> raw;
  for (size_t i = 1; i + 1 < size; i += 2) {
    int32_t id = static_cast<int32_t>(data[i] | (data[i + 1] << 8));
    if (mode & 16) id %= vocab;  // mostly in range, to reach the byte-token paths
    if (mode & 32) id = -id;
    raw.push_back(id);
  }
  (void)tok.Decode(raw, special);
  tandem::engine::StreamingDecoder stream(tok, special, mode & 64);
  std::string out;
  for (int32_t id : raw) {
    if (id < 0 || id >= vocab) continue;  // the decoder's callers pass sampled, in-range ids
    out += stream.Push(id);
  }
  out += stream.Flush();
  if (!ValidUtf8(out)) std::abort();
  for (int32_t id : raw) (void)tok.TokenToPiece(id, special);
  return 0;
}
