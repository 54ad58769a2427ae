// Internal to engine/tokenizer: the concrete tokenizers behind Tokenizer::FromGguf.
//
// VocabTokenizer holds what both families share (the vocabulary, llama.cpp-style attribute
// bits, special-token partitioning, the piece cache); SpmTokenizer and BpeTokenizer add the
// merge algorithms. All are immutable after Load and safe to share between threads: Encode
// keeps its working state on the stack.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/gguf/gguf.h"
#include "engine/tokenizer/pre_tokenizer.h"
#include "engine/tokenizer/tokenizer.h"

namespace tandem::engine::internal {

// Debian's abseil has its own string_view type, which absl::StrCat needs.
inline absl::string_view AbslView(std::string_view s) { return {s.data(), s.size()}; }

// SentencePiece writes spaces as U+2581 LOWER ONE EIGHTH BLOCK.
inline constexpr std::string_view kSpaceMarker = "\xE2\x96\x81";
// Appends `text` to *out with every ' ' written as kSpaceMarker.
void AppendEscapedSpaces(std::string_view text, std::string* out);
// `text` with every kSpaceMarker turned back into ' '.
std::string UnescapeSpaces(std::string_view text);

// llama.cpp's llama_token_attr bits. A token can carry several (a NORMAL token detected as an
// end-of-turn marker becomes NORMAL|CONTROL), which is why the GGUF token type alone is not
// enough to reproduce its behaviour.
enum AttrBit : uint16_t {
  kAttrUnknown = 1 << 0,
  kAttrUnused = 1 << 1,
  kAttrNormal = 1 << 2,
  kAttrControl = 1 << 3,
  kAttrUserDefined = 1 << 4,
  kAttrByte = 1 << 5,
  kAttrLstrip = 1 << 7,
  kAttrRstrip = 1 << 8,
};

// A piece of the input after special-token partitioning: raw text [offset, offset + length)
// or one special token.
struct Fragment {
  int32_t token = -1;  // -1 for raw text
  size_t offset = 0;
  size_t length = 0;
};

// Defaults that depend on the tokenizer family (llama.cpp's per-model defaults).
struct VocabDefaults {
  int32_t bos = -1;
  int32_t eos = -1;
  int32_t unk = -1;
  bool add_space_prefix = false;
  bool clean_spaces = false;
  bool add_bos = false;
  bool add_eos = false;
  bool force_add_bos = false;
};

class VocabTokenizer : public Tokenizer {
 public:
  std::string TokenToPiece(int32_t id, bool special) const final;

  // Reads everything but the family-specific parts (merges).
  absl::Status LoadVocab(const gguf::GgufFile& file, const VocabDefaults& defaults);

 protected:
  // The piece with special=true (control tokens rendered); llama.cpp caches exactly this.
  virtual std::string ComputePiece(int32_t id) const = 0;

  // Token id of `text`, or -1.
  int32_t Find(std::string_view text) const {
    auto it = token_to_id_.find(text);
    return it == token_to_id_.end() ? -1 : it->second;
  }
  // Splits `text` around special tokens as llama.cpp's tokenizer_st_partition does.
  void Partition(std::string_view text, bool parse_special, std::vector<Fragment>* out) const;

  // Byte value of a <0xNN> byte token (llama.cpp parses the two characters after "<0x").
  uint8_t ByteOfToken(int32_t id) const;

  std::vector<uint16_t> flags_;  // AttrBit per token
  std::vector<float> scores_;
  absl::flat_hash_map<std::string_view, int32_t> token_to_id_;  // views into pieces_
  std::vector<int32_t> special_ids_;                            // partitioning order
  std::vector<std::string> piece_cache_;
};

// SentencePiece-style BPE ("llama"): merges the highest-scoring adjacent pair whose
// concatenation is a token, byte-fallback tokens for anything left over.
class SpmTokenizer final : public VocabTokenizer {
 public:
  std::vector<int32_t> Encode(std::string_view text, bool add_special,
                              bool parse_special) const override;
  absl::Status Load(const gguf::GgufFile& file);

 private:
  std::string ComputePiece(int32_t id) const override;
  void EncodeText(std::string_view escaped, std::vector<int32_t>* out) const;

  int32_t byte_tokens_[256] = {};  // -1 where neither <0xNN> nor the raw byte is a token
};

// The merge list as a compact hash set: each entry is a rank (the index of the merge) and the
// hash/equality functors look the two halves up in a shared arena. Ranks are 4 bytes a slot,
// which keeps a 500k-merge vocabulary at a few MB and its load fast.
struct MergeTable {
  struct Ref {
    uint32_t start;  // of the left half in arena; the right half follows one space later
    uint32_t left_len;
    uint32_t right_len;
  };
  using Key = std::pair<std::string_view, std::string_view>;

  std::string arena;
  std::vector<Ref> refs;  // indexed by rank

  Key KeyOf(uint32_t rank) const {
    const Ref& r = refs[rank];
    const std::string_view a = arena;
    return {a.substr(r.start, r.left_len), a.substr(r.start + r.left_len + 1, r.right_len)};
  }
};

struct MergeHash {
  using is_transparent = void;
  const MergeTable* table = nullptr;
  size_t operator()(const MergeTable::Key& k) const { return absl::Hash<MergeTable::Key>()(k); }
  size_t operator()(uint32_t rank) const { return (*this)(table->KeyOf(rank)); }
};

struct MergeEq {
  using is_transparent = void;
  const MergeTable* table = nullptr;
  bool operator()(uint32_t a, uint32_t b) const { return table->KeyOf(a) == table->KeyOf(b); }
  bool operator()(uint32_t a, const MergeTable::Key& b) const { return table->KeyOf(a) == b; }
  bool operator()(const MergeTable::Key& a, uint32_t b) const { return a == table->KeyOf(b); }
};

// Byte-level BPE ("gpt2"): pre-tokenizer, GPT-2 byte alphabet, merges by rank. Also the
// SentencePiece-flavoured BPE of Gemma 4 ("gemma4"), see PreTokenizerInfo::spm_style.
class BpeTokenizer final : public VocabTokenizer {
 public:
  explicit BpeTokenizer(const PreTokenizerInfo& pre) : pre_(pre) {}
  std::vector<int32_t> Encode(std::string_view text, bool add_special,
                              bool parse_special) const override;
  absl::Status Load(const gguf::GgufFile& file);

 private:
  std::string ComputePiece(int32_t id) const override;
  void EncodeText(std::string_view text, std::vector<int32_t>* out) const;
  void EncodeWord(const std::string& word, std::vector<int32_t>* out) const;
  int32_t Rank(std::string_view left, std::string_view right) const {
    auto it = ranks_.find(MergeTable::Key(left, right));
    return it == ranks_.end() ? -1 : static_cast<int32_t>(*it);
  }

  PreTokenizerInfo pre_;
  std::unique_ptr<MergeTable> merges_ = std::make_unique<MergeTable>();  // stable address
  absl::flat_hash_set<uint32_t, MergeHash, MergeEq> ranks_;
};

}  // namespace tandem::engine::internal
