// llama.cpp's tokenizer test vectors (models/ggml-vocab-*.gguf.inp/.out, produced with the
// reference Hugging Face tokenizers): tandem must reproduce every id, called the way
// test-tokenizer-0 calls llama_tokenize (add_special=false, parse_special=false). Plus the
// detokenize round trips of test-tokenizer-1-spm.
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "engine/tokenizer/tokenizer.h"
#include "engine/tokenizer/unicode.h"
#include "gtest/gtest.h"
#include "tests/unit/tokenizer/tokenizer_test_util.h"

namespace tandem::engine {
namespace {

using testing::LoadVocab;
using testing::ReadVocabCases;

class VocabVectorsTest : public ::testing::TestWithParam<const char*> {};

TEST_P(VocabVectorsTest, ReproducesLlamaCppIds) {
  std::string skip;
  auto tok = LoadVocab(GetParam(), &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_NE(tok, nullptr);
  const auto cases = ReadVocabCases(GetParam());
  ASSERT_GE(cases.size(), 40u);
  int failed = 0;
  for (const auto& c : cases) {
    const std::vector<int32_t> got = tok->Encode(c.text, /*add_special=*/false,
                                                 /*parse_special=*/false);
    EXPECT_EQ(got, c.ids) << "input: '" << c.text << "'";
    failed += got != c.ids;
  }
  EXPECT_EQ(failed, 0) << "of " << cases.size() << " cases";
}

// The four vocabularies tandem must support.
INSTANTIATE_TEST_SUITE_P(Required, VocabVectorsTest,
                         ::testing::Values("llama-spm", "gpt-2", "llama-bpe", "qwen2"));
// Further pre-tokenizers tandem implements, each against its own vectors.
INSTANTIATE_TEST_SUITE_P(More, VocabVectorsTest,
                         ::testing::Values("phi-3", "deepseek-llm", "deepseek-coder", "starcoder",
                                           "falcon", "refact", "mpt", "qwen35", "command-r",
                                           "gemma-4"));

// llama.cpp's test tokenizes from one thread per core; a Tokenizer is shared the same way.
TEST(VocabThreadsTest, ConcurrentEncodingMatches) {
  std::string skip;
  auto tok = LoadVocab("llama-bpe", &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_NE(tok, nullptr);
  const auto cases = ReadVocabCases("llama-bpe");
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int rep = 0; rep < 20; ++rep) {
        for (const auto& c : cases) mismatches += tok->Encode(c.text, false, false) != c.ids;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// test-tokenizer-1-spm: every token's text, and every code point, survives
// detokenize -> tokenize -> detokenize.
TEST(VocabRoundTripTest, SpmTokensAndCodepointsRoundTrip) {
  std::string skip;
  auto tok = LoadVocab("llama-spm", &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_NE(tok, nullptr);
  int failures = 0;
  for (int32_t id = 0; id < tok->vocab_size() && failures < 10; ++id) {
    const int32_t one[] = {id};
    const std::string str = tok->Decode(one, /*special=*/true);
    const std::vector<int32_t> ids = tok->Encode(str, false, /*parse_special=*/true);
    const std::string check = tok->Decode(ids, /*special=*/true);
    EXPECT_EQ(check, str) << "token " << id;
    failures += check != str;
  }
  std::string str;
  for (uint32_t cp = 0; cp < 0x110000 && failures < 10; ++cp) {
    if ((cp >= 0xD800 && cp <= 0xDFFF) || (cp >= 0x40000 && cp <= 0xE0000)) continue;
    str.clear();
    unicode::AppendUtf8(cp, &str);
    const std::vector<int32_t> ids = tok->Encode(str, false, true);
    const std::string check = tok->Decode(ids, true);
    if (cp != 0x2581 && check != str) {  // U+2581 is the space marker itself
      ADD_FAILURE() << "code point U+" << std::hex << cp << " decodes to '" << check << "'";
      ++failures;
    }
  }
  EXPECT_EQ(failures, 0);
}

// The byte-level equivalent (llama.cpp keeps these disabled because clean_spaces breaks some
// tokens; qwen2 does not clean spaces): every code point round-trips through the byte alphabet.
TEST(VocabRoundTripTest, ByteLevelCodepointsRoundTrip) {
  std::string skip;
  auto tok = LoadVocab("qwen2", &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_NE(tok, nullptr);
  int failures = 0;
  std::string str;
  // Every code point of the common scripts, then a sample (the full range takes a second).
  for (uint32_t cp = 0; cp < 0x110000 && failures < 10; cp += (cp < 0x3400 ? 1 : 5)) {
    if ((cp >= 0xD800 && cp <= 0xDFFF) || (cp >= 0x40000 && cp <= 0xE0000)) continue;
    str.clear();
    unicode::AppendUtf8(cp, &str);
    const std::string check = tok->Decode(tok->Encode(str, false, false), false);
    if (check != str) {
      ADD_FAILURE() << "code point U+" << std::hex << cp << " decodes to '" << check << "'";
      ++failures;
    }
  }
  EXPECT_EQ(failures, 0);
}

}  // namespace
}  // namespace tandem::engine
