// The OpenAI translation layer without a network: request parsing into GenerateRequest, the
// response and SSE chunk shapes, status-to-HTTP mapping; plus the disconnect watcher on a real
// loopback TCP connection.
#include "services/router/http_openai.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "engine/sampling/grammar_text.h"
#include "gtest/gtest.h"
#include "services/router/http_connection.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::router {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

class HttpOpenAiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path =
        (fs::temp_directory_path() / absl::StrCat("http-openai-", getpid(), ".gguf")).string();
    ASSERT_TRUE(testing::WriteTinyModel(testing::TinyModelOptions(), path).ok());
    auto m = RouterModel::Load(path, "tiny", 0);
    fs::remove(path);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = m->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }

  std::optional<HttpError> Parse(ApiKind kind, const std::string& body, OpenAiRequest* out) {
    return ParseOpenAiRequest(kind, body, *model_, chat_, out);
  }
  ::testing::AssertionResult Parses(ApiKind kind, const std::string& body, OpenAiRequest* out) {
    std::optional<HttpError> e = Parse(kind, body, out);
    if (!e) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << e->param << ": " << e->message;
  }
  HttpError ParseError(ApiKind kind, const std::string& body) {
    OpenAiRequest r;
    std::optional<HttpError> e = Parse(kind, body, &r);
    EXPECT_TRUE(e.has_value()) << body;
    return e.value_or(HttpError{});
  }

  static RouterModel* model_;
  ChatTemplate chat_;  // the fallback: the tiny model has no template
};

RouterModel* HttpOpenAiTest::model_ = nullptr;

TEST_F(HttpOpenAiTest, CompletionFieldsMapToTheGenerateRequest) {
  OpenAiRequest r;
  auto e = Parse(ApiKind::kCompletion,
                 R"({"model": "tiny", "prompt": "hello", "max_tokens": 7, "temperature": 0.5,
                     "top_p": 0.9, "seed": 42, "stop": ["a", "bc"], "n": 1, "top_k": 3,
                     "presence_penalty": 0.25, "frequency_penalty": -0.5, "user": "x",
                     "stream": true, "stream_options": {"include_usage": true}})",
                 &r);
  ASSERT_FALSE(e.has_value()) << e->message;
  EXPECT_EQ(r.kind, ApiKind::kCompletion);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.model, "tiny");
  EXPECT_EQ(r.id.rfind("cmpl-", 0), 0u) << r.id;
  EXPECT_EQ(r.generate.request_id(), r.id);
  EXPECT_GT(r.created, 1600000000);
  const v1::GenerateRequest& g = r.generate;
  EXPECT_EQ(g.text(), "hello");
  EXPECT_EQ(g.sampling().max_tokens(), 7);
  EXPECT_FLOAT_EQ(g.sampling().temperature(), 0.5f);
  EXPECT_FLOAT_EQ(g.sampling().top_p(), 0.9f);
  EXPECT_EQ(g.sampling().seed(), 42u);
  ASSERT_EQ(g.sampling().stop_size(), 2);
  EXPECT_EQ(g.sampling().stop(1), "bc");
  EXPECT_EQ(g.sampling().top_k(), 3);
  EXPECT_FLOAT_EQ(g.sampling().presence_penalty(), 0.25f);
  EXPECT_FLOAT_EQ(g.sampling().frequency_penalty(), -0.5f);

  // Defaults: max_tokens 16, temperature left to the server, a random seed, no stops.
  OpenAiRequest d1, d2;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt": "x", "stop": "end"})", &d1));
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt": "x"})", &d2));
  EXPECT_EQ(d1.generate.sampling().max_tokens(), 16);
  EXPECT_FALSE(d1.generate.sampling().has_temperature());
  EXPECT_EQ(d1.generate.sampling().stop_size(), 1);
  EXPECT_NE(d1.generate.sampling().seed(), d2.generate.sampling().seed());
  EXPECT_NE(d1.id, d2.id);
  EXPECT_EQ(d1.model, "tiny");  // the served id when the request names none
  EXPECT_FALSE(d1.stream);
  // The speculative extension field: unset leaves it to the workers, false opts out.
  EXPECT_FALSE(d1.generate.sampling().has_speculative());
  OpenAiRequest off;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt": "x", "speculative": false})", &off));
  ASSERT_TRUE(off.generate.sampling().has_speculative());
  EXPECT_FALSE(off.generate.sampling().speculative());
  // The priority extension field: the admission class; unset is UNSPECIFIED (standard).
  EXPECT_EQ(d1.generate.priority(), v1::PRIORITY_UNSPECIFIED);
  for (const auto& [name, want] :
       std::vector<std::pair<std::string, v1::Priority>>{{"interactive", v1::PRIORITY_INTERACTIVE},
                                                         {"standard", v1::PRIORITY_STANDARD},
                                                         {"batch", v1::PRIORITY_BATCH}}) {
    OpenAiRequest p;
    ASSERT_FALSE(Parse(ApiKind::kChat,
                       absl::StrCat(R"({"messages": [{"role": "user", "content": "hi"}], )",
                                    R"("priority": ")", name, R"("})"),
                       &p));
    EXPECT_EQ(p.generate.priority(), want) << name;
  }

  // OpenAI's end-user id is the conversation's session id (decode affinity); unset: none.
  EXPECT_TRUE(d1.generate.session_id().empty());
  OpenAiRequest u;
  ASSERT_FALSE(Parse(ApiKind::kChat,
                     R"({"messages": [{"role": "user", "content": "hi"}], "user": "npc-7"})", &u));
  EXPECT_EQ(u.generate.session_id(), "npc-7");

  // Token-id prompts, bare or wrapped in a one-element batch.
  OpenAiRequest t;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt": [[1, 260, 261]]})", &t));
  ASSERT_EQ(t.generate.token_ids().ids_size(), 3);
  EXPECT_EQ(t.generate.token_ids().ids(1), 260);
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt": ["only"]})", &t));
  EXPECT_EQ(t.generate.text(), "only");
}

