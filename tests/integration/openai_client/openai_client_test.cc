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
#include <regex>
#include <sstream>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tandem/v1/inference.grpc.pb.h"
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

const fs::path kClients = fs::path(TANDEM_OPENAI_CLIENT_DIR);
const std::string kPrompt = "Once upon a time, there was a little girl named Lily.";

// One real cluster (one prefill, one decode worker, the router with its HTTP front door) for
// every test of the suite.
class OpenAiClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system("command -v node >/dev/null 2>&1") != 0) {
      skip_ = "node is not installed";
      return;
    }
    if (!fs::exists(kPackageDir / "node_modules" / "openai" / "package.json")) {
      skip_ = "the clients are not cached: run scripts/fetch_openai_client.sh";
      return;
    }
    if (!fs::exists(kModel)) {
      skip_ = kModel.string() + " not present";
      return;
    }
    http_port_ = FreePort();
    ASSERT_GT(http_port_, 0);
    dir_ = fs::temp_directory_path() / absl::StrCat("tandem-openai-", getpid());
    fs::remove_all(dir_);
    const Result up = RunCommand(
        absl::StrCat(kBin, "/tandem cluster up --model ", Quote(kModel.string()),
                     " --prefill 1 --decode 1 --dir ", Quote(dir_.string()),
                     " --router-port 0 --http-port ", http_port_,
                     " --threads 1 --transport ucx --ucx-tls shm --lease-ms 2000"
                     " --timeout-ms 90000"),
        150);
    up_ = true;
    ASSERT_EQ(up.exit_code, 0) << up.err << up.out;
    const json state = json::parse(Slurp(dir_ / "cluster.json"), nullptr, false);
    ASSERT_TRUE(state.is_object()) << Slurp(dir_ / "cluster.json");
    router_ = state["router"].get<std::string>();
  }
  static void TearDownTestSuite() {
    if (!up_) return;
    RunCommand(
        absl::StrCat(kBin, "/tandem cluster down --grace-ms 5000 --dir ", Quote(dir_.string())),
        60);
    if (!::testing::Test::HasFailure()) fs::remove_all(dir_);
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
    ASSERT_FALSE(router_.empty()) << "the cluster did not come up";
  }
  static std::string BaseUrl() { return absl::StrCat("http://127.0.0.1:", http_port_, "/v1"); }
  // Runs a client script of this folder; its one line of JSON output.
  static json Script(const std::string& name, const std::string& args, int* exit_code) {
    const Result r = RunCommand(absl::StrCat("node ", Quote((kClients / name).string()),
                                             " --base-url ", Quote(BaseUrl()), " ", args),
                                300);
    std::printf("%s\n%s", name.c_str(), r.out.c_str());
    if (r.exit_code != 0) std::printf("%s\n", r.err.c_str());
    *exit_code = r.exit_code;
    return json::parse(r.out, nullptr, false);
  }

  static inline std::string skip_;
  static inline int http_port_ = 0;
  static inline fs::path dir_;
  static inline bool up_ = false;
  static inline std::string router_;
};

