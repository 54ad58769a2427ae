// Byte-level BPE as llama.cpp runs it ("gpt2" vocabularies): the pre-tokenizer splits the text
// into words, each word's UTF-8 bytes are spelled in GPT-2's byte alphabet, and inside a word
// the adjacent pair with the lowest merge rank is merged until no pair has a rank.
#include <algorithm>
#include <queue>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/util/status_util.h"
#include "engine/tokenizer/tokenizer_impl.h"
#include "engine/tokenizer/unicode.h"

namespace tandem::engine::internal {
namespace {

constexpr char kKeyMerges[] = "tokenizer.ggml.merges";

struct Symbol {
  uint32_t start;
  uint32_t n;  // 0 once merged into its left neighbour
  int prev;
  int next;
};

struct Bigram {
  int32_t rank;
  int left;
  int right;
  uint32_t size;
};

// Pops the lowest rank first; among equal ranks the leftmost pair.
struct BigramOrder {
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  }
};

}  // namespace

absl::Status BpeTokenizer::Load(const gguf::GgufFile& file) {
  is_spm_ = false;
  if (file.Find(kKeyMerges) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte-level BPE tokenizer without ", kKeyMerges));
  }
  TANDEM_ASSIGN_OR_RETURN(std::span<const std::string_view> merges,
                          file.GetStringArray(kKeyMerges));
  // Each merge is "left right", split at the first space after position 0. Lines without such
  // a space can never match a pair of non-empty symbols and are left out of the set.
  if (merges.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(kKeyMerges, " is too large"));
  }
  size_t bytes = 0;
  for (std::string_view m : merges) bytes += m.size();
  if (bytes > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(kKeyMerges, " is too large"));
  }
  MergeTable& table = *merges_;
  table.arena.reserve(bytes);
  table.refs.reserve(merges.size());
  for (std::string_view m : merges) {
    const size_t sp = m.find(' ', 1);
    const uint32_t start = static_cast<uint32_t>(table.arena.size());
    if (sp == std::string_view::npos) {
      table.refs.push_back({start, 0, 0});
      continue;
    }
    table.arena.append(m);
    table.refs.push_back(
        {start, static_cast<uint32_t>(sp), static_cast<uint32_t>(m.size() - sp - 1)});
  }
  ranks_ = absl::flat_hash_set<uint32_t, MergeHash, MergeEq>(merges.size(), MergeHash{&table},
                                                             MergeEq{&table});
  for (size_t i = 0; i < merges.size(); ++i) {
    if (table.refs[i].left_len == 0) continue;
    ranks_.insert(static_cast<uint32_t>(i));  // the first occurrence of a pair keeps its rank
  }

  VocabDefaults d;
  d.bos = pre_.spm_style ? -1 : 11;  // gemma4 names its ids; gpt2 vocabularies default to 11
  d.eos = pre_.spm_style ? -1 : 11;
  d.unk = -1;
  d.add_space_prefix = false;
  d.clean_spaces = pre_.clean_spaces;
  d.add_bos = pre_.add_bos;
  d.add_eos = false;
  d.force_add_bos = pre_.force_add_bos;
  return LoadVocab(file, d);
}

std::string BpeTokenizer::ComputePiece(int32_t id) const {
  const uint16_t f = flags_[id];
  const std::string& text = pieces_[id];
  if (f & (kAttrUnknown | kAttrControl | kAttrUserDefined)) return text;
  if ((f & kAttrNormal) && pre_.spm_style) return UnescapeSpaces(text);
  if (f & kAttrNormal) {
    // Undo the byte alphabet. A code point outside it is spelled out the way llama.cpp's
    // llama_decode_text does.
    std::vector<uint32_t> cps;
    unicode::DecodeUtf8Lenient(text, &cps);
    std::string out;
    for (const uint32_t cp : cps) {
      const int b = unicode::Gpt2CodepointToByte(cp);
      if (b >= 0) {
        out.push_back(static_cast<char>(b));
        continue;
      }
      std::string utf8;
      unicode::AppendUtf8(cp, &utf8);
      out += "[UNK_BYTE_0x";
      for (const char c : utf8) absl::StrAppendFormat(&out, "%02x", static_cast<uint8_t>(c));
      out += text;
      out += "]";
    }
    return out;
  }
  if (f & kAttrByte) return std::string(1, static_cast<char>(ByteOfToken(id)));
  return {};
}

