// Tokenizer behaviour beyond the llama.cpp vectors: metadata errors, merge order on small
// hand-made vocabularies, special tokens, detokenisation rules, the real stories260K model,
// and encoding speed.
#include "engine/tokenizer/tokenizer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/gguf/gguf.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/tokenizer/tokenizer_test_util.h"

namespace tandem::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::LoadVocab;

absl::StatusOr<std::unique_ptr<Tokenizer>> BuildTokenizer(
    const std::function<void(gguf::GgufWriter&)>& fill) {
  static int counter = 0;
  gguf::GgufWriter w;
  w.SetString("general.architecture", "llama");
  fill(w);
  const std::string path = ::testing::TempDir() + "/tok_" + std::to_string(getpid()) + "_" +
                           std::to_string(counter++) + ".gguf";
  if (auto st = w.Write(path); !st.ok()) return st;
  auto file = gguf::GgufFile::Open(path);
  std::filesystem::remove(path);
  if (!file.ok()) return file.status();
  return Tokenizer::FromGguf(**file);
}

// A SentencePiece vocabulary: <unk> <s> </s>, 256 byte tokens, then the given pieces.
void FillSpm(gguf::GgufWriter& w, const std::vector<std::pair<std::string, float>>& pieces) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<float> scores = {0, 0, 0};
  std::vector<int32_t> types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(absl::StrFormat("<0x%02X>", b));
    scores.push_back(0);
    types.push_back(6);
  }
  for (const auto& [text, score] : pieces) {
    tokens.push_back(text);
    scores.push_back(score);
    types.push_back(1);
  }
  w.SetString("tokenizer.ggml.model", "llama");
  w.SetStringArray("tokenizer.ggml.tokens", tokens);
  w.SetF32Array("tokenizer.ggml.scores", scores);
  w.SetI32Array("tokenizer.ggml.token_type", types);
}

constexpr int32_t kFirstPiece = 3 + 256;

TEST(TokenizerSpmTest, MergesHighestScoreFirst) {
  // "▁ab": the pairs "▁a" and "ab" compete; only the better-scoring one may merge, and "▁ab"
  // is not a token, so the result shows which one won.
  for (const bool ab_first : {true, false}) {
    auto tok = BuildTokenizer([&](gguf::GgufWriter& w) {
      FillSpm(w, {{"▁", -3},
                  {"a", -3},
                  {"b", -3},
                  {"ab", ab_first ? -0.5f : -1.0f},
                  {"▁a", ab_first ? -1.0f : -0.5f}});
    });
    ASSERT_TRUE(tok.ok()) << tok.status();
    const int32_t space = kFirstPiece, b = kFirstPiece + 2, ab = kFirstPiece + 3,
                  space_a = kFirstPiece + 4;
    if (ab_first) {
      EXPECT_THAT((*tok)->Encode("ab", false, false), ElementsAre(space, ab));
    } else {
      EXPECT_THAT((*tok)->Encode("ab", false, false), ElementsAre(space_a, b));
    }
    // "c" is no token: byte fallback <0x63>.
    EXPECT_THAT((*tok)->Encode("ac", false, false), ElementsAre(space_a, 3 + 'c'));
    EXPECT_THAT((*tok)->Encode("a", true, false), ElementsAre(1, space_a));
  }
}

TEST(TokenizerSpmTest, EqualScoresMergeLeftmostFirst) {
  auto tok = BuildTokenizer([](gguf::GgufWriter& w) {
    FillSpm(w, {{"▁", -3}, {"a", -3}, {"b", -3}, {"ab", -1}, {"▁a", -1}});
  });
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT((*tok)->Encode("aba", false, false),
              ElementsAre(kFirstPiece + 4, kFirstPiece + 2, kFirstPiece + 1));
}

TEST(TokenizerSpmTest, DefaultsAndFlagsFromMetadata) {
  auto tok = BuildTokenizer([](gguf::GgufWriter& w) {
    FillSpm(w, {{"▁", -3}, {"a", -3}, {"▁a", -1}});
    w.SetBool("tokenizer.ggml.add_eos_token", true);
    w.SetBool("tokenizer.ggml.add_space_prefix", false);
  });
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_TRUE((*tok)->IsSentencePiece());
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_EQ((*tok)->eos_id(), 2);
  EXPECT_EQ((*tok)->unk_id(), 0);
  EXPECT_TRUE((*tok)->add_bos());
  EXPECT_TRUE((*tok)->add_eos());
  EXPECT_TRUE((*tok)->IsEog(2));
  EXPECT_FALSE((*tok)->IsEog(1));
  // No space prefix: "a" stays "a".
  EXPECT_THAT((*tok)->Encode("a", true, false), ElementsAre(1, kFirstPiece + 1, 2));
  EXPECT_EQ((*tok)->attr(0), TokenAttr::kUnknown);
  EXPECT_EQ((*tok)->attr(1), TokenAttr::kControl);
  EXPECT_EQ((*tok)->attr(3), TokenAttr::kByte);
  EXPECT_EQ((*tok)->attr(kFirstPiece), TokenAttr::kNormal);
}