TEST_F(OpenAiClientTest, OfficialClientMatchesTandemClient) {
  const std::string& router = router_;
  const std::string prompt = kPrompt;
  constexpr int kMaxTokens = 24;
  const Result node = RunCommand(
      absl::StrCat("node ", Quote(kScript.string()), " --base-url ", Quote(BaseUrl()),
                   " --prompt ", Quote(prompt), " --max-tokens ", kMaxTokens,
                   " --temperature 0 --seed 0 --deps ", Quote(kPackageDir.string())),
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
  // The gRPC Chat rpc renders the same prompt.
  auto stub = tandem::v1::Inference::NewStub(
      grpc::CreateChannel(router, grpc::InsecureChannelCredentials()));
  tandem::v1::GenerateResponse last;  // the last message of the last call
  auto chat = [&](const tandem::v1::ChatRequest& req, std::string* text) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = stub->Chat(&ctx, req);
    tandem::v1::GenerateResponse m;
    while (reader->Read(&m)) {
      *text += m.text();
      EXPECT_TRUE(m.finished() || m.tool_calls().empty());  // calls come with the last message
      last = m;
    }
    return reader->Finish();
  };
  tandem::v1::ChatRequest creq;
  tandem::v1::ChatMessage* user = creq.add_messages();
  user->set_role("user");
  user->set_content(prompt);
  creq.mutable_sampling()->set_max_tokens(kMaxTokens);
  creq.mutable_sampling()->set_temperature(0);
  std::string grpc_chat_rpc;
  const grpc::Status cst = chat(creq, &grpc_chat_rpc);
  ASSERT_TRUE(cst.ok()) << cst.error_message();
  EXPECT_EQ(grpc_chat_rpc, grpc_chat);
  tandem::v1::ChatRequest bad = creq;
  bad.mutable_messages(0)->set_role("narrator");
  std::string ignored;
  const grpc::Status bst = chat(bad, &ignored);
  EXPECT_EQ(bst.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bst.error_message().find("messages[0].role"), std::string::npos)
      << bst.error_message();
  // A regex and a GBNF grammar in gRPC's response format: the whole answer matches.
  for (const auto& [regex, grammar, reference] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"(north|south|east|west), [1-9][0-9]? steps", "",
            "(north|south|east|west), [1-9][0-9]? steps"},
           {"", "root ::= \"Hello, \" name \"!\"\nname ::= [A-Z] [a-z]{1,8}",
            "Hello, [A-Z][a-z]{1,8}!"}}) {
    tandem::v1::ChatRequest f = creq;
    if (!regex.empty()) f.mutable_sampling()->mutable_response_format()->set_regex(regex);
    if (!grammar.empty()) f.mutable_sampling()->mutable_response_format()->set_grammar(grammar);
    f.mutable_sampling()->set_max_tokens(40);
    std::string text;
    const grpc::Status fst = chat(f, &text);
    ASSERT_TRUE(fst.ok()) << fst.error_message();
    EXPECT_TRUE(std::regex_match(text, std::regex(reference))) << text;
    EXPECT_EQ(last.finish_reason(), tandem::v1::FINISH_REASON_STOP) << text;
  }
  // Tools over gRPC: a required call comes back as tool_calls on the finished message, with
  // arguments its schema allows; its result in a tool turn gets an answer.
  tandem::v1::ChatRequest treq = creq;
  tandem::v1::Tool* tool = treq.add_tools();
  tool->set_name("look_around");
  tool->set_description("What the player sees");
  tool->set_parameters(R"({"type": "object", "additionalProperties": false,
      "required": ["direction"],
      "properties": {"direction": {"enum": ["north", "south", "east", "west"]}}})");
  treq.set_tool_choice("required");
  treq.mutable_sampling()->set_max_tokens(60);
  std::string call_text;
  const grpc::Status tst = chat(treq, &call_text);
  ASSERT_TRUE(tst.ok()) << tst.error_message();
  ASSERT_EQ(last.tool_calls_size(), 1) << call_text;
  EXPECT_EQ(last.tool_calls(0).name(), "look_around");
  EXPECT_EQ(last.tool_calls(0).id().rfind("call_", 0), 0u);
  const json grpc_args = json::parse(last.tool_calls(0).arguments(), nullptr, false);
  ASSERT_TRUE(grpc_args.is_object()) << call_text;
  EXPECT_TRUE(grpc_args["direction"].is_string() && grpc_args.size() == 1u) << call_text;
  tandem::v1::ChatRequest answer = treq;
  answer.set_tool_choice("none");
  tandem::v1::ChatMessage* asked = answer.add_messages();
  asked->set_role("assistant");
  *asked->add_tool_calls() = last.tool_calls(0);
  tandem::v1::ChatMessage* result = answer.add_messages();
  result->set_role("tool");
  result->set_tool_call_id(last.tool_calls(0).id());
  result->set_content("A dragon sleeps on a pile of gold.");
  std::string answer_text;
  const grpc::Status ast = chat(answer, &answer_text);
  ASSERT_TRUE(ast.ok()) << ast.error_message();
  EXPECT_FALSE(answer_text.empty());
  EXPECT_EQ(last.tool_calls_size(), 0);
  for (const auto& [choice, params, needle] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"look_up", "{}", "not one of the tools"},
           {"required", "{\"type\": ", "tools[0].parameters is not valid JSON"},
           {"required", std::string(100, '[') + std::string(100, ']'), "nests deeper"}}) {
    tandem::v1::ChatRequest b = treq;
    b.set_tool_choice(choice);
    b.mutable_tools(0)->set_parameters(params);
    const grpc::Status st = chat(b, &ignored);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << choice << params;
    EXPECT_NE(st.error_message().find(needle), std::string::npos) << st.error_message();
  }
  EXPECT_GT(j["chat_stream_usage"]["prompt_tokens"].get<int>(), 0);

  // Log-probabilities of greedy tokens: each token is its own best alternative, in order.
  const json& lp = j["chat_logprobs"];
  ASSERT_TRUE(lp.is_array());
  ASSERT_FALSE(lp.empty());
  std::string joined;
  for (const json& t : lp) {
    joined += t["token"].get<std::string>();
    EXPECT_LE(t["logprob"].get<double>(), 0.0) << t;
    EXPECT_GT(t["bytes"].get<int>(), 0) << t;
    ASSERT_EQ(t["top"].size(), 3u) << t;
    EXPECT_EQ(t["top"][0][0], t["token"]) << t;
    EXPECT_DOUBLE_EQ(t["top"][0][1].get<double>(), t["logprob"].get<double>()) << t;
    EXPECT_GE(t["top"][0][1].get<double>(), t["top"][1][1].get<double>()) << t;
    EXPECT_GE(t["top"][1][1].get<double>(), t["top"][2][1].get<double>()) << t;
  }
  // The tokens spell the answer (the end-of-turn token, when generated, is not text).
  EXPECT_EQ(joined.rfind(j["chat_logprobs_text"].get<std::string>(), 0), 0u) << joined;
  EXPECT_EQ(j["chat_stream_logprobs"].get<size_t>(), lp.size());
  const json& clp = j["completion_logprobs"];
  ASSERT_EQ(clp["tokens"].size(), clp["token_logprobs"].size());
  ASSERT_EQ(clp["tokens"].size(), clp["text_offset"].size());
  EXPECT_EQ(clp["tokens"].size(), j["completion_usage"]["completion_tokens"].get<size_t>());
  EXPECT_EQ(clp["text_offset"][0], 0);

  // n = 2: two choices, indexed, with the prompt counted once and both choices' tokens.
  ASSERT_EQ(j["n2"].size(), 2u);
  EXPECT_EQ(j["n2"][0]["index"], 0);
  EXPECT_EQ(j["n2"][1]["index"], 1);
  EXPECT_NE(j["n2"][0]["text"], j["n2"][1]["text"]) << "seeded choices must differ";
  EXPECT_EQ(j["n2_usage"]["prompt_tokens"], j["completion_usage"]["prompt_tokens"]);
  EXPECT_GT(j["n2_usage"]["completion_tokens"].get<int>(), kMaxTokens / 2);
  ASSERT_EQ(j["n2_chat_stream"].size(), 2u);
  EXPECT_FALSE(j["n2_chat_stream"][0].get<std::string>().empty());
  EXPECT_FALSE(j["n2_chat_stream"][1].get<std::string>().empty());
  EXPECT_NE(j["n2_chat_stream"][0], j["n2_chat_stream"][1]);
  EXPECT_GT(j["n2_chat_stream_usage"]["completion_tokens"].get<int>(), 0);

  EXPECT_EQ(j["echo"], prompt + grpc_text);

  // Structured output on the real model: every sampled answer parses and has the schema's
  // fields and types.
  ASSERT_EQ(j["json_schema"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const std::string text = j["json_schema"][i].get<std::string>();
    EXPECT_EQ(j["json_schema_finish"][i], "stop") << text;
    const json v = json::parse(text, nullptr, false);
    ASSERT_TRUE(v.is_object()) << text;
    EXPECT_EQ(v.size(), 4u) << text;
    ASSERT_TRUE(v["name"].is_string()) << text;
    EXPECT_GE(v["name"].get<std::string>().size(), 1u) << text;
    EXPECT_TRUE(v["mood"] == "happy" || v["mood"] == "sad" || v["mood"] == "scared") << text;
    EXPECT_TRUE(v["age"].is_number_integer()) << text;
    ASSERT_TRUE(v["friends"].is_array()) << text;
    EXPECT_LE(v["friends"].size(), 3u) << text;
    for (const json& f : v["friends"]) EXPECT_TRUE(f.is_string()) << text;
  }
  // The tool call: the named tool with arguments its schema allows; then the answer to the
  // tool's result; streamed, the call arrives whole.
  EXPECT_EQ(j["tool_finish"], "tool_calls");
  ASSERT_EQ(j["tool_calls"].size(), 1u) << j["tool_calls"];
  EXPECT_EQ(j["tool_calls"][0]["type"], "function");
  EXPECT_EQ(j["tool_calls"][0]["function"]["name"], "look_around");
  const json args = json::parse(j["tool_calls"][0]["function"]["arguments"].get<std::string>(),
                                nullptr, false);
  ASSERT_TRUE(args.is_object()) << j["tool_calls"];
  EXPECT_EQ(args.size(), 1u);
  EXPECT_TRUE(args["direction"] == "north" || args["direction"] == "south" ||
              args["direction"] == "east" || args["direction"] == "west")
      << args;
  EXPECT_TRUE(j["tool_answer"].is_string() && !j["tool_answer"].get<std::string>().empty())
      << j["tool_answer"];
  EXPECT_EQ(j["tool_stream_finish"], "tool_calls");
  EXPECT_EQ(j["tool_stream_call"]["function"]["name"], "look_around");
  EXPECT_TRUE(json::parse(j["tool_stream_call"]["function"]["arguments"].get<std::string>(),
                          nullptr, false)
                  .is_object());

  // Any JSON object: a story model may write one string until max_tokens, so a cut-off answer
  // is allowed, but what it wrote is an object's beginning, and a finished one parses.
  const std::string obj = j["json_object"].get<std::string>();
  EXPECT_EQ(obj.rfind("{", 0), 0u) << obj;
  if (j["json_object_finish"] == "stop") {
    EXPECT_TRUE(json::parse(obj, nullptr, false).is_object()) << obj;
  } else {
    EXPECT_EQ(j["json_object_finish"], "length");
  }
}

