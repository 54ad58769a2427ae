#include "engine/tokenizer/pre_tokenizer.h"

#include <algorithm>
#include <array>
#include <string>

#include "engine/tokenizer/unicode.h"

namespace tandem::engine {
namespace {

using unicode::Category;
using unicode::FlagsOf;

constexpr uint32_t kOutOfRange = 0xFFFFFFFF;

// Code point properties with "outside the piece being split" as a distinct state: llama.cpp's
// hand-written splitters see nothing beyond the current piece, and some of their branches test
// for that explicitly.
struct Props {
  uint16_t v = 0;  // 0: out of range; otherwise 0x100 | CpFlags bits
  bool in_range() const { return v != 0; }
  Category cat() const { return static_cast<Category>(v & 7); }
  bool ws() const { return (v & 8) != 0; }
  bool letter() const { return in_range() && cat() == Category::kLetter; }
  bool number() const { return in_range() && cat() == Category::kNumber; }
  bool mark() const { return in_range() && cat() == Category::kMark; }
};

// One piece [b, e) of the code point array being split.
struct Piece {
  const uint32_t* cps;
  size_t b;
  size_t e;
  uint32_t cp(size_t p) const { return p < e ? cps[p] : kOutOfRange; }
  Props props(size_t p) const {
    return p < e ? Props{static_cast<uint16_t>(0x100 | FlagsOf(cps[p]).bits)} : Props{};
  }
};

bool IsWs(uint32_t cp) { return FlagsOf(cp).is_whitespace(); }

// Appends consecutive piece lengths; zero lengths are dropped (as llama.cpp's _add_token does).
class Emitter {
 public:
  Emitter(size_t start, std::vector<uint32_t>* out) : pos_(start), out_(out) {}
  void To(size_t end) {
    if (end > pos_) out_->push_back(static_cast<uint32_t>(end - pos_));
    pos_ = end;
  }
  size_t pos() const { return pos_; }