// Byte-level BPE over "a", "b", "c": the merge with the lower rank wins.
TEST(TokenizerBpeTest, MergesLowestRankFirst) {
  for (const bool bc_first : {true, false}) {
    auto tok = BuildTokenizer([&](gguf::GgufWriter& w) {
      w.SetString("tokenizer.ggml.model", "gpt2");
      w.SetString("tokenizer.ggml.pre", "gpt-2");
      w.SetStringArray("tokenizer.ggml.tokens", {"a", "b", "c", "ab", "bc", "Ġ"});
      w.SetStringArray("tokenizer.ggml.merges", bc_first ? std::vector<std::string>{"b c", "a b"}
                                                         : std::vector<std::string>{"a b", "b c"});
    });
    ASSERT_TRUE(tok.ok()) << tok.status();
    if (bc_first) {
      EXPECT_THAT((*tok)->Encode("abc", false, false), ElementsAre(0, 4));
    } else {
      EXPECT_THAT((*tok)->Encode("abc", false, false), ElementsAre(3, 2));
    }
    // GPT-2 attaches the space to the word (" c"), but no merge joins "Ġ" and "c".
    EXPECT_EQ((*tok)->Encode(" c", false, false), (std::vector<int32_t>{5, 2}));
    EXPECT_FALSE((*tok)->IsSentencePiece());
    EXPECT_FALSE((*tok)->add_bos());
    EXPECT_EQ((*tok)->bos_id(), -1);  // the default id 11 is outside this vocabulary
    EXPECT_EQ((*tok)->Decode(std::vector<int32_t>{5, 3, 2}, false), " abc");
  }
}