// Every response and chunk validates against schemas generated from the openai package's types.
TEST_F(OpenAiClientTest, ResponsesConformToTheOpenAiTypes) {
  int rc = -1;
  const json j = Script("conformance.cjs",
                        absl::StrCat("--prompt ", Quote(kPrompt), " --deps ",
                                     Quote(kPackageDir.string())),
                        &rc);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(rc, 0);
  EXPECT_GT(j["checked"].get<int>(), 30);
  EXPECT_TRUE(j["failures"].empty()) << j["failures"].dump(2);
}

// The Vercel AI SDK and LangChain complete, stream and call a tool; both give the text of the
// gRPC client for the rendered prompt.
TEST_F(OpenAiClientTest, AiSdkAndLangChainCompleteAndStream) {
  int rc = -1;
  const json j = Script("sdk_clients.cjs",
                        absl::StrCat("--prompt ", Quote(kPrompt), " --max-tokens 16 --deps ",
                                     Quote(kPackageDir.string())),
                        &rc);
  ASSERT_EQ(rc, 0);
  ASSERT_TRUE(j.is_object());
  const std::string rendered =
      absl::StrCat("<|im_start|>user\n", kPrompt, "<|im_end|>\n<|im_start|>assistant\n");
  const std::string grpc_chat =
      ClientText(router_, rendered, 16, absl::StrCat(" --stop ", Quote("<|im_end|>")));
  EXPECT_EQ(j["ai"], grpc_chat);
  EXPECT_EQ(j["langchain"], grpc_chat);
  EXPECT_GT(j["ai_usage"]["outputTokens"].get<int>(), 0) << j["ai_usage"];
  ASSERT_EQ(j["ai_tool_calls"].size(), 1u);
  EXPECT_EQ(j["ai_tool_calls"][0]["name"], "look_around");
  ASSERT_EQ(j["langchain_tool_calls"].size(), 1u);
  EXPECT_EQ(j["langchain_tool_calls"][0]["name"], "look_around");
}