 private:
  size_t pos_;
  std::vector<uint32_t>* out_;
};

uint32_t AsciiLower(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

// Length of a contraction ('s 't 'm 'd 're 've 'll) starting at pos, or 0. The llama3 family
// matches case-insensitively; only ASCII capitals lower-case to these letters.
size_t Contraction(const Piece& s, size_t pos, bool ignore_case) {
  if (s.cp(pos) != '\'' || pos + 1 >= s.e) return 0;
  auto lower = [&](uint32_t c) { return ignore_case ? AsciiLower(c) : c; };
  const uint32_t n1 = lower(s.cp(pos + 1));
  if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') return 2;
  if (pos + 2 >= s.e) return 0;
  const uint32_t n2 = lower(s.cp(pos + 2));
  if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) return 3;
  return 0;
}

// GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// Mirrors llama.cpp's hand-written matcher branch for branch.
void SplitGpt2(const Piece& s, std::vector<uint32_t>* out) {
  Emitter emit(s.b, out);
  while (emit.pos() < s.e) {
    const size_t pos = emit.pos();
    const uint32_t c = s.cp(pos);
    if (const size_t n = Contraction(s, pos, /*ignore_case=*/false)) {
      emit.To(pos + n);
      continue;
    }
    const Props f2 = c == ' ' ? s.props(pos + 1) : s.props(pos);
    const size_t start = pos + (c == ' ' ? 1 : 0);
    if (f2.letter()) {
      size_t q = start;
      while (s.props(q).letter()) ++q;
      emit.To(q);
      continue;
    }
    if (f2.number()) {
      size_t q = start;
      while (s.props(q).number()) ++q;
      emit.To(q);
      continue;
    }
    auto other = [](Props p) { return !(p.ws() || p.letter() || p.number()) && p.in_range(); };
    if (other(f2)) {
      size_t q = start;
      while (other(s.props(q))) ++q;
      emit.To(q);
      continue;
    }
    size_t n_ws = 0;
    while (s.props(pos + n_ws).ws()) ++n_ws;
    if (n_ws > 1 && s.cp(pos + n_ws) != kOutOfRange) {
      emit.To(pos + n_ws - 1);  // \s+(?!\S): leave the last space to prefix the next word
    } else if (n_ws > 0) {
      emit.To(pos + n_ws);
    } else {
      emit.To(pos + 1);
    }
  }
}

// The llama3 family:
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// with D = 3 (llama3) or 1 (qwen2); `marks` puts \p{M} next to \p{L} (qwen35). Mirrors
// llama.cpp's hand-written matchers.
void SplitLlama3Family(const Piece& s, size_t max_digits, bool marks, std::vector<uint32_t>* out) {
  auto word_char = [marks](Props p) { return p.letter() || (marks && p.mark()); };
  auto other = [marks](Props p) {
    return !(p.ws() || p.letter() || p.number() || (marks && p.mark()));
  };
  Emitter emit(s.b, out);
  while (emit.pos() < s.e) {
    const size_t pos = emit.pos();
    const uint32_t c = s.cp(pos);
    const Props f = s.props(pos);
    if (const size_t n = Contraction(s, pos, /*ignore_case=*/true)) {
      emit.To(pos + n);
      continue;
    }
    if (!(c == '\r' || c == '\n' || f.number())) {
      if (word_char(f) || word_char(s.props(pos + 1))) {
        size_t q = pos + 1;
        while (word_char(s.props(q))) ++q;
        emit.To(q);
        continue;
      }
    }
    if (f.number()) {
      if (max_digits == 1) {
        emit.To(pos + 1);
      } else {
        size_t q = pos;
        size_t ini = pos;
        while (s.props(q).number()) {
          if (++q - ini >= max_digits) {
            emit.To(q);
            ini = q;
          }
        }
        emit.To(q);
      }
      continue;
    }
    const Props f2 = c == ' ' ? s.props(pos + 1) : f;
    if (other(f2) && f.in_range()) {
      size_t q = pos + (c == ' ' ? 1 : 0);
      while (other(s.props(q)) && s.props(q).in_range()) ++q;
      while (s.cp(q) == '\r' || s.cp(q) == '\n') ++q;
      emit.To(q);
      continue;
    }
    size_t n_ws = 0;
    size_t last_newline_end = 0;
    while (s.props(pos + n_ws).ws()) {
      const uint32_t c2 = s.cp(pos + n_ws);
      if (c2 == '\r' || c2 == '\n') last_newline_end = pos + n_ws + 1;
      ++n_ws;
    }
    if (last_newline_end > 0) {
      emit.To(last_newline_end);  // \s*[\r\n]+
    } else if (n_ws > 1 && s.cp(pos + n_ws) != kOutOfRange) {
      emit.To(pos + n_ws - 1);  // \s+(?!\S)
    } else if (n_ws > 0) {
      emit.To(pos + n_ws);
    } else {
      emit.To(pos + 1);
    }
  }
}

// Regex-iterator semantics for one pattern that never matches empty: leftmost matches found by
// `match(pos)` (its length at pos, 0 for none) become pieces, and so do the gaps between them.
template <typename Match>
void SplitMatches(const Piece& s, Match match, std::vector<uint32_t>* out) {
  size_t gap = s.b;
  size_t pos = s.b;
  while (pos < s.e) {
    const size_t n = match(pos);
    if (n == 0) {
      ++pos;
      continue;
    }
    if (pos > gap) out->push_back(static_cast<uint32_t>(pos - gap));
    out->push_back(static_cast<uint32_t>(n));
    pos += n;
    gap = pos;
  }
  if (s.e > gap) out->push_back(static_cast<uint32_t>(s.e - gap));
}

// [class]+ (max_len 0) or [class] (max_len 1).
template <typename Pred>
void SplitClassRuns(const Piece& s, Pred pred, size_t max_len, std::vector<uint32_t>* out) {
  SplitMatches(
      s,
      [&](size_t pos) {
        size_t q = pos;
        while (q < s.e && pred(s.cps[q]) && (max_len == 0 || q - pos < max_len)) ++q;
        return q - pos;
      },
      out);
}

// \s?[class]+
template <typename Pred>
void SplitOptSpaceRuns(const Piece& s, Pred pred, std::vector<uint32_t>* out) {
  SplitMatches(
      s,
      [&](size_t pos) -> size_t {
        size_t q = pos;
        if (IsWs(s.cps[pos]) && pos + 1 < s.e && pred(s.cps[pos + 1])) q = pos + 1;
        if (!pred(s.cps[q])) return 0;
        while (q < s.e && pred(s.cps[q])) ++q;
        return q - pos;
      },
      out);
}

// [0-9][0-9][0-9]
void SplitAsciiDigitTriples(const Piece& s, std::vector<uint32_t>* out) {
  auto digit = [](uint32_t c) { return c >= '0' && c <= '9'; };
  SplitMatches(
      s,
      [&](size_t pos) -> size_t {
        return pos + 3 <= s.e && digit(s.cps[pos]) && digit(s.cps[pos + 1]) && digit(s.cps[pos + 2])
                   ? 3
                   : 0;
      },
      out);
}

// \s+$ : only the whitespace suffix of the piece can match.
void SplitTrailingSpace(const Piece& s, std::vector<uint32_t>* out) {
  size_t q = s.e;
  while (q > s.b && IsWs(s.cps[q - 1])) --q;
  if (q > s.b) out->push_back(static_cast<uint32_t>(q - s.b));
  if (s.e > q) out->push_back(static_cast<uint32_t>(s.e - q));
}

// [^\n]+|[\n]+
void SplitNewlineRuns(const Piece& s, std::vector<uint32_t>* out) {
  size_t pos = s.b;
  while (pos < s.e) {
    const bool nl = s.cps[pos] == '\n';
    size_t q = pos;
    while (q < s.e && (s.cps[q] == '\n') == nl) ++q;
    out->push_back(static_cast<uint32_t>(q - pos));
    pos = q;
  }
}

struct Range {
  uint32_t lo, hi;
};

template <size_t N>
bool InRanges(uint32_t c, const std::array<Range, N>& ranges) {
  for (const Range& r : ranges) {
    if (c >= r.lo && c <= r.hi) return true;
  }
  return false;
}

// Literal character classes of the DeepSeek pre-tokenizers (from their tokenizer.json).
// llama.cpp matches them with std::wregex after replacing every non-ASCII whitespace code point
// by U+000B, so such code points never belong to a literal class.
constexpr std::array<Range, 87> kDeepseekLetters = {{
    {0x41, 0x5A},       {0x61, 0x7A},       {0xB5, 0xB5},       {0xC0, 0xD6},
    {0xD8, 0xF6},       {0xF8, 0x1BA},      {0x1BC, 0x1BF},     {0x1C4, 0x293},
    {0x295, 0x2AF},     {0x370, 0x373},     {0x376, 0x376},     {0x377, 0x377},
    {0x37B, 0x37D},     {0x37F, 0x37F},     {0x386, 0x386},     {0x388, 0x38A},
    {0x38C, 0x38C},     {0x38E, 0x3A1},     {0x3A3, 0x3F5},     {0x3F7, 0x481},
    {0x48A, 0x52F},     {0x531, 0x556},     {0x10A0, 0x10C5},   {0x13A0, 0x13F5},
    {0x13F8, 0x13FD},   {0x1C90, 0x1CBA},   {0x1CBD, 0x1CBF},   {0x1D00, 0x1D2B},
    {0x1D6B, 0x1D77},   {0x1D79, 0x1D9A},   {0x1E00, 0x1F15},   {0x1F18, 0x1F1D},
    {0x1F20, 0x1F45},   {0x1F48, 0x1F4D},   {0x1F50, 0x1F57},   {0x1F59, 0x1F59},
    {0x1F5B, 0x1F5B},   {0x1F5D, 0x1F5D},   {0x1F5F, 0x1F7D},   {0x1F80, 0x1FB4},
    {0x1FB6, 0x1FBC},   {0x1FBE, 0x1FBE},   {0x1FC2, 0x1FC4},   {0x1FC6, 0x1FCC},
    {0x1FD0, 0x1FD3},   {0x1FD6, 0x1FDB},   {0x1FE0, 0x1FEC},   {0x1FF2, 0x1FF4},
    {0x1FF6, 0x1FFC},   {0x2102, 0x2102},   {0x2107, 0x2107},   {0x210A, 0x2113},
    {0x2115, 0x2115},   {0x2119, 0x211D},   {0x2124, 0x2124},   {0x2126, 0x2126},
    {0x2128, 0x2128},   {0x212A, 0x212D},   {0x212F, 0x2134},   {0x2139, 0x2139},
    {0x213C, 0x213F},   {0x2145, 0x2149},   {0x214E, 0x214E},   {0x2183, 0x2183},
    {0x2184, 0x2184},   {0x2C00, 0x2C7B},   {0x2C7E, 0x2CE4},   {0x2CEB, 0x2CEE},
    {0x2CF2, 0x2CF2},   {0x2CF3, 0x2CF3},   {0xA640, 0xA66D},   {0xA680, 0xA69B},
    {0xA722, 0xA76F},   {0xA771, 0xA787},   {0xA78B, 0xA78E},   {0xAB70, 0xABBF},
    {0xFB00, 0xFB06},   {0xFB13, 0xFB17},   {0xFF21, 0xFF3A},   {0xFF41, 0xFF5A},
    {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB}, {0x10C80, 0x10CB2},
    {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943},
}};
constexpr std::array<Range, 6> kDeepseekPunct = {{
    {0x21, 0x2F},
    {0x3A, 0x7E},
    {0xFF01, 0xFF0F},
    {0xFF1A, 0xFF5E},
    {0x2018, 0x201F},
    {0x3000, 0x3002},
}};
constexpr std::array<Range, 3> kDeepseekCjk = {{
    {0x4E00, 0x9FA5},
    {0x800, 0x4E00},
    {0xAC00, 0xD7FF},
}};

template <size_t N>
bool InLiteralClass(uint32_t c, const std::array<Range, N>& ranges) {
  if (c > 0x7F && IsWs(c)) return false;
  return InRanges(c, ranges);
}

bool IsNumber(uint32_t c) { return FlagsOf(c).is_number(); }
bool IsLetter(uint32_t c) { return FlagsOf(c).is_letter(); }
bool IsPunct(uint32_t c) { return FlagsOf(c).is_punctuation(); }
bool IsCrLf(uint32_t c) { return c == '\r' || c == '\n'; }

// Runs one split step over every current piece.
template <typename Step>
void Apply(std::span<const uint32_t> cps, std::vector<uint32_t>* pieces, Step step) {
  std::vector<uint32_t> out;
  out.reserve(pieces->size() * 2);
  size_t b = 0;
  for (const uint32_t len : *pieces) {
    step(Piece{cps.data(), b, b + len}, &out);
    b += len;
  }
  pieces->swap(out);
}

}  // namespace

std::optional<PreTokenizerInfo> LookupPreTokenizer(std::string_view name) {
  using K = PreTokenizerKind;
  struct Entry {
    std::string_view name;
    PreTokenizerInfo info;
  };
  // clean_spaces / ignore_merges / add_bos follow llama.cpp's per-name settings; the remaining
  // fields keep their defaults.
  static constexpr Entry kTable[] = {
      {"", {K::kDefault, true, false, false}},
      {"default", {K::kDefault, true, false, false}},
      {"llama3", {K::kLlama3, true, true, true}},
      {"llama-v3", {K::kLlama3, true, true, true}},
      {"llama-bpe", {K::kLlama3, true, true, true}},
      {"falcon3", {K::kLlama3, true, true, true}},
      {"falcon-h1", {K::kLlama3, true, true, true}},
      {"pixtral", {K::kLlama3, true, true, true}},
      {"midm-2.0", {K::kLlama3, true, true, true}},
      {"lfm2", {K::kLlama3, true, true, true}},
      {"jina-v5-nano", {K::kLlama3, true, true, true}},
      {"dbrx", {K::kLlama3, true, false, false}},
      {"smaug-bpe", {K::kLlama3, true, false, false}},
      {"deepseek-llm", {K::kDeepseekLlm, false, false, false}},
      {"deepseek-coder", {K::kDeepseekCoder, false, false, false}},
      {"falcon", {K::kFalcon, true, false, false}},
      {"gpt-2", {K::kGpt2, true, false, false}},
      {"gpt2", {K::kGpt2, true, false, false}},  // tandem alias
      {"phi-2", {K::kGpt2, true, false, false}},
      {"gigachat", {K::kGpt2, true, false, false}},
      {"a.x-4.0", {K::kGpt2, true, false, false}},
      {"mellum", {K::kGpt2, true, false, false}},
      {"mpt", {K::kGpt2, true, false, false}},
      {"olmo", {K::kGpt2, true, false, false}},
      {"jais", {K::kGpt2, true, false, false}},
      {"exaone4", {K::kGpt2, true, false, false}},
      {"trillion", {K::kGpt2, false, false, false}},
      {"granite-docling", {K::kGpt2, false, false, false}},
      {"starcoder", {K::kStarcoder, true, false, false}},
      {"refact", {K::kStarcoder, true, false, false}},
      {"codeshell", {K::kStarcoder, true, false, false}},
      {"exaone", {K::kStarcoder, true, false, false}},
      {"minerva-7b", {K::kStarcoder, true, false, false}},
      {"mellum2", {K::kStarcoder, true, false, false}},
      {"command-r", {K::kStarcoder, false, false, false}},
      {"smollm", {K::kStarcoder, false, false, false}},
      {"qwen2", {K::kQwen2, false, false, false}},
      {"deepseek-r1-qwen", {K::kQwen2, false, false, false}},
      {"kormo", {K::kQwen2, false, false, false}},
      {"f2llmv2", {K::kQwen2, false, false, false}},
      {"megrez", {K::kQwen2, true, false, false}},
      {"stablelm2", {K::kQwen2, true, false, false}},
      {"hunyuan", {K::kQwen2, false, false, false}},
      {"solar-open", {K::kQwen2, false, false, false}},
      {"grok-2", {K::kQwen2, false, false, false}},
      {"qwen35", {K::kQwen35, false, false, false}},
      {"laguna", {K::kLaguna, false, false, false}},
  };
  for (const Entry& e : kTable) {
    if (e.name == name) return e.info;
  }
  return std::nullopt;
}

PreTokenizerInfo Gemma4PreTokenizer() {
  PreTokenizerInfo info;
  info.kind = PreTokenizerKind::kNewlines;
  info.clean_spaces = true;
  info.add_bos = true;
  info.force_add_bos = true;
  info.spm_style = true;
  return info;
}

void PreTokenize(PreTokenizerKind kind, std::span<const uint32_t> cps,
                 std::vector<uint32_t>* lengths) {
  if (cps.empty()) return;
  std::vector<uint32_t> pieces = {static_cast<uint32_t>(cps.size())};
  auto gpt2 = [](const Piece& s, std::vector<uint32_t>* out) { SplitGpt2(s, out); };
  auto qwen2 = [](const Piece& s, std::vector<uint32_t>* out) {
    SplitLlama3Family(s, 1, false, out);
  };
  auto number_runs = [](const Piece& s, std::vector<uint32_t>* out) {
    SplitClassRuns(s, IsNumber, 0, out);
  };
  switch (kind) {
    case PreTokenizerKind::kDefault:
      Apply(cps, &pieces, [](const Piece& s, std::vector<uint32_t>* out) {
        SplitClassRuns(
            s,
            [](uint32_t c) {
              return IsPunct(c) || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' ||
                     c == '^' || c == '~' || c == '|';
            },
            0, out);
      });
      Apply(cps, &pieces, gpt2);
      Apply(cps, &pieces, number_runs);
      Apply(cps, &pieces, SplitAsciiDigitTriples);
      break;
    case PreTokenizerKind::kGpt2:
      Apply(cps, &pieces, gpt2);
      break;
    case PreTokenizerKind::kLlama3:
      Apply(cps, &pieces, [](const Piece& s, std::vector<uint32_t>* out) {
        SplitLlama3Family(s, 3, false, out);
      });
      break;
    case PreTokenizerKind::kQwen2:
      Apply(cps, &pieces, qwen2);
      break;
    case PreTokenizerKind::kQwen35:
      Apply(cps, &pieces,
            [](const Piece& s, std::vector<uint32_t>* out) { SplitLlama3Family(s, 1, true, out); });
      break;
    case PreTokenizerKind::kStarcoder:
      Apply(cps, &pieces, [](const Piece& s, std::vector<uint32_t>* out) {
        SplitClassRuns(s, IsNumber, 1, out);
      });
      Apply(cps, &pieces, gpt2);
      break;
    case PreTokenizerKind::kFalcon:
      Apply(cps, &pieces, [](const Piece& s, std::vector<uint32_t>* out) {
        SplitClassRuns(
            s,
            [](uint32_t c) {
              return IsPunct(c) || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' ||
                     c == '^' || c == '~' || c == '|' || c == '`';
            },
            0, out);
      });
      Apply(cps, &pieces, gpt2);
      Apply(cps, &pieces, SplitAsciiDigitTriples);
      break;
    case PreTokenizerKind::kDeepseekLlm:
      Apply(cps, &pieces,
            [](const Piece& s, std::vector<uint32_t>* out) { SplitClassRuns(s, IsCrLf, 1, out); });
      Apply(cps, &pieces, [](const Piece& s, std::vector<uint32_t>* out) {
        SplitOptSpaceRuns(
            s, [](uint32_t c) { return InLiteralClass(c, kDeepseekLetters); }, out);
      });
      Apply(cps, &pieces, [](const Piece& s, std::vector<uint32_t>* out) {
        SplitOptSpaceRuns(
            s, [](uint32_t c) { return InLiteralClass(c, kDeepseekPunct); }, out);
      });
      Apply(cps, &pieces, SplitTrailingSpace);
      Apply(cps, &pieces, [](const Piece& s, std::vector<uint32_t>* out) {
        SplitClassRuns(
            s, [](uint32_t c) { return InLiteralClass(c, kDeepseekCjk); }, 0, out);
      });
      Apply(cps, &pieces, number_runs);
      break;
    case PreTokenizerKind::kDeepseekCoder:
      Apply(cps, &pieces,
            [](const Piece& s, std::vector<uint32_t>* out) { SplitClassRuns(s, IsCrLf, 1, out); });
      Apply(cps, &pieces, [](const Piece& s, std::vector<uint32_t>* out) {
        SplitOptSpaceRuns(s, IsLetter, out);
      });
      Apply(cps, &pieces,
            [](const Piece& s, std::vector<uint32_t>* out) { SplitOptSpaceRuns(s, IsPunct, out); });
      Apply(cps, &pieces, [](const Piece& s, std::vector<uint32_t>* out) {
        SplitClassRuns(
            s, [](uint32_t c) { return InLiteralClass(c, kDeepseekCjk); }, 0, out);
      });
      Apply(cps, &pieces, [](const Piece& s, std::vector<uint32_t>* out) {
        SplitClassRuns(s, IsNumber, 1, out);
      });
      break;
    case PreTokenizerKind::kLaguna:
      Apply(cps, &pieces, SplitNewlineRuns);
      Apply(cps, &pieces, qwen2);
      break;
    case PreTokenizerKind::kNewlines:
      Apply(cps, &pieces, SplitNewlineRuns);
      break;
  }
  lengths->insert(lengths->end(), pieces.begin(), pieces.end());
}

}  // namespace tandem::engine