TEST(TokenizerErrorsTest, RejectsBadMetadata) {
  auto code = [](const std::function<void(gguf::GgufWriter&)>& fill) {
    return BuildTokenizer(fill).status().code();
  };
  EXPECT_EQ(code([](gguf::GgufWriter&) {}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code([](gguf::GgufWriter& w) {
              FillSpm(w, {});
              w.SetString("tokenizer.ggml.model", "t5");
            }),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(code([](gguf::GgufWriter& w) {
              w.SetString("tokenizer.ggml.model", "gpt2");
              w.SetString("tokenizer.ggml.pre", "tekken");
              w.SetStringArray("tokenizer.ggml.tokens", {"a"});
              w.SetStringArray("tokenizer.ggml.merges", {});
            }),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(code([](gguf::GgufWriter& w) {  // no merges
              w.SetString("tokenizer.ggml.model", "gpt2");
              w.SetStringArray("tokenizer.ggml.tokens", {"a"});
            }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code([](gguf::GgufWriter& w) {  // no tokens
              w.SetString("tokenizer.ggml.model", "llama");
            }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code([](gguf::GgufWriter& w) {  // tokens of the wrong type
              w.SetString("tokenizer.ggml.model", "llama");
              w.SetF32Array("tokenizer.ggml.tokens", {1.0f});
            }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code([](gguf::GgufWriter& w) {  // too few scores
              FillSpm(w, {{"a", 0}});
              w.SetF32Array("tokenizer.ggml.scores", {0.0f, 1.0f});
            }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code([](gguf::GgufWriter& w) {  // too few token types
              FillSpm(w, {{"a", 0}});
              w.SetI32Array("tokenizer.ggml.token_type", {1});
            }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code([](gguf::GgufWriter& w) {  // duplicate token
              FillSpm(w, {{"a", 0}, {"a", 0}});
            }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code([](gguf::GgufWriter& w) {  // add_bos (the SPM default) without a BOS token
              w.SetString("tokenizer.ggml.model", "llama");
              w.SetStringArray("tokenizer.ggml.tokens", {"a"});
            }),
            absl::StatusCode::kInvalidArgument);
  auto st = BuildTokenizer([](gguf::GgufWriter& w) {
    FillSpm(w, {});
    w.SetString("tokenizer.ggml.model", "rwkv");
  });
  EXPECT_THAT(std::string(st.status().message()), HasSubstr("rwkv"));
}

TEST(TokenizerSpecialTest, ParseSpecialSplitsControlTokens) {
  std::string skip;
  auto spm = LoadVocab("llama-spm", &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_NE(spm, nullptr);
  // Text after a special token gets the SentencePiece space prefix again.
  EXPECT_THAT(spm->Encode("Hello<s>world", false, true), ElementsAre(15043, 1, 3186));
  const auto plain = spm->Encode("Hello<s>world", false, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 1), 0);
  EXPECT_THAT(spm->Encode("Hello", true, false), ElementsAre(1, 15043));
  EXPECT_TRUE(spm->Encode("", false, false).empty());
  EXPECT_THAT(spm->Encode("", true, false), ElementsAre(1));

  auto bpe = LoadVocab("llama-bpe", &skip);
  ASSERT_NE(bpe, nullptr);
  EXPECT_TRUE(bpe->add_bos());  // llama3 default when the file does not say
  EXPECT_THAT(bpe->Encode("<|begin_of_text|>Hello", false, true), ElementsAre(128000, 9906));
  EXPECT_THAT(bpe->Encode("Hello", true, false), ElementsAre(128000, 9906));
  const auto text = bpe->Encode("<|begin_of_text|>Hello", false, false);
  EXPECT_EQ(std::count(text.begin(), text.end(), 128000), 0);
  EXPECT_EQ(bpe->eot_id(), 128009);
  EXPECT_TRUE(bpe->IsEog(128001));
  EXPECT_TRUE(bpe->IsEog(128009));
  EXPECT_FALSE(bpe->IsEog(9906));

  // User-defined tokens are split out even without parse_special.
  auto qwen = LoadVocab("qwen2", &skip);
  ASSERT_NE(qwen, nullptr);
  const auto ud = qwen->Encode("x[PAD151650]y", false, false);
  EXPECT_EQ(std::count(ud.begin(), ud.end(), 151650), 1);
  EXPECT_EQ(qwen->attr(151650), TokenAttr::kUserDefined);
  EXPECT_TRUE(qwen->IsEog(151645));  // <|im_end|> by its text
  EXPECT_TRUE(qwen->IsEog(151643));
}

TEST(TokenizerSpecialTest, Phi3SpecialTokensStripSpacesToTheirRight) {
  std::string skip;
  auto phi = LoadVocab("phi-3", &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  auto spm = LoadVocab("llama-spm", &skip);
  ASSERT_NE(phi, nullptr);
  ASSERT_NE(spm, nullptr);
  // phi-3 (by general.name) gives its special tokens rstrip, like llama.cpp.
  EXPECT_EQ(phi->Encode("<|assistant|>   Hello", false, true),
            phi->Encode("<|assistant|>Hello", false, true));
  EXPECT_THAT(phi->Encode("<|assistant|>Hello", false, true), ElementsAre(32001, 15043));
  // Without rstrip the spaces stay text.
  EXPECT_NE(spm->Encode("<s>   Hello", false, true), spm->Encode("<s>Hello", false, true));
}

TEST(TokenizerDecodeTest, PiecesAndSpaces) {
  std::string skip;
  auto gpt2 = LoadVocab("gpt-2", &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_NE(gpt2, nullptr);
  EXPECT_EQ(gpt2->TokenToPiece(995, false), " world");
  EXPECT_EQ(gpt2->piece(995), "Ġworld");
  EXPECT_EQ(gpt2->TokenToPiece(50256, false), "");
  EXPECT_EQ(gpt2->TokenToPiece(50256, true), "<|endoftext|>");
  EXPECT_EQ(gpt2->TokenToPiece(-1, true), "");
  EXPECT_EQ(gpt2->TokenToPiece(gpt2->vocab_size(), true), "");
  // gpt-2 cleans spaces before punctuation and contractions on decode.
  EXPECT_EQ(gpt2->Decode(gpt2->Encode("Hello , world . It 's ok", false, false), false),
            "Hello, world. It's ok");

  auto qwen = LoadVocab("qwen2", &skip);
  ASSERT_NE(qwen, nullptr);
  EXPECT_EQ(qwen->Decode(qwen->Encode("Hello , world . It 's ok", false, false), false),
            "Hello , world . It 's ok");

  auto spm = LoadVocab("llama-spm", &skip);
  ASSERT_NE(spm, nullptr);
  EXPECT_EQ(spm->TokenToPiece(13, false), "\n");
  EXPECT_EQ(spm->TokenToPiece(15043, false), " Hello");
  EXPECT_EQ(spm->TokenToPiece(1, false), "");
  EXPECT_EQ(spm->TokenToPiece(1, true), "<s>");
  // llama_detokenize: only the first piece loses its space; a leading BOS takes that turn.
  EXPECT_EQ(spm->Decode(std::vector<int32_t>{15043, 3186}, false), "Hello world");
  EXPECT_EQ(spm->Decode(std::vector<int32_t>{1, 15043, 3186}, false), " Hello world");
  EXPECT_EQ(spm->Decode(std::vector<int32_t>{1, 15043, 3186}, true), "<s> Hello world");
}

std::string StoriesPath() {
  return std::string(TANDEM_SHARED_MODELS_DIR) + "/stories260K/stories260K.gguf";
}

class StoriesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(StoriesPath())) {
      GTEST_SKIP() << StoriesPath() << " is missing (the shared model folder holds it)";
    }
    auto file = gguf::GgufFile::Open(StoriesPath());
    ASSERT_TRUE(file.ok()) << file.status();
    auto tok = Tokenizer::FromGguf(**file);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_ = std::move(*tok);
  }
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(StoriesTest, Metadata) {
  EXPECT_EQ(tok_->vocab_size(), 512);
  EXPECT_TRUE(tok_->IsSentencePiece());
  EXPECT_EQ(tok_->bos_id(), 1);
  EXPECT_EQ(tok_->eos_id(), 2);
  EXPECT_TRUE(tok_->add_bos());
  EXPECT_FALSE(tok_->add_eos());
  EXPECT_TRUE(tok_->IsEog(2));
}

// Expected ids from an independent greedy SentencePiece encoder (llama2.c's algorithm) over
// the same vocabulary and scores.
TEST_F(StoriesTest, Encodes) {
  EXPECT_THAT(
      tok_->Encode("Once upon a time, there was a little girl named Lily.", true, false),
      ElementsAre(1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426));
  EXPECT_THAT(tok_->Encode("Hello world", false, false), ElementsAre(346, 306, 414, 263, 304, 341));
  EXPECT_THAT(tok_->Encode("Tom's dog ran 3 km!", false, false),
              ElementsAre(274, 287, 439, 419, 400, 428, 352, 303, 410, 472, 409, 423, 443));
  // Characters outside the 512-token vocabulary fall back to their UTF-8 bytes.
  EXPECT_THAT(tok_->Encode("é 🦙 中", false, false),
              ElementsAre(410, 485, 410, 243, 162, 169, 156, 410, 231, 187, 176));
}

TEST_F(StoriesTest, DecodesTheReferenceStory) {
  const std::string story =
      testing::ReadFile(std::string(TANDEM_SHARED_MODELS_DIR) + "/stories260K/greedy-from-bos.txt");
  ASSERT_GT(story.size(), 100u);
  const std::vector<int32_t> ids = tok_->Encode(story, false, false);
  EXPECT_EQ(tok_->Decode(ids, false), story);
  // Streaming it after a BOS prints exactly the story, as llama2.c's run.c does.
  StreamingDecoder stream(*tok_, false);
  std::string out = stream.Push(tok_->bos_id());
  for (const int32_t id : ids) out += stream.Push(id);
  out += stream.Flush();
  EXPECT_EQ(out, story);
  EXPECT_EQ(tok_->Decode(std::vector<int32_t>{403, 407}, false), "Once upon");
}

TEST(TokenizerSpeedTest, EncodesTwoThousandTokensQuickly) {
  std::string skip;
  for (const char* name : {"llama-bpe", "llama-spm"}) {
    auto tok = LoadVocab(name, &skip);
    if (!skip.empty()) GTEST_SKIP() << skip;
    ASSERT_NE(tok, nullptr);
    std::string text;
    const std::string para =
        "The quick brown fox jumps over the lazy dog. In 2024, researchers measured 3.14159 "
        "units of déjà vu across 12 cities; «quoted» text, emojis 🦙🚀 and 中文字符 "
        "mixed "
        "in.\n"
        "    def f(x):\n        return x ** 2  # indented code\n";
    while (tok->Encode(text, false, false).size() < 2000) text += para;
    double best_ms = 1e9;
    size_t n = 0;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      n = tok->Encode(text, true, true).size();
      const auto t1 = std::chrono::steady_clock::now();
      best_ms = std::min(best_ms, std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    EXPECT_GE(n, 2000u);
    EXPECT_LT(best_ms, 50.0) << name << ": " << n << " tokens";
    RecordProperty(std::string(name) + "_ms", std::to_string(best_ms));
  }
}

}  // namespace
}  // namespace tandem::engine
