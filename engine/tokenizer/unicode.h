// Unicode helpers for the tokenizers: general-category and White_Space lookups over code
// points (tables generated from the Unicode Character Database, see unicode_data.cc), UTF-8
// decoding with llama.cpp's lenient rules, UTF-8 encoding, and GPT-2's byte <-> code point map.
//
// All functions are pure and thread-safe; the lookup tables are built once on first use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::engine::unicode {

// Coarse general category (the first letter of the Unicode category), as the pre-tokenizer
// regexes use it: \p{N}, \p{L}, \p{Z}, \p{M}, \p{P}, \p{S}, \p{C}. Unassigned code points are
// kUndefined. The numbering matches scripts/gen_unicode_tables.py.
enum class Category : uint8_t {
  kUndefined = 0,
  kNumber = 1,
  kLetter = 2,
  kSeparator = 3,
  kMark = 4,
  kPunctuation = 5,
  kSymbol = 6,
  kControl = 7,
};

// Packed per-code-point properties: category in the low 3 bits, White_Space in bit 3.
struct CpFlags {
  uint8_t bits = 0;
  Category category() const { return static_cast<Category>(bits & 7); }
  bool is_whitespace() const { return (bits & 8) != 0; }
  bool is_letter() const { return category() == Category::kLetter; }
  bool is_number() const { return category() == Category::kNumber; }
  bool is_mark() const { return category() == Category::kMark; }
  bool is_punctuation() const { return category() == Category::kPunctuation; }
};

// Properties of `cp`; code points past U+10FFFF are kUndefined.
CpFlags FlagsOf(uint32_t cp);

// The Unicode version the tables were generated from ("15.0.0").
const char* TableVersion();

inline constexpr uint32_t kReplacementChar = 0xFFFD;

// Length of the UTF-8 sequence that `lead` starts, judged by its high 4 bits only (1 for
// ASCII and for stray continuation bytes, 2 for 0xC_/0xD_, 3 for 0xE_, 4 for 0xF_). This is the
// symbol-splitting rule of llama.cpp's BPE and SentencePiece merges.
inline size_t Utf8LeadLength(uint8_t lead) {
  static constexpr uint8_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLen[lead >> 4];
}

// Decodes UTF-8 the way llama.cpp's unicode_cpts_from_utf8 does: lead bytes are trusted for
// the length, continuation bytes are checked, overlong forms and surrogates are accepted, and
// each byte that cannot start a sequence becomes one U+FFFD. Sequences that decode past
// U+10FFFF (lead bytes F5..F7) also become one U+FFFD.
void DecodeUtf8Lenient(std::string_view text, std::vector<uint32_t>* out);

// Appends the UTF-8 form of `cp` (which must be <= U+10FFFF; surrogates are encoded as is).
void AppendUtf8(uint32_t cp, std::string* out);

// GPT-2's byte-level alphabet: every byte maps to one printable code point (bytes 0x21..0x7E,
// 0xA1..0xAC and 0xAE..0xFF map to themselves, the rest to U+0100 and up, in byte order).
// Returns the UTF-8 form of byte b's code point.
const std::string& ByteToGpt2Utf8(uint8_t b);
// Inverse: the byte for code point cp, or -1 when cp is not part of the alphabet.
int Gpt2CodepointToByte(uint32_t cp);

// Strict UTF-8 validation (no overlongs, no surrogates, nothing past U+10FFFF).
bool IsValidUtf8(std::string_view text);

}  // namespace tandem::engine::unicode
