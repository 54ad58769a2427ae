// Tokenizers read from GGUF metadata (tokenizer.ggml.*).
//
// Two families: SentencePiece-style BPE ("llama": scores, byte fallback <0xNN>, ▁ for spaces)
// and byte-level BPE ("gpt2": merges, GPT-2 byte-to-unicode map, a pre-tokenizer regex chosen by
// tokenizer.ggml.pre: default/gpt2, llama-bpe/llama3, qwen2, ...). Results match llama.cpp's
// llama_tokenize / llama_token_to_piece on its vocab test vectors.
//
// A Tokenizer is immutable after creation and safe to use from many threads.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/gguf/gguf.h"

namespace tandem::engine {

enum class TokenAttr : uint8_t {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

class Tokenizer {
 public:
  // INVALID_ARGUMENT for missing or inconsistent tokenizer metadata; UNIMPLEMENTED for a
  // tokenizer model or pre-tokenizer tandem does not know.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const gguf::GgufFile& file);
  virtual ~Tokenizer() = default;

  // Text to ids. add_special: add BOS/EOS as the model's add_bos_token/add_eos_token flags say
  // (llama.cpp's add_special). parse_special: text matching a control or user-defined token
  // ("<s>", "<|im_start|>") becomes that token instead of being split as text.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_special,
                                      bool parse_special) const = 0;

  // The bytes of one token as llama.cpp's llama_token_to_piece(..., lstrip=0, special) gives
  // them: ▁ becomes a space, byte tokens become their byte, control tokens render only when
  // `special` is true. Out-of-range ids give an empty string.
  virtual std::string TokenToPiece(int32_t id, bool special) const = 0;

  // Ids to text, as llama.cpp's llama_detokenize(remove_special=false, unparse_special=special):
  // for SentencePiece models the leading space of the first piece after BOS is removed.
  std::string Decode(std::span<const int32_t> ids, bool special) const;

  int32_t vocab_size() const { return static_cast<int32_t>(pieces_.size()); }
  int32_t bos_id() const { return bos_id_; }  // -1 when none
  int32_t eos_id() const { return eos_id_; }  // -1 when none
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  // End-of-generation: eos, eot, eom and similar tokens.
  bool IsEog(int32_t id) const;
  const std::string& piece(int32_t id) const { return pieces_[id]; }  // raw vocab string
  TokenAttr attr(int32_t id) const { return attrs_[id]; }
  bool IsSentencePiece() const { return is_spm_; }

 protected:
  Tokenizer() = default;
  std::vector<std::string> pieces_;
  std::vector<TokenAttr> attrs_;
  std::vector<int32_t> eog_ids_;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  bool add_bos_ = false;
  bool add_eos_ = false;
  bool is_spm_ = false;
};

// Turns a stream of token ids into text without ever emitting a broken UTF-8 sequence: bytes
// of an incomplete character are held until the character completes. Not thread-safe (one per
// sequence).
class StreamingDecoder {
 public:
  StreamingDecoder(const Tokenizer& tok, bool special) : tok_(tok), special_(special) {}
  // Appends a token; returns the text that became complete (possibly empty).
  std::string Push(int32_t id);
  // Returns what is left at the end of the stream; invalid leftovers become U+FFFD.
  std::string Flush();

 private:
  const Tokenizer& tok_;
  bool special_;
  bool first_ = true;
  bool after_bos_ = false;
  std::string pending_;
};

}  // namespace tandem::engine
