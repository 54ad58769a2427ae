// Unicode tables and helpers, and direct pre-tokenizer splits.
#include "engine/tokenizer/unicode.h"

#include <string>
#include <vector>

#include "engine/tokenizer/pre_tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::ElementsAre;
using unicode::Category;
using unicode::FlagsOf;

TEST(UnicodeTest, Categories) {
  EXPECT_EQ(FlagsOf('A').category(), Category::kLetter);
  EXPECT_EQ(FlagsOf('z').category(), Category::kLetter);
  EXPECT_EQ(FlagsOf('7').category(), Category::kNumber);
  EXPECT_EQ(FlagsOf('!').category(), Category::kPunctuation);
  EXPECT_EQ(FlagsOf('$').category(), Category::kSymbol);
  EXPECT_EQ(FlagsOf('`').category(), Category::kSymbol);
  EXPECT_EQ(FlagsOf(' ').category(), Category::kSeparator);
  EXPECT_EQ(FlagsOf('\n').category(), Category::kControl);
  EXPECT_EQ(FlagsOf(0x00E9).category(), Category::kLetter);       // é
  EXPECT_EQ(FlagsOf(0x0301).category(), Category::kMark);         // combining acute
  EXPECT_EQ(FlagsOf(0x0663).category(), Category::kNumber);       // Arabic-Indic three
  EXPECT_EQ(FlagsOf(0x2160).category(), Category::kNumber);       // Roman numeral one (Nl)
  EXPECT_EQ(FlagsOf(0x4E2D).category(), Category::kLetter);       // 中 (inside a First/Last range)
  EXPECT_EQ(FlagsOf(0xAC00).category(), Category::kLetter);       // 가 (Hangul range)
  EXPECT_EQ(FlagsOf(0x3002).category(), Category::kPunctuation);  // 。
  EXPECT_EQ(FlagsOf(0x1F999).category(), Category::kSymbol);      // 🦙
  EXPECT_EQ(FlagsOf(0x200D).category(), Category::kControl);      // ZWJ (Cf)
  EXPECT_EQ(FlagsOf(0xE000).category(), Category::kControl);      // private use (Co)
  EXPECT_EQ(FlagsOf(0x0378).category(), Category::kUndefined);    // unassigned
  EXPECT_EQ(FlagsOf(0x10FFFF).category(), Category::kUndefined);
  EXPECT_EQ(FlagsOf(0x110000).category(), Category::kUndefined);
  // Unicode 15.1 additions (llama.cpp's tables are 15.1; Debian's database is 15.0).
  EXPECT_EQ(FlagsOf(0x2FFC).category(), Category::kSymbol);
  EXPECT_EQ(FlagsOf(0x31EF).category(), Category::kSymbol);
  EXPECT_EQ(FlagsOf(0x2EBF0).category(), Category::kLetter);
  EXPECT_EQ(FlagsOf(0x2EE5D).category(), Category::kLetter);
  EXPECT_EQ(FlagsOf(0x2EE5E).category(), Category::kUndefined);
  EXPECT_STREQ(unicode::TableVersion(), "15.1.0");
}

TEST(UnicodeTest, Whitespace) {
  for (uint32_t cp : {0x09u, 0x0Au, 0x0Du, 0x20u, 0x85u, 0xA0u, 0x1680u, 0x2000u, 0x200Au, 0x2028u,
                      0x2029u, 0x202Fu, 0x205Fu, 0x3000u}) {
    EXPECT_TRUE(FlagsOf(cp).is_whitespace()) << std::hex << cp;
  }
  for (uint32_t cp : {0x08u, 0x1Cu, 0x41u, 0x200Bu, 0x180Eu, 0xFEFFu}) {
    EXPECT_FALSE(FlagsOf(cp).is_whitespace()) << std::hex << cp;
  }
}

std::vector<uint32_t> Decode(std::string_view s) {
  std::vector<uint32_t> out;
  unicode::DecodeUtf8Lenient(s, &out);
  return out;
}

TEST(UnicodeTest, LenientDecodingLikeLlamaCpp) {
  EXPECT_THAT(Decode("a\xE4\xB8\xAD"
                     "b"),
              ElementsAre('a', 0x4E2D, 'b'));
  EXPECT_THAT(Decode("\xF0\x9F\xA6\x99"), ElementsAre(0x1F999));
  EXPECT_THAT(Decode("\x80"), ElementsAre(0xFFFD));
  EXPECT_THAT(Decode("\xE4\xB8"), ElementsAre(0xFFFD, 0xFFFD));  // truncated: byte by byte
  EXPECT_THAT(Decode("\xE4"
                     "A"),
              ElementsAre(0xFFFD, 'A'));
  EXPECT_THAT(Decode("\xC0\x80"), ElementsAre(0));           // overlong accepted
  EXPECT_THAT(Decode("\xED\xA0\x80"), ElementsAre(0xD800));  // surrogate accepted
  EXPECT_THAT(Decode("\xF5\x80\x80\x80"), ElementsAre(0xFFFD));
  EXPECT_THAT(Decode("\xFF"
                     "x"),
              ElementsAre(0xFFFD, 'x'));
}