TEST_F(HttpOpenAiTest, ChatRendersMessagesAndFillsTheContext) {
  OpenAiRequest r;
  auto e = Parse(ApiKind::kChat,
                 R"({"messages": [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                               {"type": "text", "text": "you"}]}],
                     "max_completion_tokens": 9})",
                 &r);
  ASSERT_FALSE(e.has_value()) << e->message;
  EXPECT_EQ(r.id.rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(r.generate.text(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi you<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(r.generate.sampling().max_tokens(), 9);
  // The fallback template's end marker is a stop string.
  ASSERT_EQ(r.generate.sampling().stop_size(), 1);
  EXPECT_EQ(r.generate.sampling().stop(0), "<|im_end|>");

  // Without max_tokens: whatever the context leaves after the prompt.
  OpenAiRequest d;
  ASSERT_FALSE(Parse(ApiKind::kChat, R"({"messages": [{"role": "user", "content": "Hi"}]})", &d));
  const size_t n = model_->tokenizer().Encode(d.generate.text(), true, true).size();
  EXPECT_EQ(d.generate.sampling().max_tokens(), model_->ctx_size() - static_cast<int>(n));
}

TEST_F(HttpOpenAiTest, BadRequestsNameTheParam) {
  struct Case {
    ApiKind kind;
    std::string body, param, needle;
  };
  const std::vector<Case> cases = {
      {ApiKind::kCompletion, "{not json", "", "not valid JSON"},
      {ApiKind::kCompletion, R"({"prompt": "x", "metadata": )" + std::string(65, '[') +
                                 std::string(65, ']') + "}",
       "", "deeper than 64"},
      {ApiKind::kCompletion, "[1, 2]", "", "JSON object"},
      {ApiKind::kCompletion, R"({"prompt": "x", "n": 0})", "n", "[1, 16]"},
      {ApiKind::kCompletion, R"({"prompt": "x", "n": 17})", "n", "[1, 16]"},
      {ApiKind::kCompletion, R"({"prompt": "x", "n": 2, "best_of": 3})", "best_of", "equal n"},
      {ApiKind::kCompletion, R"({"prompt": "x", "echo": true, "logprobs": 1})", "echo",
       "logprobs"},
      {ApiKind::kChat, R"({"messages": [{"role": "user", "content": "x"}], "echo": true})",
       "echo", "completions only"},
      {ApiKind::kCompletion, R"({"prompt": "x", "model": "gpt-4"})", "model", "gpt-4"},
      {ApiKind::kCompletion, R"({"prompt": "x", "max_tokens": "5"})", "max_tokens", "integer"},
      {ApiKind::kCompletion, R"({"prompt": "x", "max_tokens": 0})", "max_tokens", "[1,"},
      {ApiKind::kCompletion, R"({"prompt": "x", "temperature": "hot"})", "temperature", "number"},
      {ApiKind::kCompletion, R"({"prompt": "x", "stop": 3})", "stop", "string"},
      {ApiKind::kCompletion, R"({"prompt": "x", "stop": ["a", 1]})", "stop", "stop[1]"},
      {ApiKind::kCompletion, R"({"prompt": "x", "stream": "yes"})", "stream", "boolean"},
      {ApiKind::kCompletion, R"({"prompt": "x", "speculative": 0})", "speculative", "boolean"},
      {ApiKind::kCompletion, R"({"prompt": "x", "priority": "urgent"})", "priority", "urgent"},
      {ApiKind::kCompletion, R"({"prompt": "x", "priority": 1})", "priority", "string"},
      {ApiKind::kCompletion, R"({"prompt": "x", "stream_options": {"include_usage": true}})",
       "stream_options", "stream: true"},
      {ApiKind::kCompletion, R"({"prompt": "x", "logprobs": 21})", "logprobs", "[0, 20]"},
      {ApiKind::kCompletion, R"({"prompt": "x", "logprobs": true})", "logprobs", "integer"},
      {ApiKind::kChat, R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})",
       "top_logprobs", "needs logprobs"},
      {ApiKind::kChat,
       R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true,
           "top_logprobs": -1})",
       "top_logprobs", "[0, 20]"},
      {ApiKind::kCompletion, R"({"prompt": "x", "best_of": 3})", "best_of", "best_of"},
      {ApiKind::kCompletion, R"({"max_tokens": 3})", "prompt", "prompt is required"},
      {ApiKind::kCompletion, R"({"prompt": ["a", "b"]})", "prompt", "one prompt"},
      {ApiKind::kCompletion, R"({"prompt": [1, 99999]})", "prompt", "prompt[1]"},
      {ApiKind::kCompletion, R"({"prompt": 5})", "prompt", "prompt must be"},
      {ApiKind::kChat, R"({"prompt": "x"})", "messages", "messages is required"},
      {ApiKind::kChat, R"({"messages": []})", "messages", "must not be empty"},
      {ApiKind::kChat, R"({"messages": [{"content": "x"}]})", "messages[0].role", "role"},
      {ApiKind::kChat, R"({"messages": [{"role": "ghost", "content": "x"}]})", "messages[0].role",
       "ghost"},
      {ApiKind::kChat,
       R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})",
       "messages[0].content", "text"},
      {ApiKind::kChat, R"({"messages": [{"role": "user", "content": "x"}], "tools": [{}]})",
       "tools[0]", "must be"},
      {ApiKind::kChat,
       R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}})",
       "response_format.type", "json_schema"},
      {ApiKind::kChat,
       R"({"messages": [{"role": "user", "content": "x"}],
           "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})",
       "response_format.json_schema.schema", "required"},
      {ApiKind::kCompletion, R"({"prompt": "x", "response_format": "json"})", "response_format",
       "object"},
      {ApiKind::kCompletion, R"({"prompt": "x", "structured_outputs": {"json": {}}})",
       "structured_outputs", "one of"},
      {ApiKind::kCompletion,
       R"({"prompt": "x", "structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}})",
       "structured_outputs", "one of"},
      {ApiKind::kCompletion, R"({"prompt": "x", "structured_outputs": {"regex": 5}})",
       "structured_outputs.regex", "string"},
      {ApiKind::kCompletion, R"({"prompt": "x", "structured_outputs": {"choice": []}})",
       "structured_outputs.choice", "non-empty"},
      {ApiKind::kCompletion,
       R"({"prompt": "x", "response_format": {"type": "json_object"},
           "structured_outputs": {"regex": "a"}})",
       "structured_outputs", "cannot be combined"},
  };
  for (const Case& c : cases) {
    const HttpError e = ParseError(c.kind, c.body);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << ": " << e.message;
    EXPECT_NE(e.message.find(c.needle), std::string::npos) << c.body << ": " << e.message;
    EXPECT_EQ(e.type, "invalid_request_error");
  }
  EXPECT_EQ(ParseError(ApiKind::kCompletion, R"({"prompt": "x", "model": "gpt-4"})").code,
            "model_not_found");
  // Brackets inside strings are text, not nesting.
  OpenAiRequest deep;
  EXPECT_FALSE(Parse(ApiKind::kCompletion,
                     R"({"prompt": ")" + std::string(100, '[') + R"(\"{"})", &deep));
  // null means unset, as OpenAI's clients send it.
  OpenAiRequest r;
  EXPECT_FALSE(Parse(ApiKind::kCompletion,
                     R"({"prompt": "x", "stop": null, "n": null, "logprobs": null,
                         "stream_options": null, "echo": false, "suffix": null})",
                     &r));
}

