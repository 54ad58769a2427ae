#include "engine/tokenizer/unicode.h"

#include <array>
#include <cstring>
#include <map>

#include "engine/tokenizer/unicode_data.h"

namespace tandem::engine::unicode {
namespace {

constexpr uint32_t kMaxCodepoint = 0x110000;
constexpr uint32_t kBlockBits = 8;
constexpr uint32_t kBlockSize = 1u << kBlockBits;
constexpr uint32_t kNumBlocks = kMaxCodepoint >> kBlockBits;

// Two-stage table: block index per 256 code points, then deduplicated 256-byte blocks. About
// 100 KB instead of 1.1 MB for a flat table, with the same two loads per lookup.
struct FlagTable {
  std::array<uint16_t, kNumBlocks> block_of{};
  std::vector<uint8_t> blocks;

  FlagTable() {
    std::vector<uint8_t> flat(kMaxCodepoint, 0);
    for (size_t i = 0; i < unicode_data::kNumCategoryRuns; ++i) {
      const uint32_t first = unicode_data::kCategoryRuns[i] >> 3;
      const uint32_t end = i + 1 < unicode_data::kNumCategoryRuns
                               ? unicode_data::kCategoryRuns[i + 1] >> 3
                               : kMaxCodepoint;
      const uint8_t cat = unicode_data::kCategoryRuns[i] & 7;
      for (uint32_t cp = first; cp < end && cp < kMaxCodepoint; ++cp) flat[cp] = cat;
    }
    for (size_t i = 0; i < unicode_data::kNumWhitespaceRanges; ++i) {
      for (uint32_t cp = unicode_data::kWhitespaceRanges[i][0];
           cp <= unicode_data::kWhitespaceRanges[i][1]; ++cp) {
        flat[cp] |= 8;
      }
    }
    std::map<std::string, uint16_t> seen;
    for (uint32_t b = 0; b < kNumBlocks; ++b) {
      std::string key(reinterpret_cast<const char*>(&flat[b * kBlockSize]), kBlockSize);
      auto [it, inserted] = seen.emplace(key, static_cast<uint16_t>(seen.size()));
      if (inserted) blocks.insert(blocks.end(), key.begin(), key.end());
      block_of[b] = it->second;
    }
  }
};

const FlagTable& Table() {
  static const FlagTable* table = new FlagTable();
  return *table;
}

struct Gpt2Map {
  std::array<std::string, 256> byte_to_utf8;
  std::array<int16_t, 512> cp_to_byte;  // every alphabet code point is below U+0144

  Gpt2Map() {
    cp_to_byte.fill(-1);
    auto direct = [](int b) {
      return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const uint32_t cp = direct(b) ? static_cast<uint32_t>(b) : next++;
      AppendUtf8(cp, &byte_to_utf8[b]);
      cp_to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

const Gpt2Map& Gpt2() {
  static const Gpt2Map* map = new Gpt2Map();
  return *map;
}

}  // namespace

CpFlags FlagsOf(uint32_t cp) {
  if (cp >= kMaxCodepoint) return CpFlags{0};
  const FlagTable& t = Table();
  return CpFlags{t.blocks[(static_cast<size_t>(t.block_of[cp >> kBlockBits]) << kBlockBits) |
                          (cp & (kBlockSize - 1))]};
}

const char* TableVersion() { return unicode_data::kUnicodeVersion; }

void DecodeUtf8Lenient(std::string_view text, std::vector<uint32_t>* out) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  out->reserve(out->size() + n);
  auto cont = [&](size_t i) { return i < n && (s[i] & 0xC0) == 0x80; };
  size_t i = 0;
  while (i < n) {
    const uint8_t b = s[i];
    if (b < 0x80) {
      out->push_back(b);
      i += 1;
    } else if (b < 0xC0 || b >= 0xF8) {
      out->push_back(kReplacementChar);
      i += 1;
    } else if (b < 0xE0) {
      if (!cont(i + 1)) {
        out->push_back(kReplacementChar);
        i += 1;
        continue;
      }
      out->push_back(((b & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu));
      i += 2;
    } else if (b < 0xF0) {
      if (!cont(i + 1) || !cont(i + 2)) {
        out->push_back(kReplacementChar);
        i += 1;
        continue;
      }
      out->push_back(((b & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu));
      i += 3;
    } else {
      if (!cont(i + 1) || !cont(i + 2) || !cont(i + 3)) {
        out->push_back(kReplacementChar);
        i += 1;
        continue;
      }
      const uint32_t cp = ((b & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) |
                          ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3Fu);
      // llama.cpp would fail to re-encode these; one replacement character is the sane reading.
      out->push_back(cp < kMaxCodepoint ? cp : kReplacementChar);
      i += 4;
    }
  }
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | ((cp >> 18) & 0x07)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

const std::string& ByteToGpt2Utf8(uint8_t b) { return Gpt2().byte_to_utf8[b]; }

int Gpt2CodepointToByte(uint32_t cp) {
  return cp < Gpt2().cp_to_byte.size() ? Gpt2().cp_to_byte[cp] : -1;
}

bool IsValidUtf8(std::string_view text) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t b = s[i];
    size_t len;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b < 0x80) {
      ++i;
      continue;
    } else if (b >= 0xC2 && b <= 0xDF) {
      len = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      len = 3;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      len = 4;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (i + len > n || s[i + 1] < lo || s[i + 1] > hi) return false;
    for (size_t k = 2; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return false;
    }
    i += len;
  }
  return true;
}

}  // namespace tandem::engine::unicode
