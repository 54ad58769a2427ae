// The `tandem` binary end to end: the real stories260K model prints its published greedy story
// byte for byte (from the shipped GGUF and from our llama2.c conversion), and bad input gives a
// clean error and exit code rather than a crash.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/fakes/shell_util.h"

namespace {

using ::tandem::testing::Slurp;

namespace fs = std::filesystem;

struct Result {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs the tandem CLI with arguments already shell-quoted by the caller.
Result RunTandem(const std::string& args) {
  const fs::path tmp = fs::temp_directory_path() / ("tandem-cli-" + std::to_string(getpid()));
  fs::create_directories(tmp);
  const std::string cmd = std::string(TANDEM_BIN_DIR) + "/tandem " + args + " >" +
                          (tmp / "out").string() + " 2>" + (tmp / "err").string();
  Result r;
  const int st = std::system(cmd.c_str());
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  auto slurp = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  r.out = slurp(tmp / "out");
  r.err = slurp(tmp / "err");
  fs::remove_all(tmp);
  return r;
}

const fs::path kStories = fs::path(TANDEM_SHARED_MODELS_DIR) / "stories260K";

class StoriesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kStories / "stories260K.gguf")) {
      GTEST_SKIP() << "no real model at " << kStories << " (../shared/models is absent)";
    }
  }
};

TEST_F(StoriesTest, GreedyFromBosMatchesPublishedStoryFromGguf) {
  Result r = RunTandem("generate --model " + (kStories / "stories260K.gguf").string() +
                       " --prompt '' --max-tokens 256 --temperature 0 --threads 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, Slurp(kStories / "greedy-from-bos.txt"));
}

TEST_F(StoriesTest, GreedyFromBosMatchesPublishedStoryFromConvertedLlama2c) {
  const fs::path out = fs::temp_directory_path() / ("stories-" + std::to_string(getpid()) + ".gguf");
  Result c = RunTandem("convert llama2c --model " + (kStories / "stories260K.bin").string() +
                       " --tokenizer " + (kStories / "tok512.bin").string() + " --out " +
                       out.string());
  ASSERT_EQ(c.exit_code, 0) << c.err;
  Result r = RunTandem("generate --model " + out.string() +
                       " --prompt '' --max-tokens 256 --temperature 0 --threads 1");
  fs::remove(out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, Slurp(kStories / "greedy-from-bos.txt"));
}

TEST_F(StoriesTest, JsonCarriesIdsTextAndTimings) {
  Result r = RunTandem("generate --model " + (kStories / "stories260K.gguf").string() +
                       " --prompt 'Once upon a time' --max-tokens 16 --temperature 0.7"
                       " --seed 3 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["prompt_tokens"][0], 1);  // BOS
  EXPECT_EQ(j["tokens"].size(), 16u);
  EXPECT_FALSE(j["text"].get<std::string>().empty());
  EXPECT_GT(j["timings"]["decode_tokens_per_s"].get<double>(), 0.0);
  // Same seed, same tokens.
  Result again = RunTandem("generate --model " + (kStories / "stories260K.gguf").string() +
                           " --prompt 'Once upon a time' --max-tokens 16 --temperature 0.7"
                           " --seed 3 --json");
  EXPECT_EQ(nlohmann::json::parse(again.out)["tokens"], j["tokens"]);
}

// --speculative ngram prints the same greedy story and says how many drafts it kept; forms it
// cannot run are refused before the model loads.
TEST_F(StoriesTest, SpeculativeNgramKeepsTheGreedyOutput) {
  const std::string base = "generate --model " + (kStories / "stories260K.gguf").string() +
                           " --prompt 'Lily saw a cat. Lily saw a dog. Lily saw a cat. Lily'"
                           " --max-tokens 64 --temperature 0 --ignore-eos --json";
  Result plain = RunTandem(base);
  Result spec = RunTandem(base + " --speculative ngram --spec-tokens 5");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ASSERT_EQ(spec.exit_code, 0) << spec.err;
  auto p = nlohmann::json::parse(plain.out), s = nlohmann::json::parse(spec.out);
  EXPECT_EQ(s["tokens"], p["tokens"]);
  EXPECT_EQ(s["text"], p["text"]);
  EXPECT_EQ(p["speculative"]["method"], "off");
  EXPECT_EQ(p["speculative"]["verify_steps"], 0);
  EXPECT_EQ(s["speculative"]["method"], "ngram");
  EXPECT_GT(s["speculative"]["accepted_tokens"].get<int64_t>(), 0);
  EXPECT_GT(s["speculative"]["mean_accept_length"].get<double>(), 1.0);
  EXPECT_LT(s["speculative"]["steps"].get<int64_t>(), p["speculative"]["steps"].get<int64_t>());
  EXPECT_EQ(s["speculative"]["accepted_hist"].size(), 6u);

  Result bad = RunTandem(base + " --speculative eagle");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("unknown --speculative"), std::string::npos) << bad.err;
  Result k = RunTandem(base + " --speculative ngram --spec-tokens 40");
  EXPECT_EQ(k.exit_code, 2);
  EXPECT_NE(k.err.find("--spec-tokens"), std::string::npos) << k.err;
  Result draft = RunTandem(base + " --speculative draft:/nowhere.gguf");
  EXPECT_EQ(draft.exit_code, 1);
  EXPECT_NE(draft.err.find("/nowhere.gguf"), std::string::npos) << draft.err;
  Result type = RunTandem(base + " --speculative self:q4_1");
  EXPECT_EQ(type.exit_code, 2);
  EXPECT_NE(type.err.find("not a weight type"), std::string::npos) << type.err;

  // The model as its own Q8_0 draft: the same story, with most drafts kept.
  Result self = RunTandem(base + " --speculative self:q8_0 --spec-tokens 4");
  ASSERT_EQ(self.exit_code, 0) << self.err;
  auto q = nlohmann::json::parse(self.out);
  EXPECT_EQ(q["tokens"], p["tokens"]);
  EXPECT_EQ(q["speculative"]["method"], "self");
  EXPECT_GT(q["speculative"]["mean_accept_length"].get<double>(), 2.0);
}

TEST_F(StoriesTest, PromptLongerThanContextIsACleanError) {
  std::string prompt;
  for (int i = 0; i < 200; ++i) prompt += "Lily went to the park. ";
  Result r = RunTandem("generate --model " + (kStories / "stories260K.gguf").string() +
                       " --ctx-size 64 --max-tokens 4 --prompt '" + prompt + "'");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("INVALID_ARGUMENT"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("context"), std::string::npos) << r.err;
}

// --device cuda either runs (a CUDA build on a GPU machine: the JSON says so and has every
// token) or fails at start with FAILED_PRECONDITION saying why; it never crashes.
TEST_F(StoriesTest, DeviceCudaRunsOrFailsCleanly) {
  Result r = RunTandem("generate --model " + (kStories / "stories260K.gguf").string() +
                       " --prompt 'Once upon a time' --max-tokens 16 --temperature 0"
                       " --kv-type f16 --device cuda --json");
  if (r.exit_code == 0) {
    auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["device"], "cuda");
    EXPECT_EQ(j["tokens"].size(), 16u);
    return;
  }
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("FAILED_PRECONDITION"), std::string::npos) << r.err;
  EXPECT_TRUE(r.err.find("built without CUDA") != std::string::npos ||
              r.err.find("no CUDA device") != std::string::npos)
      << r.err;
}