TEST_F(HttpOpenAiTest, StatusesMapToHttpCodes) {
  struct Case {
    absl::Status st;
    int http;
    std::string type, param;
  };
  const std::vector<Case> cases = {
      {absl::InvalidArgumentError("sampling.temperature must be >= 0, got -1"), 400,
       "invalid_request_error", "temperature"},
      {absl::InvalidArgumentError("sampling.stop_strings must not be empty"), 400,
       "invalid_request_error", "stop"},
      {absl::InvalidArgumentError("prompt has 300 tokens; the context holds 256"), 400,
       "invalid_request_error", "prompt"},
      {absl::NotFoundError("model 'x' is not served here"), 400, "invalid_request_error", "model"},
      {absl::ResourceExhaustedError("full"), 429, "rate_limit_error", ""},
      {absl::UnavailableError("no worker"), 503, "service_unavailable_error", ""},
      {absl::DeadlineExceededError("late"), 504, "timeout_error", ""},
      {absl::InternalError("boom"), 500, "server_error", ""},
      {absl::DataLossError("bits"), 500, "server_error", ""},
  };
  for (const Case& c : cases) {
    const HttpError e = ErrorFromStatus(c.st, ApiKind::kCompletion);
    EXPECT_EQ(e.status, c.http) << c.st;
    EXPECT_EQ(e.type, c.type) << c.st;
    EXPECT_EQ(e.param, c.param) << c.st;
    EXPECT_EQ(e.message, c.st.message());
  }
  EXPECT_EQ(
      ErrorFromStatus(absl::InvalidArgumentError("prompt.text is empty"), ApiKind::kChat).param,
      "messages");
  const json j =
      ErrorJson(ErrorFromStatus(absl::ResourceExhaustedError("full"), ApiKind::kCompletion));
  EXPECT_EQ(j["error"]["message"], "full");
  EXPECT_EQ(j["error"]["type"], "rate_limit_error");
  EXPECT_TRUE(j["error"]["param"].is_null());
  EXPECT_EQ(j["error"]["code"], "rate_limit_exceeded");
}

v1::GenerateResponse Msg(const std::string& text, int token, bool finished = false) {
  v1::GenerateResponse m;
  m.set_text(text);
  m.add_token_ids(token);
  if (finished) {
    m.set_finished(true);
    m.set_finish_reason(v1::FINISH_REASON_STOP);
    m.mutable_usage()->set_prompt_tokens(4);
    m.mutable_usage()->set_completion_tokens(3);
  }
  return m;
}