TEST(UnicodeTest, EncodeAndValidate) {
  for (uint32_t cp : {0x0u, 0x7Fu, 0x80u, 0x7FFu, 0x800u, 0xFFFFu, 0x10000u, 0x10FFFFu}) {
    std::string s;
    unicode::AppendUtf8(cp, &s);
    EXPECT_TRUE(unicode::IsValidUtf8(s)) << std::hex << cp;
    EXPECT_THAT(Decode(s), ElementsAre(cp));
  }
  EXPECT_FALSE(unicode::IsValidUtf8("\xC0\x80"));
  EXPECT_FALSE(unicode::IsValidUtf8("\xED\xA0\x80"));
  EXPECT_FALSE(unicode::IsValidUtf8("\xE4\xB8"));
  EXPECT_FALSE(unicode::IsValidUtf8("\xF4\x90\x80\x80"));
  EXPECT_TRUE(unicode::IsValidUtf8("héllo 🦙"));
}

TEST(UnicodeTest, Gpt2ByteAlphabet) {
  EXPECT_EQ(unicode::ByteToGpt2Utf8(' '), "Ġ");
  EXPECT_EQ(unicode::ByteToGpt2Utf8('\n'), "Ċ");
  EXPECT_EQ(unicode::ByteToGpt2Utf8('a'), "a");
  EXPECT_EQ(unicode::ByteToGpt2Utf8(0xAD), "Ń");
  EXPECT_EQ(unicode::ByteToGpt2Utf8(0xFF), "ÿ");
  for (int b = 0; b < 256; ++b) {
    const auto cps = Decode(unicode::ByteToGpt2Utf8(static_cast<uint8_t>(b)));
    ASSERT_EQ(cps.size(), 1u);
    EXPECT_EQ(unicode::Gpt2CodepointToByte(cps[0]), b);
  }
  EXPECT_EQ(unicode::Gpt2CodepointToByte(0x20), -1);
  EXPECT_EQ(unicode::Gpt2CodepointToByte(0x4E2D), -1);
}

std::vector<std::string> Split(PreTokenizerKind kind, std::string_view text) {
  const std::vector<uint32_t> cps = Decode(text);
  std::vector<uint32_t> lengths;
  PreTokenize(kind, cps, &lengths);
  std::vector<std::string> words;
  size_t pos = 0;
  for (const uint32_t len : lengths) {
    std::string w;
    for (size_t i = pos; i < pos + len; ++i) unicode::AppendUtf8(cps[i], &w);
    words.push_back(w);
    pos += len;
  }
  return words;
}

TEST(PreTokenizerTest, Splits) {
  using K = PreTokenizerKind;
  EXPECT_THAT(Split(K::kGpt2, "Hello world's  end!!"),
              ElementsAre("Hello", " world", "'s", " ", " end", "!!"));
  EXPECT_THAT(Split(K::kLlama3, "12345 I'M\n\n x"),
              ElementsAre("123", "45", " I", "'M", "\n\n", " x"));
  EXPECT_THAT(Split(K::kQwen2, "a123"), ElementsAre("a", "1", "2", "3"));
  EXPECT_THAT(Split(K::kDefault, "x+=12345"), ElementsAre("x", "+=", "123", "45"));
  EXPECT_THAT(Split(K::kStarcoder, " 42 apples"), ElementsAre(" ", "4", "2", " apples"));
  EXPECT_THAT(Split(K::kDeepseekLlm, "Ab\r\nc  "), ElementsAre("Ab", "\r", "\n", "c", "  "));
  EXPECT_THAT(Split(K::kQwen35, "e\xCC\x81x"), ElementsAre("e\xCC\x81x"));
  // qwen2: the mark is not a letter, so it becomes the optional prefix of the next word.
  EXPECT_THAT(Split(K::kQwen2, "e\xCC\x81x"), ElementsAre("e", "\xCC\x81x"));
  EXPECT_TRUE(Split(K::kGpt2, "").empty());
  ASSERT_TRUE(LookupPreTokenizer("llama-bpe").has_value());
  EXPECT_EQ(LookupPreTokenizer("llama-bpe")->kind, K::kLlama3);
  EXPECT_TRUE(LookupPreTokenizer("llama-bpe")->ignore_merges);
  EXPECT_FALSE(LookupPreTokenizer("qwen2")->clean_spaces);
  EXPECT_EQ(LookupPreTokenizer("")->kind, K::kDefault);
  EXPECT_FALSE(LookupPreTokenizer("tekken").has_value());
}

}  // namespace
}  // namespace tandem::engine
