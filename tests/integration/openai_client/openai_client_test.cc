// The official `openai` npm client against a real cluster's HTTP front door: `tandem cluster up
// --http-port` with the real stories260K model, then openai_client.cjs runs completions and chat,
// streaming and not. The completion text must equal `tandem client`'s (gRPC) for the same
// greedy request, and the chat text must equal `tandem client`'s for the prompt the chat
// template renders (the model has no template: the chatml fallback, with <|im_end|> as a stop).
//
// Skips unless node, the package (scripts/fetch_openai_client.sh) and ../shared/models exist,
// so `make test` never needs the network.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/fakes/child_process.h"
#include "nlohmann/json.hpp"
#include "tests/fakes/shell_util.h"

namespace {

using ::tandem::testing::Quote;
using ::tandem::testing::Slurp;

namespace fs = std::filesystem;
using nlohmann::json;
using ::tandem::testing::FreePort;

const fs::path kModel = fs::path(TANDEM_SHARED_MODELS_DIR) / "stories260K" / "stories260K.gguf";
const std::string kBin = TANDEM_BIN_DIR;
const fs::path kScript = fs::path(TANDEM_OPENAI_CLIENT_DIR) / "openai_client.cjs";
const fs::path kPackageDir = TANDEM_OPENAI_CACHE_DIR;

struct Result {
  int exit_code = -1;
  std::string out, err;
};

Result RunCommand(const std::string& cmd, int timeout_s) {
  static std::atomic<int> seq{0};
  const fs::path tmp =
      fs::temp_directory_path() / absl::StrCat("tandem-openai-test-", getpid(), "-", seq++);
  fs::create_directories(tmp);
  const std::string full = absl::StrCat("timeout -k 5 ", timeout_s, " ", cmd, " >",
                                        (tmp / "out").string(), " 2>", (tmp / "err").string());
  Result r;
  const int st = std::system(full.c_str());
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.out = Slurp(tmp / "out");
  r.err = Slurp(tmp / "err");
  fs::remove_all(tmp);
  return r;
}

// A port nothing listens on right now (the kernel's pick for a socket bound and closed).

// `tandem client --json`'s completion text.
std::string ClientText(const std::string& router, const std::string& prompt, int max_tokens,
                       const std::string& extra = "") {
  const Result r = RunCommand(
      absl::StrCat(kBin, "/tandem client --router ", router, " --prompt ", Quote(prompt),
                   " --max-tokens ", max_tokens, " --temperature 0 --seed 0 --json", extra),
      120);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out, nullptr, false);
  EXPECT_TRUE(j.is_object() && j.contains("text")) << r.out;
  return j.is_object() && j.contains("text") ? j["text"].get<std::string>() : "";
}

TEST(OpenAiClientTest, OfficialClientMatchesTandemClient) {
  if (std::system("command -v node >/dev/null 2>&1") != 0) GTEST_SKIP() << "node is not installed";
  if (!fs::exists(kPackageDir / "node_modules" / "openai" / "package.json")) {
    GTEST_SKIP() << "the openai package is not cached: run scripts/fetch_openai_client.sh";
  }
  if (!fs::exists(kModel)) GTEST_SKIP() << kModel << " not present";
  const int http_port = FreePort();
  ASSERT_GT(http_port, 0);
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("tandem-openai-", getpid());
  fs::remove_all(dir);
  const Result up = RunCommand(
      absl::StrCat(kBin, "/tandem cluster up --model ", Quote(kModel.string()),
                   " --prefill 1 --decode 1 --dir ", Quote(dir.string()),
                   " --router-port 0 --http-port ", http_port,
                   " --threads 1 --transport ucx --ucx-tls shm --lease-ms 2000 --timeout-ms 90000"),
      150);
  struct Down {
    fs::path dir;
    ~Down() {
      RunCommand(
          absl::StrCat(kBin, "/tandem cluster down --grace-ms 5000 --dir ", Quote(dir.string())),
          60);
      if (!::testing::Test::HasFailure()) fs::remove_all(dir);
    }
  } down{dir};
  ASSERT_EQ(up.exit_code, 0) << up.err << up.out;
  const json state = json::parse(Slurp(dir / "cluster.json"), nullptr, false);
  ASSERT_TRUE(state.is_object()) << Slurp(dir / "cluster.json");
  const std::string router = state["router"].get<std::string>();

  const std::string prompt = "Once upon a time, there was a little girl named Lily.";
  constexpr int kMaxTokens = 24;
  const Result node = RunCommand(
      absl::StrCat("node ", Quote(kScript.string()), " --base-url ",
                   Quote(absl::StrCat("http://127.0.0.1:", http_port, "/v1")), " --prompt ",
                   Quote(prompt), " --max-tokens ", kMaxTokens,
                   " --temperature 0 --seed 0 --openai-dir ", Quote(kPackageDir.string())),
      180);
  std::printf("%s", node.out.c_str());
  ASSERT_EQ(node.exit_code, 0) << node.err << node.out;
  const json j = json::parse(node.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << node.out;

  // Completions: token for token what the gRPC client gets.
  const std::string grpc_text = ClientText(router, prompt, kMaxTokens);
  EXPECT_FALSE(grpc_text.empty());
  EXPECT_EQ(j["completion"], grpc_text);
  EXPECT_EQ(j["completion_stream"], grpc_text);
  EXPECT_EQ(j["completion_usage"]["completion_tokens"].get<int>() <= kMaxTokens, true);

  // Chat: the rendered prompt through the gRPC client gives the same answer.
  const std::string rendered =
      absl::StrCat("<|im_start|>user\n", prompt, "<|im_end|>\n<|im_start|>assistant\n");
  const std::string grpc_chat =
      ClientText(router, rendered, kMaxTokens, absl::StrCat(" --stop ", Quote("<|im_end|>")));
  EXPECT_EQ(j["chat"], grpc_chat);
  EXPECT_EQ(j["chat_stream"], grpc_chat);
  EXPECT_GT(j["chat_stream_usage"]["prompt_tokens"].get<int>(), 0);
  EXPECT_EQ(j["n2_status"], 400);
}

}  // namespace