// "data: {...}\n\n" events, parsed; [DONE] kept as the string "[DONE]".
std::vector<json> Events(const std::string& sse) {
  std::vector<json> out;
  for (absl::string_view ev : absl::StrSplit(sse, "\n\n", absl::SkipEmpty())) {
    EXPECT_EQ(ev.substr(0, 6), "data: ") << ev;
    const std::string payload(ev.substr(6));
    out.push_back(payload == "[DONE]" ? json("[DONE]") : json::parse(payload));
  }
  return out;
}

TEST_F(HttpOpenAiTest, ResponseAndChunkShapes) {
  OpenAiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kChat,
                     R"({"messages": [{"role": "user", "content": "x"}], "stream": true,
                         "stream_options": {"include_usage": true}})",
                     &r));
  Accumulated a;
  a.Add(Msg("Hel", 5));
  a.Add(Msg("", 6));
  a.Add(Msg("lo", 7, true));
  EXPECT_EQ(a.text, "Hello");
  EXPECT_EQ(a.prompt_tokens, 4);
  EXPECT_EQ(a.completion_tokens, 3);

  const json full = CompletionJson(r, a);
  EXPECT_EQ(full["object"], "chat.completion");
  EXPECT_EQ(full["id"], r.id);
  EXPECT_EQ(full["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(full["choices"][0]["message"]["content"], "Hello");
  EXPECT_TRUE(full["choices"][0]["message"]["refusal"].is_null());
  EXPECT_TRUE(full["choices"][0]["logprobs"].is_null());  // not asked for
  EXPECT_EQ(full["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(full["usage"]["total_tokens"], 7);

  SseEncoder enc(r);
  // One statement per call: the encoder keeps state, and the operands of + are evaluated in no
  // set order.
  std::string sse = enc.Open();
  sse += enc.Delta(Msg("Hel", 5));
  sse += enc.Delta(Msg("", 6));
  sse += enc.Delta(Msg("lo", 7));
  sse += enc.Finish(a);
  sse += enc.Done({&a, 1});
  const std::vector<json> ev = Events(sse);
  ASSERT_EQ(ev.size(), 6u);  // role, two deltas, finish, usage, [DONE]
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(ev[i]["object"], "chat.completion.chunk");
    EXPECT_EQ(ev[i]["id"], r.id);
  }
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(ev[1]["choices"][0]["delta"]["content"], "Hel");
  EXPECT_TRUE(ev[1]["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(ev[1].contains("usage") && ev[1]["usage"].is_null());
  EXPECT_EQ(ev[3]["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(ev[3]["choices"][0]["delta"].empty());
  EXPECT_TRUE(ev[4]["choices"].empty());
  EXPECT_EQ(ev[4]["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(ev[4]["usage"]["completion_tokens"], 3);
  EXPECT_EQ(ev[5], "[DONE]");

  OpenAiRequest c;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt": "x", "stream": true})", &c));
  SseEncoder ce(c);
  EXPECT_EQ(ce.Open(), "");
  std::string csse = ce.Delta(Msg("ab", 5));
  csse += ce.Finish(a);
  csse += ce.Done({&a, 1});
  const std::vector<json> cev = Events(csse);
  ASSERT_EQ(cev.size(), 3u);  // text, finish, [DONE]: no usage chunk unless asked
  EXPECT_EQ(cev[0]["object"], "text_completion");
  EXPECT_EQ(cev[0]["choices"][0]["text"], "ab");
  EXPECT_FALSE(cev[0].contains("usage"));
  EXPECT_EQ(cev[1]["choices"][0]["finish_reason"], "stop");
  const std::vector<json> err = Events(ce.Error(HttpError{500, "lost", "server_error", "", ""}));
  ASSERT_EQ(err.size(), 2u);
  EXPECT_EQ(err[0]["error"]["message"], "lost");
  EXPECT_EQ(err[1], "[DONE]");
}

// A message of tokens with log-probabilities: token t has logprob -t/10 and alternatives t
// (the same value) and t+1.
v1::GenerateResponse LogprobMsg(const std::string& text, std::vector<int> tokens,
                                bool finished = false) {
  v1::GenerateResponse m = Msg(text, tokens[0], finished);
  for (size_t i = 1; i < tokens.size(); ++i) m.add_token_ids(tokens[i]);
  for (int t : tokens) {
    v1::TokenLogprobs* l = m.add_logprobs();
    l->set_logprob(-t / 10.0f);
    l->add_top_ids(t);
    l->add_top_logprobs(-t / 10.0f);
    l->add_top_ids(t + 1);
    l->add_top_logprobs(-(t + 1) / 10.0f);
  }
  return m;
}

TEST_F(HttpOpenAiTest, LogprobsInChatAndCompletionShapes) {
  const engine::Tokenizer& tok = model_->tokenizer();
  OpenAiRequest chat;
  ASSERT_TRUE(Parses(ApiKind::kChat,
                     R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true,
                         "top_logprobs": 2, "stream": true})",
                     &chat));
  EXPECT_EQ(chat.logprobs, 2);
  EXPECT_EQ(chat.generate.sampling().logprobs(), 2);
  Accumulated a;
  a.Add(LogprobMsg("ab", {5, 6}));
  a.Add(LogprobMsg("", {7}));
  a.Add(LogprobMsg("c", {8}, true));
  const json full = CompletionJson(chat, a);
  const json& content = full["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const int t = 5 + static_cast<int>(i);
    const std::string piece = tok.TokenToPiece(t, true);
    EXPECT_EQ(content[i]["token"], piece);
    EXPECT_FLOAT_EQ(content[i]["logprob"].get<float>(), -t / 10.0f);
    EXPECT_EQ(content[i]["bytes"].size(), piece.size());
    ASSERT_EQ(content[i]["top_logprobs"].size(), 2u);
    EXPECT_EQ(content[i]["top_logprobs"][1]["token"], tok.TokenToPiece(t + 1, true));
    EXPECT_FLOAT_EQ(content[i]["top_logprobs"][1]["logprob"].get<float>(), -(t + 1) / 10.0f);
  }
  EXPECT_TRUE(full["choices"][0]["logprobs"]["refusal"].is_null());

  // Streamed: a token whose text is held back sends its log-probabilities with the next text.
  SseEncoder enc(chat);
  std::string sse = enc.Open();
  sse += enc.Delta(LogprobMsg("ab", {5, 6}));
  sse += enc.Delta(LogprobMsg("", {7}));
  sse += enc.Delta(LogprobMsg("c", {8}));
  sse += enc.Finish(a);
  sse += enc.Done({&a, 1});
  const std::vector<json> ev = Events(sse);
  ASSERT_EQ(ev.size(), 5u);  // role, "ab", "c", finish, [DONE]
  EXPECT_TRUE(ev[0]["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(ev[1]["choices"][0]["logprobs"]["content"].size(), 2u);
  ASSERT_EQ(ev[2]["choices"][0]["logprobs"]["content"].size(), 2u);
  EXPECT_EQ(ev[2]["choices"][0]["logprobs"]["content"][0]["token"], tok.TokenToPiece(7, true));
  EXPECT_TRUE(ev[3]["choices"][0]["logprobs"].is_null());  // nothing left to send

  OpenAiRequest cmpl;
  ASSERT_TRUE(Parses(ApiKind::kCompletion, R"({"prompt": "x", "logprobs": 1})", &cmpl));
  EXPECT_EQ(cmpl.generate.sampling().logprobs(), 1);
  const json lp = CompletionJson(cmpl, a)["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 4u);
  ASSERT_EQ(lp["token_logprobs"].size(), 4u);
  ASSERT_EQ(lp["top_logprobs"].size(), 4u);
  int64_t offset = 0;
  for (size_t i = 0; i < 4; ++i) {
    const int t = 5 + static_cast<int>(i);
    const std::string piece = tok.TokenToPiece(t, true);
    EXPECT_EQ(lp["tokens"][i], piece);
    EXPECT_FLOAT_EQ(lp["token_logprobs"][i].get<float>(), -t / 10.0f);
    EXPECT_EQ(lp["text_offset"][i], offset);
    offset += static_cast<int64_t>(piece.size());
    EXPECT_TRUE(lp["top_logprobs"][i].contains(piece));
    EXPECT_TRUE(lp["top_logprobs"][i].contains(tok.TokenToPiece(t + 1, true)));
  }
  // Off unless asked for: no field reaches the workers.
  OpenAiRequest off;
  ASSERT_TRUE(Parses(ApiKind::kChat,
                     R"({"messages": [{"role": "user", "content": "x"}], "logprobs": false})",
                     &off));
  EXPECT_EQ(off.logprobs, -1);
  EXPECT_FALSE(off.generate.sampling().has_logprobs());
}

TEST_F(HttpOpenAiTest, SeveralChoicesAndEcho) {
  OpenAiRequest r;
  ASSERT_TRUE(Parses(ApiKind::kCompletion,
                     R"({"prompt": "hello", "n": 3, "best_of": 3, "seed": 40, "echo": true,
                         "stream": true, "stream_options": {"include_usage": true}})",
                     &r));
  EXPECT_EQ(r.n, 3);
  EXPECT_TRUE(r.echo);
  EXPECT_EQ(r.echo_text, "hello");
  // Each choice its own call: its own request id and seed.
  for (int32_t i = 0; i < 3; ++i) {
    const v1::GenerateRequest g = ChoiceRequest(r, i);
    EXPECT_EQ(g.request_id(), i == 0 ? r.id : absl::StrCat(r.id, "-", i));
    EXPECT_EQ(g.sampling().seed(), 40u + static_cast<uint64_t>(i));
    EXPECT_EQ(g.text(), "hello");
  }
  std::vector<Accumulated> acc(3);
  acc[0].Add(Msg("a", 5, true));
  acc[1].Add(Msg("b", 6, true));
  acc[2].Add(Msg("c", 7, true));
  const json full = CompletionJson(r, acc);
  ASSERT_EQ(full["choices"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(full["choices"][i]["index"], i);
    EXPECT_EQ(full["choices"][i]["text"], "hello" + std::string(1, static_cast<char>('a' + i)));
  }
  // The prompt once, every choice's tokens (Msg's usage says 3 each).
  EXPECT_EQ(full["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(full["usage"]["completion_tokens"], 9);
  EXPECT_EQ(full["usage"]["total_tokens"], 13);

  SseEncoder e1(r, 1);
  std::string sse = e1.Open();
  sse += e1.Delta(Msg("b", 6));
  sse += e1.Finish(acc[1]);
  sse += e1.Done(acc);
  const std::vector<json> ev = Events(sse);
  ASSERT_EQ(ev.size(), 5u);  // echo, "b", finish, usage, [DONE]
  EXPECT_EQ(ev[0]["choices"][0]["text"], "hello");
  for (int i = 0; i < 3; ++i) EXPECT_EQ(ev[i]["choices"][0]["index"], 1);
  EXPECT_EQ(ev[3]["usage"]["completion_tokens"], 9);

  // Token-id prompts echo their text.
  OpenAiRequest ids;
  const std::vector<int32_t> toks = model_->tokenizer().Encode("hi there", false, false);
  ASSERT_TRUE(Parses(ApiKind::kCompletion,
                     json({{"prompt", toks}, {"echo", true}}).dump(), &ids));
  EXPECT_EQ(ids.echo_text, model_->tokenizer().Decode(toks, false));
}

TEST_F(HttpOpenAiTest, ResponseFormatsReachTheSamplingParams) {
  OpenAiRequest r;
  ASSERT_TRUE(Parses(ApiKind::kChat,
                     R"({"messages": [{"role": "user", "content": "x"}],
                         "response_format": {"type": "json_object"}})",
                     &r));
  EXPECT_TRUE(r.generate.sampling().response_format().json_object());
  ASSERT_TRUE(Parses(ApiKind::kCompletion,
                     R"({"prompt": "x", "response_format": {"type": "json_schema",
                         "json_schema": {"name": "npc", "strict": true, "schema":
                         {"type": "object", "properties": {"mood": {"enum": ["calm", "angry"]}},
                          "required": ["mood"], "additionalProperties": false}}}})",
                     &r));
  const json schema = json::parse(r.generate.sampling().response_format().json_schema());
  EXPECT_EQ(schema["properties"]["mood"]["enum"][1], "angry");
  ASSERT_TRUE(Parses(ApiKind::kChat,
                     R"({"messages": [{"role": "user", "content": "x"}],
                         "response_format": {"type": "text"}})",
                     &r));
  EXPECT_FALSE(r.generate.sampling().has_response_format());
  // vLLM's structured_outputs: a regex, a GBNF grammar, or a choice (a regex of the strings,
  // escaped).
  ASSERT_TRUE(Parses(ApiKind::kCompletion,
                     R"({"prompt": "x", "structured_outputs": {"regex": "[0-9]+"}})", &r));
  EXPECT_EQ(r.generate.sampling().response_format().regex(), "[0-9]+");
  ASSERT_TRUE(Parses(ApiKind::kChat,
                     R"({"messages": [{"role": "user", "content": "x"}],
                         "structured_outputs": {"grammar": "root ::= \"hi\""}})",
                     &r));
  EXPECT_EQ(r.generate.sampling().response_format().grammar(), "root ::= \"hi\"");
  ASSERT_TRUE(Parses(ApiKind::kCompletion,
                     R"j({"prompt": "x",
                         "structured_outputs": {"choice": ["yes (1)", "a.b|c"]}})j",
                     &r));
  const std::string choice = r.generate.sampling().response_format().regex();
  EXPECT_EQ(choice, R"j((yes \(1\))|(a\.b\|c))j");
  absl::StatusOr<engine::Grammar> g = engine::RegexGrammar(choice);
  ASSERT_TRUE(g.ok()) << g.status();
}