std::vector<int32_t> BpeTokenizer::Encode(std::string_view text, bool add_special,
                                          bool parse_special) const {
  std::vector<int32_t> out;
  std::vector<Fragment> frags;
  Partition(text, parse_special, &frags);
  if (add_special && add_bos_) out.push_back(bos_id_);
  for (const Fragment& frag : frags) {
    if (frag.token >= 0) {
      out.push_back(frag.token);
    } else if (pre_.spm_style) {
      std::string escaped;
      AppendEscapedSpaces(text.substr(frag.offset, frag.length), &escaped);
      EncodeText(escaped, &out);
    } else {
      EncodeText(text.substr(frag.offset, frag.length), &out);
    }
  }
  if (add_special && add_eos_) out.push_back(eos_id_);
  return out;
}

void BpeTokenizer::EncodeText(std::string_view text, std::vector<int32_t>* out) const {
  std::vector<uint32_t> cps;
  unicode::DecodeUtf8Lenient(text, &cps);
  std::vector<uint32_t> lengths;
  PreTokenize(pre_.kind, cps, &lengths);
  std::string word;
  std::string utf8;
  size_t pos = 0;
  for (const uint32_t len : lengths) {
    word.clear();
    for (size_t i = pos; i < pos + len; ++i) {
      if (pre_.spm_style) {
        unicode::AppendUtf8(cps[i], &word);
        continue;
      }
      utf8.clear();
      unicode::AppendUtf8(cps[i], &utf8);
      for (const char c : utf8) word += unicode::ByteToGpt2Utf8(static_cast<uint8_t>(c));
    }
    pos += len;
    EncodeWord(word, out);
  }
}

void BpeTokenizer::EncodeWord(const std::string& word, std::vector<int32_t>* out) const {
  if (word.empty()) return;
  // Whole-word tokens skip merging for some vocabularies, and for Gemma 4 runs of newlines.
  if (pre_.ignore_merges || (pre_.spm_style && word.find_first_not_of('\n') == std::string::npos)) {
    const int32_t id = Find(word);
    if (id >= 0) {
      out->push_back(id);
      return;
    }
  }
  const std::string_view w = word;
  std::vector<Symbol> symbols;
  symbols.reserve(w.size());
  for (size_t off = 0; off < w.size();) {
    const size_t len =
        std::min(unicode::Utf8LeadLength(static_cast<uint8_t>(w[off])), w.size() - off);
    const int index = static_cast<int>(symbols.size());
    symbols.push_back(Symbol{static_cast<uint32_t>(off), static_cast<uint32_t>(len), index - 1,
                             off + len == w.size() ? -1 : index + 1});
    off += len;
  }

  std::vector<Bigram> storage;
  storage.reserve(symbols.size() * 2);
  std::priority_queue<Bigram, std::vector<Bigram>, BigramOrder> queue(BigramOrder{},
                                                                      std::move(storage));
  auto try_add = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const Symbol& l = symbols[left];
    const Symbol& r = symbols[right];
    const int32_t rank = Rank(w.substr(l.start, l.n), w.substr(r.start, r.n));
    if (rank < 0) return;
    queue.push(Bigram{rank, left, right, l.n + r.n});
  };
  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) try_add(i - 1, i);

  while (!queue.empty()) {
    const Bigram bg = queue.top();
    queue.pop();
    Symbol& l = symbols[bg.left];
    Symbol& r = symbols[bg.right];
    // Symbols only grow, so an unchanged total size means the pair's text is unchanged (this
    // is llama.cpp's text comparison without building the strings).
    if (l.n == 0 || r.n == 0 || l.n + r.n != bg.size) continue;
    l.n += r.n;
    r.n = 0;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = bg.left;
    try_add(l.prev, bg.left);
    try_add(bg.left, l.next);
  }

  for (int i = 0; i != -1; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    const std::string_view piece = w.substr(s.start, s.n);
    const int32_t id = Find(piece);
    if (id >= 0) {
      out->push_back(id);
      continue;
    }
    // No token for the merged text: llama.cpp tries each byte on its own (a GPT-2 alphabet
    // byte, or <0xNN> for Gemma 4) and drops the ones that are not tokens either.
    for (const char c : piece) {
      const int32_t b = pre_.spm_style ? Find(absl::StrFormat("<0x%02X>", static_cast<uint8_t>(c)))
                                       : Find(std::string_view(&c, 1));
      if (b >= 0) out->push_back(b);
    }
  }
}

}  // namespace tandem::engine::internal
