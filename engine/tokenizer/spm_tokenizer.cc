// SentencePiece-style BPE as llama.cpp runs it ("llama" vocabularies): spaces become U+2581,
// the text is split into UTF-8 characters, and the adjacent pair whose concatenation is the
// highest-scoring token is merged until no pair is a token. Leftover characters that are not
// tokens fall back to <0xNN> byte tokens.
#include <algorithm>
#include <queue>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/util/status_util.h"
#include "engine/tokenizer/tokenizer_impl.h"
#include "engine/tokenizer/unicode.h"

namespace tandem::engine::internal {
namespace {

struct Symbol {
  int prev;
  int next;
  uint32_t start;
  uint32_t n;  // 0 once merged into its left neighbour
};

struct Bigram {
  float score;
  int left;
  int right;
  uint32_t size;
};

// Pops the highest score first; among equal scores the leftmost pair.
struct BigramOrder {
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  }
};

}  // namespace

absl::Status SpmTokenizer::Load(const gguf::GgufFile& file) {
  is_spm_ = true;
  VocabDefaults d;
  d.bos = 1;
  d.eos = 2;
  d.unk = 0;
  d.add_space_prefix = true;
  d.clean_spaces = false;
  d.add_bos = true;
  d.add_eos = false;
  TANDEM_RETURN_IF_ERROR(LoadVocab(file, d));
  for (int b = 0; b < 256; ++b) {
    int32_t id = Find(absl::StrFormat("<0x%02X>", b));
    if (id < 0) id = Find(std::string(1, static_cast<char>(b)));
    // llama.cpp aborts when a byte has no token at all; the unknown token is the safe reading.
    byte_tokens_[b] = id >= 0 ? id : unk_id_;
  }
  return absl::OkStatus();
}

std::string SpmTokenizer::ComputePiece(int32_t id) const {
  const uint16_t f = flags_[id];
  if (f & (kAttrUnknown | kAttrControl | kAttrUserDefined)) return pieces_[id];
  if (f & kAttrNormal) return UnescapeSpaces(pieces_[id]);
  if (f & kAttrByte) return std::string(1, static_cast<char>(ByteOfToken(id)));
  return {};  // unused / undefined tokens render as nothing
}

std::vector<int32_t> SpmTokenizer::Encode(std::string_view text, bool add_special,
                                          bool parse_special) const {
  std::vector<int32_t> out;
  std::vector<Fragment> frags;
  Partition(text, parse_special, &frags);
  bool prev_special = true;  // the first text gets the space prefix
  if (add_special && add_bos_) out.push_back(bos_id_);
  std::string escaped;
  for (const Fragment& frag : frags) {
    if (frag.token >= 0) {
      out.push_back(frag.token);
      prev_special = true;
      continue;
    }
    escaped.clear();
    if (add_space_prefix_ && prev_special) escaped = kSpaceMarker;
    AppendEscapedSpaces(text.substr(frag.offset, frag.length), &escaped);
    EncodeText(escaped, &out);
    prev_special = false;
  }
  if (add_special && add_eos_) out.push_back(eos_id_);
  return out;
}

void SpmTokenizer::EncodeText(std::string_view text, std::vector<int32_t>* out) const {
  if (text.empty()) return;
  std::vector<Symbol> symbols;
  symbols.reserve(text.size());
  for (size_t off = 0; off < text.size();) {
    const size_t len =
        std::min(unicode::Utf8LeadLength(static_cast<uint8_t>(text[off])), text.size() - off);
    const int index = static_cast<int>(symbols.size());
    symbols.push_back(Symbol{index - 1, off + len == text.size() ? -1 : index + 1,
                             static_cast<uint32_t>(off), static_cast<uint32_t>(len)});
    off += len;
  }

  std::vector<Bigram> storage;
  storage.reserve(symbols.size() * 2);
  std::priority_queue<Bigram, std::vector<Bigram>, BigramOrder> queue(BigramOrder{},
                                                                      std::move(storage));
  auto try_add = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    // Adjacent symbols are contiguous in the text, so the pair is a plain substring.
    const uint32_t size = symbols[left].n + symbols[right].n;
    const int32_t id = Find(text.substr(symbols[left].start, size));
    if (id < 0) return;
    queue.push(Bigram{scores_[id], left, right, size});
  };
  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) try_add(i - 1, i);

  while (!queue.empty()) {
    const Bigram bg = queue.top();
    queue.pop();
    Symbol& l = symbols[bg.left];
    Symbol& r = symbols[bg.right];
    // Stale: one side was merged away or grew since the pair was queued.
    if (l.n == 0 || r.n == 0 || l.n + r.n != bg.size) continue;
    l.n += r.n;
    r.n = 0;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = bg.left;
    try_add(l.prev, bg.left);
    try_add(bg.left, l.next);
  }

  // A final symbol is either a merged token or a single character. (llama.cpp also consults a
  // map of merge history here, which can only apply to multi-character symbols, i.e. tokens.)
  for (int i = 0; i != -1; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    const std::string_view piece = text.substr(s.start, s.n);
    const int32_t id = Find(piece);
    if (id >= 0) {
      out->push_back(id);
      continue;
    }
    for (const char c : piece) {
      const int32_t b = byte_tokens_[static_cast<uint8_t>(c)];
      if (b >= 0) out->push_back(b);
    }
  }
}

}  // namespace tandem::engine::internal