TEST(CliTest, UnknownDeviceIsAnInvalidArgument) {
  Result r = RunTandem("generate --model /nonexistent/m.gguf --prompt hi --device tpu");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("unknown device 'tpu'"), std::string::npos) << r.err;
}

TEST(CliTest, TruncatedModelIsACleanError) {
  const fs::path p = fs::temp_directory_path() / ("trunc-" + std::to_string(getpid()) + ".gguf");
  {
    std::ofstream f(p, std::ios::binary);
    f.write("GGUF\x03\x00\x00\x00\x05\x00", 10);  // header cut short
  }
  Result r = RunTandem("generate --model " + p.string() + " --prompt hi --max-tokens 2");
  fs::remove(p);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("tandem: error"), std::string::npos) << r.err;
}

TEST(CliTest, MissingModelIsNotFound) {
  Result r = RunTandem("generate --model /nonexistent/m.gguf --prompt hi");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("NOT_FOUND"), std::string::npos) << r.err;
}

TEST(CliTest, BadSamplingValueNamesTheField) {
  if (!fs::exists(kStories / "stories260K.gguf")) GTEST_SKIP() << "no real model";
  Result r = RunTandem("generate --model " + (kStories / "stories260K.gguf").string() +
                       " --prompt hi --top-p 1.5");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("top_p"), std::string::npos) << r.err;
}

}  // namespace