constexpr char kWeatherTools[] = R"("tools": [
  {"type": "function", "function": {"name": "get_weather", "description": "weather now",
   "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"], "additionalProperties": false}}},
  {"type": "function", "function": {"name": "wave"}}])";

TEST_F(HttpOpenAiTest, ToolsAreListedInThePromptAndRequiredCallsAreConstrained) {
  OpenAiRequest r;
  ASSERT_TRUE(Parses(ApiKind::kChat,
                     absl::StrCat(R"({"messages": [{"role": "user", "content": "x"}], )",
                                  kWeatherTools, "}"),
                     &r));
  EXPECT_EQ(r.tool_choice, ToolChoice::kAuto);
  EXPECT_EQ(r.tool_names, (std::vector<std::string>{"get_weather", "wave"}));
  EXPECT_NE(r.generate.text().find("<tools>"), std::string::npos);
  EXPECT_NE(r.generate.text().find("\"name\":\"get_weather\""), std::string::npos);
  EXPECT_FALSE(r.generate.sampling().has_response_format());  // auto: the model is free

  ASSERT_TRUE(Parses(ApiKind::kChat,
                     absl::StrCat(R"({"messages": [{"role": "user", "content": "x"}], )",
                                  kWeatherTools, R"(, "tool_choice": "required"})"),
                     &r));
  EXPECT_EQ(r.tool_choice, ToolChoice::kRequired);
  const json any = json::parse(r.generate.sampling().response_format().json_schema());
  ASSERT_EQ(any["anyOf"].size(), 2u);
  EXPECT_EQ(any["anyOf"][0]["properties"]["name"]["const"], "get_weather");
  EXPECT_EQ(any["anyOf"][0]["properties"]["arguments"]["required"][0], "city");

  ASSERT_TRUE(Parses(ApiKind::kChat,
                     absl::StrCat(R"({"messages": [{"role": "user", "content": "x"}], )",
                                  kWeatherTools,
                                  R"(, "tool_choice": {"type": "function",
                                     "function": {"name": "wave"}}})"),
                     &r));
  EXPECT_EQ(r.tool_choice, ToolChoice::kNamed);
  const json one = json::parse(r.generate.sampling().response_format().json_schema());
  EXPECT_EQ(one["properties"]["name"]["const"], "wave");

  ASSERT_TRUE(Parses(ApiKind::kChat,
                     absl::StrCat(R"({"messages": [{"role": "user", "content": "x"}], )",
                                  kWeatherTools, R"(, "tool_choice": "none"})"),
                     &r));
  EXPECT_EQ(r.tool_choice, ToolChoice::kNone);
  EXPECT_EQ(r.generate.text().find("<tools>"), std::string::npos);

  // A conversation that called a tool and got its answer renders both.
  ASSERT_TRUE(Parses(ApiKind::kChat,
                     absl::StrCat(R"({"messages": [{"role": "user", "content": "x"},
                        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_9",
                         "type": "function", "function": {"name": "wave", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "call_9", "content": "waved"}], )",
                                  kWeatherTools, "}"),
                     &r));
  EXPECT_NE(r.generate.text().find("{\"name\": \"wave\", \"arguments\": {}}"),
            std::string::npos)
      << r.generate.text();
  EXPECT_NE(r.generate.text().find("<tool_response>\nwaved\n</tool_response>"), std::string::npos);

  const std::string msg = R"({"messages": [{"role": "user", "content": "x"}], )";
  struct Case {
    std::string body, param, needle;
  };
  for (const Case& c : std::vector<Case>{
           {msg + R"("tools": {}})", "tools", "array"},
           {msg + R"("tools": [{"type": "function", "function": {"name": "a b"}}]})",
            "tools[0].function.name", "letters"},
           {msg + R"("tools": [{"type": "function", "function": {"name": "a"}},
                              {"type": "function", "function": {"name": "a"}}]})",
            "tools[1].function.name", "another tool"},
           {msg + R"("tools": [{"type": "function", "function": {"name": "a",
                     "parameters": {"type": "integer", "minimum": 1}}}]})",
            "tools[0].function.parameters", "minimum"},
           {msg + R"("tool_choice": "required"})", "tool_choice", "needs tools"},
           {msg + kWeatherTools + R"(, "tool_choice": "sometimes"})", "tool_choice", "required"},
           {msg + kWeatherTools +
                R"(, "tool_choice": {"type": "function", "function": {"name": "fly"}}})",
            "tool_choice", "fly"},
           {msg + kWeatherTools +
                R"(, "tool_choice": "required", "response_format": {"type": "json_object"}})",
            "response_format", "tool_choice"},
       }) {
    const HttpError e = ParseError(ApiKind::kChat, c.body);
    EXPECT_EQ(e.param, c.param) << c.body << ": " << e.message;
    EXPECT_NE(e.message.find(c.needle), std::string::npos) << c.body << ": " << e.message;
  }
}

