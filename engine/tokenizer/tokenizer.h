// Tokenizers read from GGUF metadata (tokenizer.ggml.*).
//
// Two families: SentencePiece-style BPE ("llama": scores, byte fallback <0xNN>, ▁ for spaces)
// and byte-level BPE ("gpt2": merges, GPT-2 byte-to-unicode map, a pre-tokenizer regex chosen by
// tokenizer.ggml.pre: default/gpt-2, llama-bpe/llama3, qwen2, qwen35, starcoder, falcon,
// deepseek-llm, deepseek-coder and their aliases, see pre_tokenizer.h), plus Gemma 4's
// SentencePiece-flavoured BPE ("gemma4"). Results match llama.cpp's
// llama_tokenize / llama_token_to_piece / llama_detokenize, including its special-token rules
// (parse_special partitioning, lstrip/rstrip, control tokens detected by their text).
//
// Threading: a Tokenizer is immutable after creation and safe to use from many threads; it
// copies what it needs, so the GgufFile may be closed afterwards. A StreamingDecoder belongs to
// one sequence and one thread.
// Errors: only FromGguf fails; encoding and decoding accept any bytes and ids (invalid UTF-8
// is handled as llama.cpp does, unknown ids decode to nothing).
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

// The token's type as llama.cpp ends up treating it: the GGUF token_type, except that tokens
// llama.cpp recognises by their text as end-of-turn/FIM markers become kControl.
enum class TokenAttr : uint8_t {
  kUndefined = 0,
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
  // with add_space_prefix (SentencePiece models) one leading space of the FIRST id's piece is
  // removed, whatever that id is. So Decode({bos, "▁Hello"}) is " Hello" (the BOS consumes the
  // strip, exactly as in llama.cpp), while Decode({"▁Hello"}) is "Hello". Byte-level BPE models
  // with clean_spaces (most, see pre_tokenizer.h) also get llama.cpp's clean-up of " ." " ,"
  // " 's" and similar.
  std::string Decode(std::span<const int32_t> ids, bool special) const;

  int32_t vocab_size() const { return static_cast<int32_t>(pieces_.size()); }
  int32_t bos_id() const { return bos_id_; }  // -1 when none
  int32_t eos_id() const { return eos_id_; }  // -1 when none
  int32_t eot_id() const { return eot_id_; }  // -1 when none
  int32_t unk_id() const { return unk_id_; }  // -1 when none
  int32_t pad_id() const { return pad_id_; }  // -1 when none
  bool add_space_prefix() const { return add_space_prefix_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  // End-of-generation: eos, eot, eom and similar tokens.
  bool IsEog(int32_t id) const;
  const std::vector<int32_t>& eog_ids() const { return eog_ids_; }    // sorted
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
  int32_t eot_id_ = -1;
  int32_t unk_id_ = -1;
  int32_t pad_id_ = -1;
  bool add_bos_ = false;
  bool add_eos_ = false;
  bool is_spm_ = false;
  bool add_space_prefix_ = false;
  bool clean_spaces_ = false;
};

// Turns a stream of token ids into text without ever emitting a broken UTF-8 sequence: bytes
// of an incomplete character are held until the character completes; bytes that can never
// form a character become U+FFFD as soon as that is certain (an incomplete tail only at Flush).
// Every returned chunk is valid UTF-8.
//
// Leading space (models with add_space_prefix, i.e. SentencePiece): one leading space is
// removed from the piece of the first token of the stream (as Decode does) and from the piece
// of the token right after a BOS (as llama2.c's run.c prints). Pass continuation=true when the
// stream continues text that is already shown (e.g. a completion after its prompt): then the
// first token keeps its space. Unlike Decode, no clean_spaces clean-up is applied (it would need
// look-ahead); for streams without BOS on SentencePiece models the concatenated output equals
// Decode(ids) whenever Decode's bytes are valid UTF-8.
//
// The Tokenizer must outlive the decoder. Not thread-safe (one per sequence).
class StreamingDecoder {
 public:
  StreamingDecoder(const Tokenizer& tok, bool special, bool continuation = false)
      : tok_(tok), special_(special), first_(!continuation) {}
  // Appends a token; returns the text that became complete (possibly empty).
  std::string Push(int32_t id);
  // Returns what is left at the end of the stream; invalid leftovers become U+FFFD. The decoder
  // can be reused afterwards as if continuing the same text.
  std::string Flush();

 private:
  const Tokenizer& tok_;
  bool special_;
  bool first_ = true;
  bool after_bos_ = false;
  std::string pending_;
};

}  // namespace tandem::engine
