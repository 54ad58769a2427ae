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
#include "gtest/gtest.h"
#include "services/router/http_connection.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::router {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

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
      {ApiKind::kCompletion, "[1, 2]", "", "JSON object"},
      {ApiKind::kCompletion, R"({"prompt": "x", "n": 2})", "n", "n must be 1"},
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
      {ApiKind::kCompletion, R"({"prompt": "x", "echo": true})", "echo", "not supported"},
      {ApiKind::kCompletion, R"({"prompt": "x", "logprobs": 2})", "logprobs", "not supported"},
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
       "tools", "not supported"},
      {ApiKind::kChat,
       R"({"messages": [{"role": "user", "content": "x"}],
           "response_format": {"type": "json_object"}})",
       "response_format", "text"},
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
  EXPECT_EQ(full["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(full["usage"]["total_tokens"], 7);

  SseEncoder enc(r);
  const std::string sse =
      enc.Open() + enc.Delta("Hel") + enc.Delta("") + enc.Delta("lo") + enc.Finish(a);
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
  const std::vector<json> cev = Events(ce.Delta("ab") + ce.Finish(a));
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