TEST_F(HttpOpenAiTest, ToolCallsInResponsesAndStreams) {
  OpenAiRequest req;
  ASSERT_TRUE(Parses(ApiKind::kChat,
                     absl::StrCat(R"({"messages": [{"role": "user", "content": "x"}], )",
                                  kWeatherTools, R"(, "tool_choice": "required", "stream": true})"),
                     &req));
  Accumulated a;
  a.Add(Msg(R"({"name": "get_weather", "arguments": {"city": "Oslo"}})", 5, true));
  json full = CompletionJson(req, a);
  const json& m = full["choices"][0]["message"];
  EXPECT_EQ(full["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_TRUE(m["content"].is_null());
  ASSERT_EQ(m["tool_calls"].size(), 1u);
  EXPECT_EQ(m["tool_calls"][0]["type"], "function");
  EXPECT_EQ(m["tool_calls"][0]["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(m["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(m["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json({{"city", "Oslo"}}));
  // Streamed: nothing until the call is whole, then one delta with it.
  SseEncoder enc(req);
  std::string sse = enc.Open();
  sse += enc.Delta(Msg(R"({"name": "get_wea)", 5));
  sse += enc.Finish(a);
  sse += enc.Done({&a, 1});
  std::vector<json> ev = Events(sse);
  ASSERT_EQ(ev.size(), 4u);  // role, tool_calls, finish, [DONE]
  EXPECT_EQ(ev[1]["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
  EXPECT_EQ(ev[1]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(ev[2]["choices"][0]["finish_reason"], "tool_calls");

  // auto: text streams until a call may begin; the call is found in what the model wrote.
  OpenAiRequest autoreq;
  ASSERT_TRUE(Parses(ApiKind::kChat,
                     absl::StrCat(R"({"messages": [{"role": "user", "content": "x"}], )",
                                  kWeatherTools, R"(, "stream": true})"),
                     &autoreq));
  const std::string text =
      "Let me check. <tool_call>\n{\"name\": \"wave\", \"arguments\": {}}\n</tool_call>";
  Accumulated b;
  b.Add(Msg(text, 5, true));
  const ToolCallOutput t = ParseToolCalls(autoreq, text);
  ASSERT_EQ(t.calls.size(), 1u);
  EXPECT_EQ(t.calls[0].name, "wave");
  EXPECT_EQ(t.content, "Let me check. ");
  SseEncoder ae(autoreq);
  sse = ae.Delta(Msg("Let me check. <tool", 5));
  sse += ae.Delta(Msg(text.substr(19), 6));
  sse += ae.Finish(b);
  ev = Events(sse);
  ASSERT_EQ(ev.size(), 3u);  // the text before the tag, the call, finish
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["content"], "Let me check. ");
  EXPECT_EQ(ev[1]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"], "wave");
  EXPECT_EQ(ev[2]["choices"][0]["finish_reason"], "tool_calls");
  // A block that is not a call of these tools stays text.
  const ToolCallOutput u =
      ParseToolCalls(autoreq, "<tool_call>{\"name\": \"fly\", \"arguments\": {}}</tool_call>");
  EXPECT_TRUE(u.calls.empty());
  EXPECT_NE(u.content.find("fly"), std::string::npos);
  const json plain = CompletionJson(autoreq, [] {
    Accumulated c;
    c.Add(Msg("Just words.", 5, true));
    return c;
  }());
  EXPECT_EQ(plain["choices"][0]["message"]["content"], "Just words.");
  EXPECT_FALSE(plain["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(plain["choices"][0]["finish_reason"], "stop");
}

TEST_F(HttpOpenAiTest, TokenizeAndDetokenize) {
  json out;
  ASSERT_FALSE(Tokenize(R"({"prompt": "hello world"})", *model_, chat_, &out));
  const std::vector<int32_t> expect = model_->tokenizer().Encode("hello world", true, true);
  EXPECT_EQ(out["tokens"].get<std::vector<int32_t>>(), expect);
  EXPECT_EQ(out["count"], expect.size());
  EXPECT_EQ(out["max_model_len"], 256);
  ASSERT_FALSE(
      Tokenize(R"({"prompt": "hello world", "add_special_tokens": false})", *model_, chat_, &out));
  const std::vector<int32_t> plain = out["tokens"].get<std::vector<int32_t>>();
  EXPECT_EQ(plain.size() + 1, expect.size());
  json text;
  ASSERT_FALSE(Detokenize(json({{"tokens", plain}}).dump(), *model_, &text));
  EXPECT_EQ(text["prompt"], "hello world");
  ASSERT_FALSE(
      Tokenize(R"({"messages": [{"role": "user", "content": "hi"}]})", *model_, chat_, &out));
  EXPECT_EQ(out["tokens"].get<std::vector<int32_t>>(),
            model_->tokenizer().Encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                       true, true));
  auto e = Detokenize(R"({"tokens": [1, 99999]})", *model_, &text);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->param, "tokens");
  EXPECT_TRUE(Tokenize(R"({"nothing": 1})", *model_, chat_, &out).has_value());
  EXPECT_TRUE(Tokenize("{", *model_, chat_, &out).has_value());
}

// A connected loopback TCP pair: the server side is what a handler would watch.
struct TcpPair {
  int listener = -1, client = -1, server = -1;
  TcpPair() {
    listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    EXPECT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&a), len), 0);
    EXPECT_EQ(listen(listener, 1), 0);
    EXPECT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len), 0);
    client = socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_EQ(connect(client, reinterpret_cast<sockaddr*>(&a), len), 0);
    server = accept(listener, nullptr, nullptr);
    EXPECT_GE(server, 0);
  }
  ~TcpPair() {
    for (int fd : {listener, client, server}) {
      if (fd >= 0) close(fd);
    }
  }
  static std::pair<std::string, int> Name(int fd, bool peer) {
    sockaddr_in a{};
    socklen_t len = sizeof(a);
    if (peer) {
      getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len);
    } else {
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    }
    char host[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &a.sin_addr, host, sizeof(host));
    return {host, ntohs(a.sin_port)};
  }
};

TEST(DisconnectWatcherTest, FindsTheSocketAndSeesThePeerHangUp) {
  TcpPair p;
  const auto [raddr, rport] = TcpPair::Name(p.server, /*peer=*/true);
  const auto [laddr, lport] = TcpPair::Name(p.server, /*peer=*/false);
  EXPECT_EQ(FindConnectionSocket(raddr, rport, laddr, lport), p.server);
  // Seen from the other end, the same pair is the client's socket.
  EXPECT_EQ(FindConnectionSocket(laddr, lport, raddr, rport), p.client);
  EXPECT_EQ(FindConnectionSocket(raddr, rport + 1, laddr, lport), -1);

  DisconnectWatcher w(absl::Milliseconds(5));
  std::atomic<int> fired{0};
  const uint64_t h = w.Watch(p.server, [&] { fired++; });
  EXPECT_EQ(w.watched(), 1);
  // Unread data is not a hang-up.
  ASSERT_EQ(write(p.client, "x", 1), 1);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(fired.load(), 0);
  EXPECT_FALSE(PeerHungUp(p.server));
  close(p.client);
  p.client = -1;
  const absl::Time t0 = absl::Now();
  while (fired.load() == 0 && absl::Now() - t0 < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(fired.load(), 1);
  EXPECT_TRUE(PeerHungUp(p.server));
  EXPECT_EQ(w.watched(), 0);  // fired entries are dropped
  w.Unwatch(h);               // harmless afterwards
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(fired.load(), 1);  // once only
  EXPECT_EQ(w.Watch(-1, [] {}), 0u);
}

TEST(DisconnectWatcherTest, UnwatchedSocketsAreNotReported) {
  TcpPair p;
  DisconnectWatcher w(absl::Milliseconds(5));
  std::atomic<int> fired{0};
  w.Unwatch(w.Watch(p.server, [&] { fired++; }));
  close(p.client);
  p.client = -1;
  absl::SleepFor(absl::Milliseconds(60));
  EXPECT_EQ(fired.load(), 0);
}

}  // namespace
}  // namespace tandem::router