// `buf curl` finds the services through reflection and calls Generate, Chat and the health
// check with no .proto files at hand.
TEST_F(OpenAiClientTest, BufCurlCallsThroughReflection) {
  const fs::path buf = kPackageDir / "node_modules" / "@bufbuild" / "buf-linux-x64" / "bin" / "buf";
  if (!fs::exists(buf)) GTEST_SKIP() << buf << " is not installed";
  const std::string url = absl::StrCat("http://", router_);
  const std::string curl =
      absl::StrCat(Quote(buf.string()), " curl --protocol grpc --http2-prior-knowledge ");
  const Result list = RunCommand(absl::StrCat(curl, "--list-services ", url), 60);
  ASSERT_EQ(list.exit_code, 0) << list.err;
  for (const char* svc : {"tandem.v1.Inference", "grpc.health.v1.Health", "tandem.v1.Registry"}) {
    EXPECT_NE(list.out.find(svc), std::string::npos) << list.out;
  }
  const Result health =
      RunCommand(absl::StrCat(curl, "-d '{}' ", url, "/grpc.health.v1.Health/Check"), 60);
  ASSERT_EQ(health.exit_code, 0) << health.err;
  EXPECT_NE(health.out.find("SERVING"), std::string::npos) << health.out;
  const std::string grpc_text = ClientText(router_, kPrompt, 12);
  const Result gen = RunCommand(
      absl::StrCat(curl, "-d ",
                   Quote(json({{"text", kPrompt},
                               {"sampling", {{"max_tokens", 12}, {"temperature", 0}}}})
                             .dump()),
                   " ", url, "/tandem.v1.Inference/Generate"),
      60);
  ASSERT_EQ(gen.exit_code, 0) << gen.err;
  // One JSON object per streamed message; their texts joined are the gRPC client's.
  std::string text;
  std::istringstream in(gen.out);
  std::string buffered, line;
  while (std::getline(in, line)) {
    buffered += line;
    const json m = json::parse(buffered, nullptr, false);
    if (m.is_discarded()) continue;
    buffered.clear();
    text += m.value("text", "");
  }
  EXPECT_EQ(text, grpc_text) << gen.out;
  const Result chat = RunCommand(
      absl::StrCat(curl, "-d ",
                   Quote(json({{"messages", {{{"role", "user"}, {"content", kPrompt}}}},
                               {"sampling", {{"max_tokens", 8}, {"temperature", 0}}}})
                             .dump()),
                   " ", url, "/tandem.v1.Inference/Chat"),
      60);
  ASSERT_EQ(chat.exit_code, 0) << chat.err;
  EXPECT_NE(chat.out.find("\"finished\": true"), std::string::npos) << chat.out;
}

}  // namespace
