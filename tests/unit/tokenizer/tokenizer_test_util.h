// Shared helpers of the tokenizer tests: loading llama.cpp's vocab GGUFs and their test vectors.
#pragma once

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

namespace tandem::engine::testing {

inline std::string VocabPath(const std::string& name) {
  return std::string(TANDEM_VOCAB_DIR) + "/ggml-vocab-" + name + ".gguf";
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Loads a vocab GGUF; sets *skip_reason instead when the vocab cache is absent.
inline std::unique_ptr<Tokenizer> LoadVocab(const std::string& name, std::string* skip_reason) {
  const std::string path = VocabPath(name);
  if (!std::filesystem::exists(path)) {
    *skip_reason = "vocab file " + path +
                   " is missing; run scripts/fetch_vocab.sh (make test does) to fetch llama.cpp's "
                   "vocab GGUFs";
    return nullptr;
  }
  auto file = gguf::GgufFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return nullptr;
  auto tok = Tokenizer::FromGguf(**file);
  EXPECT_TRUE(tok.ok()) << name << ": " << tok.status();
  if (!tok.ok()) return nullptr;
  return std::move(*tok);
}

struct VocabCase {
  std::string text;
  std::vector<int32_t> ids;
};

// Parses <vocab>.gguf.inp / .gguf.out the way llama.cpp's test-tokenizer-0 does: inputs are
// separated by "\n__ggml_vocab_test__\n", outputs are one line of space-separated ids each.
inline std::vector<VocabCase> ReadVocabCases(const std::string& name) {
  const std::string inp = ReadFile(VocabPath(name) + ".inp");
  const std::string out = ReadFile(VocabPath(name) + ".out");
  std::vector<std::string> texts;
  const std::string sep = "\n__ggml_vocab_test__\n";
  for (size_t pos = 0; pos < inp.size();) {
    const size_t next = inp.find(sep, pos);
    if (next == std::string::npos) {
      texts.push_back(inp.substr(pos));
      break;
    }
    texts.push_back(inp.substr(pos, next - pos));
    pos = next + sep.size();
  }
  std::vector<std::string> lines;
  std::istringstream ls(out);
  for (std::string line; std::getline(ls, line);) lines.push_back(line);
  EXPECT_EQ(texts.size(), lines.size()) << name;
  std::vector<VocabCase> cases;
  for (size_t i = 0; i < texts.size() && i < lines.size(); ++i) {
    VocabCase c{texts[i], {}};
    std::istringstream ids(lines[i]);
    for (int32_t id; ids >> id;) c.ids.push_back(id);
    cases.push_back(std::move(c));
  }
  return cases;
}

}  // namespace tandem::engine::testing
