// StreamingDecoder: chunks are always valid UTF-8, multi-byte characters split across byte
// tokens come out whole, and the concatenation equals Decode.
#include <string>
#include <vector>

#include "engine/tokenizer/tokenizer.h"
#include "engine/tokenizer/unicode.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/tokenizer/tokenizer_test_util.h"

namespace tandem::engine {
namespace {

using testing::LoadVocab;

// Streams `ids`, checking every chunk; returns the concatenation.
std::string StreamAll(const Tokenizer& tok, const std::vector<int32_t>& ids,
                      bool continuation = false) {
  StreamingDecoder dec(tok, /*special=*/false, continuation);
  std::string out;
  for (const int32_t id : ids) {
    const std::string chunk = dec.Push(id);
    EXPECT_TRUE(unicode::IsValidUtf8(chunk)) << "after id " << id;
    out += chunk;
  }
  const std::string tail = dec.Flush();
  EXPECT_TRUE(unicode::IsValidUtf8(tail));
  return out + tail;
}

class StreamingDecoderSpmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string skip;
    tok_ = LoadVocab("llama-spm", &skip);
    if (!skip.empty()) GTEST_SKIP() << skip;
    ASSERT_NE(tok_, nullptr);
  }
  int32_t ByteToken(uint8_t b) const { return 3 + b; }  // <0x00> is id 3 in llama-spm
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(StreamingDecoderSpmTest, HoldsSplitCharactersUntilComplete) {
  // llama-spm has no token for the llama emoji: it is four <0xNN> byte tokens.
  const std::vector<int32_t> ids = tok_->Encode("a 🦙 中文 b", false, false);
  const std::vector<int32_t> llama = {ByteToken(0xF0), ByteToken(0x9F), ByteToken(0xA6),
                                      ByteToken(0x99)};
  ASSERT_NE(std::search(ids.begin(), ids.end(), llama.begin(), llama.end()), ids.end())
      << "expected the emoji as byte tokens";
  StreamingDecoder dec(*tok_, false);
  std::vector<std::string> chunks;
  for (const int32_t id : ids) chunks.push_back(dec.Push(id));
  const auto at = std::search(ids.begin(), ids.end(), llama.begin(), llama.end()) - ids.begin();
  EXPECT_EQ(chunks[at], "");
  EXPECT_EQ(chunks[at + 1], "");
  EXPECT_EQ(chunks[at + 2], "");
  EXPECT_EQ(chunks[at + 3], "🦙");
  EXPECT_EQ(dec.Flush(), "");
  EXPECT_EQ(StreamAll(*tok_, ids), tok_->Decode(ids, false));
  EXPECT_EQ(StreamAll(*tok_, ids), "a 🦙 中文 b");
}

TEST_F(StreamingDecoderSpmTest, MatchesDecodeOnTheVocabVectors) {
  int checked = 0;
  for (const auto& c : testing::ReadVocabCases("llama-spm")) {
    const std::string decoded = tok_->Decode(c.ids, false);
    if (!unicode::IsValidUtf8(decoded)) continue;
    EXPECT_EQ(StreamAll(*tok_, c.ids), decoded) << "input: '" << c.text << "'";
    ++checked;
  }
  EXPECT_GT(checked, 40);
}

TEST_F(StreamingDecoderSpmTest, LeadingSpaceRules) {
  const std::vector<int32_t> hello = tok_->Encode("Hello world", false, false);
  EXPECT_EQ(StreamAll(*tok_, hello), "Hello world");
  EXPECT_EQ(StreamAll(*tok_, hello, /*continuation=*/true), " Hello world");
  std::vector<int32_t> with_bos = {tok_->bos_id()};
  with_bos.insert(with_bos.end(), hello.begin(), hello.end());
  EXPECT_EQ(StreamAll(*tok_, with_bos), "Hello world");
  EXPECT_EQ(StreamAll(*tok_, with_bos, true), "Hello world");
  // Only one space goes: "  x" keeps one.
  EXPECT_EQ(StreamAll(*tok_, tok_->Encode("  x", false, false)), "  x");
}

TEST_F(StreamingDecoderSpmTest, InvalidBytesBecomeReplacementCharacters) {
  const std::string kFffd = "\xEF\xBF\xBD";
  {
    StreamingDecoder dec(*tok_, false);
    EXPECT_EQ(dec.Push(ByteToken(0xFF)), kFffd);  // can never start a character
    EXPECT_EQ(dec.Push(ByteToken(0x80)), kFffd);  // stray continuation byte
  }
  {
    StreamingDecoder dec(*tok_, false);
    EXPECT_EQ(dec.Push(ByteToken(0xE4)), "");
    EXPECT_EQ(dec.Push(ByteToken('A')), kFffd + "A");  // the sequence broke: emit at once
  }
  {
    StreamingDecoder dec(*tok_, false);
    EXPECT_EQ(dec.Push(ByteToken(0xE4)), "");
    EXPECT_EQ(dec.Push(ByteToken(0xB8)), "");
    EXPECT_EQ(dec.Flush(), kFffd);  // truncated at the end of the stream
    EXPECT_EQ(dec.Flush(), "");
    EXPECT_EQ(dec.Push(ByteToken('x')), "x");
  }
  {
    StreamingDecoder dec(*tok_, false);
    EXPECT_EQ(dec.Push(ByteToken(0xED)), "");
    EXPECT_EQ(dec.Push(ByteToken(0xA0)), kFffd + kFffd);  // surrogate range is invalid
  }
}

TEST(StreamingDecoderBpeTest, ByteLevelPiecesSplitInsideCharacters) {
  std::string skip;
  auto tok = LoadVocab("gpt-2", &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_NE(tok, nullptr);
  const std::string text =
      "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 我想在apple工作";
  const std::vector<int32_t> ids = tok->Encode(text, false, false);
  // GPT-2 splits these characters across tokens: some tokens alone are not valid UTF-8.
  int partial = 0;
  for (const int32_t id : ids) partial += !unicode::IsValidUtf8(tok->TokenToPiece(id, false));
  EXPECT_GT(partial, 0);
  EXPECT_EQ(StreamAll(*tok, ids), tok->Decode(ids, false));
  EXPECT_EQ(StreamAll(*tok, ids), text);
}

}  // namespace
}  // namespace tandem::engine
