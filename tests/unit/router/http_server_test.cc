// The OpenAI-compatible HTTP front door end to end, in one process: a real RouterServer with
// HTTP on port 0, small fake prefill and decode gRPC workers behind it, and httplib::Client in
// front. Covers completions and chat, JSON and SSE (framing, [DONE], include_usage), that the
// HTTP text and prompt equal the gRPC path's for the same request, the error shapes and codes
// (bad JSON, n=2, unknown model, no workers 503, admission 429, deadline 504), that bad input
// leaves the server serving, and that a client going away cancels the request on its worker.
#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "services/common/grpc_status.h"
#include "services/router/router_server.h"
#include "tests/unit/router/router_fixture.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::router {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A decode worker that streams `tokens` messages "t0 ", "t1 ", ... and records what it got.
class FakeDecode final : public v1::DecodeWorker::Service {
 public:
  int tokens = 5;
  absl::Duration token_delay = absl::ZeroDuration();
  v1::FinishReason finish = v1::FINISH_REASON_LENGTH;
  absl::Mutex mu;
  std::vector<v1::DecodeRequest> decodes ABSL_GUARDED_BY(mu);
  std::vector<std::string> cancels ABSL_GUARDED_BY(mu);
  int streams_cut ABSL_GUARDED_BY(mu) = 0;

  grpc::Status Reserve(grpc::ServerContext*, const v1::ReserveRequest* req,
                       v1::ReserveResponse* resp) override {
    resp->mutable_destination()->set_region("r");
    resp->mutable_destination()->add_block_ids(1);
    return grpc::Status::OK;
  }
  grpc::Status Decode(grpc::ServerContext* ctx, const v1::DecodeRequest* req,
                      grpc::ServerWriter<v1::GenerateResponse>* w) override {
    {
      absl::MutexLock lock(&mu);
      decodes.push_back(*req);
    }
    for (int i = 0; i < tokens; ++i) {
      for (absl::Time until = absl::Now() + token_delay; absl::Now() < until;) {
        if (ctx->IsCancelled()) return Cut();
        absl::SleepFor(absl::Milliseconds(2));
      }
      v1::GenerateResponse m;
      m.add_token_ids(100 + i);
      m.set_text(absl::StrCat("t", i, " "));
      if (i + 1 == tokens) {
        m.set_finished(true);
        m.set_finish_reason(finish);
      }
      if (!w->Write(m)) return Cut();
    }
    return grpc::Status::OK;
  }
  grpc::Status Cancel(grpc::ServerContext*, const v1::CancelRequest* req,
                      v1::CancelResponse*) override {
    absl::MutexLock lock(&mu);
    cancels.push_back(req->request_id());
    return grpc::Status::OK;
  }

 private:
  grpc::Status Cut() {
    absl::MutexLock lock(&mu);
    streams_cut++;
    return grpc::Status(grpc::StatusCode::CANCELLED, "cut");
  }
};

class FakePrefill final : public v1::PrefillWorker::Service {
 public:
  grpc::Status Prefill(grpc::ServerContext*, const v1::PrefillRequest*,
                       v1::PrefillResponse* resp) override {
    resp->set_first_token_id(100);
    return grpc::Status::OK;
  }
};

struct Sse {
  int status = 0;
  std::string content_type;
  std::string raw;
  std::vector<json> events;  // "[DONE]" kept as a string
};

class HttpServerTest : public RouterFixture {
 protected:
  void StartRouter(RouterOptions o = {}) {
    o.model_id = "tiny";
    if (o.default_timeout == RouterOptions().default_timeout) o.default_timeout = absl::Seconds(60);
    o.retry_budget = absl::Milliseconds(300);
    RouterFixture::StartRouter(o);
  }

  // A decode and a prefill worker, registered.
  FakeDecode& AddWorkers() {
    decode_ = std::make_unique<FakeDecode>();
    prefill_ = std::make_unique<FakePrefill>();
    HostWorker(decode_.get(), "d0", v1::WORKER_ROLE_DECODE);
    HostWorker(prefill_.get(), "p0", v1::WORKER_ROLE_PREFILL);
    return *decode_;
  }
  httplib::Client Client() {
    httplib::Client c("127.0.0.1", router_->http_port());
    c.set_read_timeout(20, 0);
    return c;
  }
  httplib::Result Post(const std::string& path, const std::string& body) {
    return Client().Post(path.c_str(), body, "application/json");
  }
  static json Body(const httplib::Result& r) {
    return json::parse(r->body, nullptr, /*allow_exceptions=*/false);
  }
  // An OpenAI-shaped error with this status.
  static void ExpectError(const httplib::Result& r, int status, const std::string& param = "") {
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, status) << r->body;
    EXPECT_EQ(r->get_header_value("Content-Type"), "application/json");
    const json j = Body(r);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << r->body;
    const json& e = j["error"];
    EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty()) << r->body;
    EXPECT_TRUE(e["type"].is_string()) << r->body;
    EXPECT_TRUE(e.contains("param") && e.contains("code")) << r->body;
    if (!param.empty()) {
      EXPECT_EQ(e["param"], param) << r->body;
    }
  }

  // A streaming POST, read to the end (or until `stop_after` events, then disconnects).
  Sse Stream(const std::string& path, const std::string& body, int stop_after = -1) {
    Sse out;
    httplib::Client c = Client();
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = body;
    req.set_header("Content-Type", "application/json");
    req.response_handler = [&](const httplib::Response& r) {
      out.status = r.status;
      out.content_type = r.get_header_value("Content-Type");
      return true;
    };
    std::string buf;
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      out.raw.append(data, n);
      buf.append(data, n);
      size_t end;
      while ((end = buf.find("\n\n")) != std::string::npos) {
        const std::string ev = buf.substr(0, end);
        buf.erase(0, end + 2);
        EXPECT_EQ(ev.substr(0, 6), "data: ") << ev;
        const std::string payload = ev.substr(6);
        const json j = payload == "[DONE]" ? json("[DONE]") : json::parse(payload, nullptr, false);
        EXPECT_FALSE(j.is_discarded()) << payload;
        out.events.push_back(j);
        if (stop_after >= 0 && static_cast<int>(out.events.size()) >= stop_after) return false;
      }
      return true;
    };
    httplib::Result r = c.send(req);
    if (r && out.status == 0) out.status = r->status;
    if (r && out.raw.empty()) out.raw = r->body;
    return out;
  }

  // The same request over gRPC: text and the prompt the decode worker saw.
  std::string GrpcText(const v1::GenerateRequest& req) {
    grpc::ClientContext cc;
    cc.set_deadline(services::ToChronoDeadline(absl::Now() + absl::Seconds(20)));
    auto reader = inference_->Generate(&cc, req);
    v1::GenerateResponse m;
    std::string text;
    while (reader->Read(&m)) text += m.text();
    EXPECT_TRUE(reader->Finish().ok());
    return text;
  }
  std::vector<int32_t> LastDecodedPrompt() {
    absl::MutexLock lock(&decode_->mu);
    const v1::DecodeRequest& d = decode_->decodes.back();
    return {d.prompt_token_ids().begin(), d.prompt_token_ids().end()};
  }
  v1::SamplingParams LastSampling() {
    absl::MutexLock lock(&decode_->mu);
    return decode_->decodes.back().sampling();
  }
  bool WaitForCancel(const std::string& id, absl::Duration timeout = absl::Seconds(5)) {
    for (absl::Time t0 = absl::Now(); absl::Now() - t0 < timeout;) {
      {
        absl::MutexLock lock(&decode_->mu);
        for (const std::string& c : decode_->cancels) {
          if (c == id && decode_->streams_cut > 0) return true;
        }
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  // RouterFixture's TearDown shuts the servers down before these go.
  std::unique_ptr<FakeDecode> decode_;
  std::unique_ptr<FakePrefill> prefill_;
};

TEST_F(HttpServerTest, CompletionMatchesTheGrpcPath) {
  StartRouter();
  AddWorkers();
  httplib::Result r = Post("/v1/completions",
                           R"({"model": "tiny", "prompt": "hello world", "max_tokens": 5,
                               "temperature": 0, "seed": 7, "stop": "zz"})");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Content-Type"), "application/json");
  const json j = Body(r);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  EXPECT_EQ(j["model"], "tiny");
  EXPECT_GT(j["created"].get<int64_t>(), 1600000000);
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  const std::string http_text = j["choices"][0]["text"];
  const std::vector<int32_t> http_prompt = LastDecodedPrompt();
  const v1::SamplingParams s = LastSampling();
  EXPECT_EQ(s.seed(), 7u);
  EXPECT_EQ(s.max_tokens(), 5);
  EXPECT_EQ(s.temperature(), 0.0f);
  ASSERT_EQ(s.stop_size(), 1);
  EXPECT_EQ(s.stop(0), "zz");
  const std::vector<int32_t> expect_prompt =
      router_->model().tokenizer().Encode("hello world", true, true);
  EXPECT_EQ(http_prompt, expect_prompt);
  EXPECT_EQ(j["usage"]["prompt_tokens"], expect_prompt.size());
  EXPECT_EQ(j["usage"]["completion_tokens"], 5);
  EXPECT_EQ(j["usage"]["total_tokens"], expect_prompt.size() + 5);

  // The same request through gRPC: same prompt tokens reach the worker, same text comes back.
  v1::GenerateRequest g;
  g.set_text("hello world");
  g.mutable_sampling()->set_max_tokens(5);
  g.mutable_sampling()->set_temperature(0);
  g.mutable_sampling()->set_seed(7);
  EXPECT_EQ(GrpcText(g), http_text);
  EXPECT_EQ(LastDecodedPrompt(), http_prompt);
  EXPECT_EQ(http_text, "t0 t1 t2 t3 t4 ");
}

TEST_F(HttpServerTest, ChatRendersTheTemplateAndAnswersAsAssistant) {
  StartRouter();
  FakeDecode& d = AddWorkers();
  d.finish = v1::FINISH_REASON_STOP;
  d.tokens = 3;
  httplib::Result r = Post("/v1/chat/completions",
                           R"({"model": "tiny", "max_tokens": 3, "temperature": 0,
                               "messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi"}]})");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = Body(r);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "t0 t1 t2 ");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  // The tiny model has no chat template: chatml-shaped text, with <|im_end|> as a stop.
  const std::string rendered =
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
      "<|im_start|>assistant\n";
  EXPECT_EQ(LastDecodedPrompt(), router_->model().tokenizer().Encode(rendered, true, true));
  const v1::SamplingParams s = LastSampling();
  ASSERT_EQ(s.stop_size(), 1);
  EXPECT_EQ(s.stop(0), "<|im_end|>");
  EXPECT_EQ(j["usage"]["completion_tokens"], 3);
}

TEST_F(HttpServerTest, StreamingCompletionIsFramedAsSse) {
  StartRouter();
  AddWorkers().tokens = 4;
  const Sse sse = Stream("/v1/completions",
                         R"({"prompt": "hello", "max_tokens": 4, "stream": true, "seed": 1})");
  ASSERT_EQ(sse.status, 200) << sse.raw;
  EXPECT_EQ(sse.content_type, "text/event-stream");
  // Every event is "data: ...\n\n" and nothing follows [DONE].
  EXPECT_EQ(sse.raw.substr(sse.raw.size() - 14), "data: [DONE]\n\n");
  ASSERT_EQ(sse.events.size(), 6u);  // 4 texts, the finish chunk, [DONE]
  std::string text;
  for (int i = 0; i < 5; ++i) {
    const json& c = sse.events[i];
    EXPECT_EQ(c["object"], "text_completion");
    EXPECT_EQ(c["id"], sse.events[0]["id"]);
    EXPECT_FALSE(c.contains("usage"));
    text += c["choices"][0]["text"].get<std::string>();
    if (i < 4) {
      EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
    }
  }
  EXPECT_EQ(sse.events[4]["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(sse.events[5], "[DONE]");
  EXPECT_EQ(text, "t0 t1 t2 t3 ");
  // Streaming or not, the same text.
  httplib::Result r = Post("/v1/completions", R"({"prompt": "hello", "max_tokens": 4, "seed": 1})");
  ASSERT_TRUE(r);
  EXPECT_EQ(Body(r)["choices"][0]["text"], text);
}

TEST_F(HttpServerTest, StreamingChatWithIncludeUsage) {
  StartRouter();
  FakeDecode& d = AddWorkers();
  d.finish = v1::FINISH_REASON_STOP;
  d.tokens = 3;
  const Sse sse = Stream("/v1/chat/completions",
                         R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                             "stream": true, "stream_options": {"include_usage": true}})");
  ASSERT_EQ(sse.status, 200) << sse.raw;
  // role chunk, 3 content chunks, finish chunk, usage chunk, [DONE]
  ASSERT_EQ(sse.events.size(), 7u) << sse.raw;
  EXPECT_EQ(sse.events[0]["choices"][0]["delta"]["role"], "assistant");
  std::string text;
  for (int i = 0; i < 6; ++i) {
    const json& c = sse.events[i];
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    EXPECT_TRUE(c.contains("usage"));
    if (i < 5) {
      EXPECT_TRUE(c["usage"].is_null());
    }
    if (i >= 1 && i <= 3) text += c["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(text, "t0 t1 t2 ");
  EXPECT_EQ(sse.events[4]["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(sse.events[4]["choices"][0]["delta"].empty());
  const json& u = sse.events[5];
  EXPECT_TRUE(u["choices"].is_array() && u["choices"].empty());
  EXPECT_EQ(u["usage"]["completion_tokens"], 3);
  EXPECT_EQ(u["usage"]["prompt_tokens"], LastDecodedPrompt().size());
  EXPECT_EQ(u["usage"]["total_tokens"], LastDecodedPrompt().size() + 3);
  EXPECT_EQ(sse.events[6], "[DONE]");
}

TEST_F(HttpServerTest, BadRequestsGetOpenAiErrorsAndTheServerKeepsServing) {
  StartRouter();
  AddWorkers();
  ExpectError(Post("/v1/completions", "{\"prompt\": "), 400);
  ExpectError(Post("/v1/completions", R"({"prompt": "x", "n": 17})"), 400, "n");
  ExpectError(
      Post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "n": 0})"),
      400, "n");
  ExpectError(Post("/v1/completions", R"({"prompt": "x", "logprobs": 21})"), 400, "logprobs");
  ExpectError(Post("/v1/chat/completions",
                   R"({"messages": [{"role": "user", "content": "x"}],
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"schema": {"type": "nope"}}}})"),
              400);
  httplib::Result unknown = Post("/v1/completions", R"({"prompt": "x", "model": "gpt-9"})");
  ExpectError(unknown, 400, "model");
  EXPECT_EQ(Body(unknown)["error"]["code"], "model_not_found");
  // Ranges the router checks come back with the OpenAI field named.
  ExpectError(Post("/v1/completions", R"({"prompt": "x", "temperature": -1})"), 400, "temperature");
  ExpectError(Post("/v1/completions", R"({"prompt": "x", "max_tokens": 100000})"), 400,
              "max_tokens");
  ExpectError(Post("/v1/completions", R"({"prompt": "x", "stream": true, "top_p": 0})"), 400,
              "top_p");
  ExpectError(Client().Get("/v1/nothing"), 404);
  {
    absl::MutexLock lock(&decode_->mu);
    EXPECT_TRUE(decode_->decodes.empty());  // none of these reached a worker
  }
  httplib::Result ok = Post("/v1/completions", R"({"prompt": "x", "max_tokens": 2})");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

TEST_F(HttpServerTest, NoWorkersIs503EvenWhenStreaming) {
  StartRouter();
  ExpectError(Post("/v1/completions", R"({"prompt": "x"})"), 503);
  const Sse sse = Stream("/v1/completions", R"({"prompt": "x", "stream": true})");
  EXPECT_EQ(sse.status, 503);
  const json j = json::parse(sse.raw, nullptr, false);
  ASSERT_TRUE(j.is_object() && j.contains("error")) << sse.raw;
  EXPECT_EQ(j["error"]["type"], "service_unavailable_error");
}

TEST_F(HttpServerTest, AdmissionRefusalIs429) {
  RouterOptions o;
  o.max_inflight = 1;
  o.max_queue = 0;
  StartRouter(o);
  FakeDecode& d = AddWorkers();
  d.tokens = 1000;
  d.token_delay = absl::Milliseconds(10);
  grpc::ClientContext cc;
  cc.set_deadline(services::ToChronoDeadline(absl::Now() + absl::Seconds(30)));
  v1::GenerateRequest g;
  g.set_text("hold");
  g.mutable_sampling()->set_max_tokens(200);
  auto reader = inference_->Generate(&cc, g);
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));  // holds the only slot
  httplib::Result r = Post("/v1/completions", R"({"prompt": "x"})");
  ExpectError(r, 429);
  EXPECT_EQ(Body(r)["error"]["code"], "rate_limit_exceeded");
  EXPECT_EQ(Stream("/v1/chat/completions",
                   R"({"messages": [{"role": "user", "content": "x"}], "stream": true})")
                .status,
            429);
  cc.TryCancel();
  while (reader->Read(&m)) {
  }
  reader->Finish();
}

TEST_F(HttpServerTest, RouterDeadlineIs504) {
  RouterOptions o;
  o.default_timeout = absl::Milliseconds(400);
  StartRouter(o);
  AddWorkers().token_delay = absl::Seconds(3);
  const absl::Time t0 = absl::Now();
  ExpectError(Post("/v1/completions", R"({"prompt": "x"})"), 504);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
}

TEST_F(HttpServerTest, StreamingClientDisconnectCancelsOnTheWorker) {
  StartRouter();
  FakeDecode& d = AddWorkers();
  d.tokens = 500;
  d.token_delay = absl::Milliseconds(20);
  const Sse sse =
      Stream("/v1/completions", R"({"prompt": "x", "max_tokens": 200, "stream": true})", 2);
  ASSERT_EQ(sse.events.size(), 2u);
  const std::string id = sse.events[0]["id"];
  EXPECT_TRUE(WaitForCancel(id)) << id;
  // The server is fine afterwards.
  d.tokens = 2;
  d.token_delay = absl::ZeroDuration();
  EXPECT_EQ(Post("/v1/completions", R"({"prompt": "x", "max_tokens": 2})")->status, 200);
}

TEST_F(HttpServerTest, NonStreamingClientDisconnectCancelsOnTheWorker) {
  StartRouter();
  FakeDecode& d = AddWorkers();
  d.tokens = 500;
  d.token_delay = absl::Milliseconds(20);
  {
    httplib::Client c("127.0.0.1", router_->http_port());
    c.set_read_timeout(0, 300000);  // gives up after 300 ms and closes the connection
    httplib::Result r =
        c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 200})", "application/json");
    EXPECT_FALSE(r);
  }
  std::string id;
  {
    absl::MutexLock lock(&d.mu);
    ASSERT_EQ(d.decodes.size(), 1u);
    id = d.decodes[0].request_id();
  }
  EXPECT_EQ(id.rfind("cmpl-", 0), 0u);
  EXPECT_TRUE(WaitForCancel(id)) << id;
  EXPECT_EQ(router_->http()->client_disconnects(), 1u);
  EXPECT_EQ(router_->http()->watched_connections(), 0);
}

TEST_F(HttpServerTest, ModelsHealthTokenizeDetokenize) {
  StartRouter();
  httplib::Client c = Client();
  httplib::Result models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  ASSERT_EQ(models->status, 200);
  const json m = Body(models);
  EXPECT_EQ(m["object"], "list");
  ASSERT_EQ(m["data"].size(), 1u);
  EXPECT_EQ(m["data"][0]["id"], "tiny");
  EXPECT_EQ(m["data"][0]["object"], "model");
  EXPECT_EQ(m["data"][0]["max_model_len"], 256);
  EXPECT_EQ(c.Get("/v1/models/tiny")->status, 200);
  ExpectError(c.Get("/v1/models/other"), 404, "model");

  EXPECT_EQ(c.Get("/health")->status, 200);
  // The router's own Prometheus series (router_metrics_test checks them in detail).
  httplib::Result metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200);
  EXPECT_NE(metrics->body.find("tandem_time_to_first_token_seconds_count{model_name=\"tiny\","
                               "role=\"router\"}"),
            std::string::npos)
      << metrics->body;

  httplib::Result t = Post("/tokenize", R"({"prompt": "hello world"})");
  ASSERT_TRUE(t);
  ASSERT_EQ(t->status, 200) << t->body;
  const json tj = Body(t);
  // The gRPC Tokenize with add_special gives the same ids.
  v1::TokenizeRequest tq;
  tq.set_text("hello world");
  tq.set_add_special(true);
  v1::TokenizeResponse tr;
  grpc::ClientContext tc;
  ASSERT_TRUE(inference_->Tokenize(&tc, tq, &tr).ok());
  EXPECT_EQ(tj["tokens"].get<std::vector<int32_t>>(),
            std::vector<int32_t>(tr.token_ids().begin(), tr.token_ids().end()));
  EXPECT_EQ(tj["count"], tr.token_ids_size());
  EXPECT_EQ(tj["max_model_len"], 256);
  httplib::Result plain =
      Post("/tokenize", R"({"prompt": "hello world", "add_special_tokens": false})");
  httplib::Result back = Post("/detokenize", json({{"tokens", Body(plain)["tokens"]}}).dump());
  ASSERT_TRUE(back);
  EXPECT_EQ(Body(back)["prompt"], "hello world");
  ExpectError(Post("/detokenize", R"({"tokens": [-1]})"), 400, "tokens");

  router_->http()->StartDraining();
  EXPECT_EQ(c.Get("/health")->status, 503);
}

TEST_F(HttpServerTest, ShutdownCancelsRunningStreamsAndIsPrompt) {
  StartRouter();
  FakeDecode& d = AddWorkers();
  d.tokens = 1000;
  d.token_delay = absl::Milliseconds(10);
  Sse sse;
  std::thread client([&] {
    sse = Stream("/v1/completions", R"({"prompt": "x", "max_tokens": 200, "stream": true})");
  });
  for (absl::Time t0 = absl::Now(); absl::Now() - t0 < absl::Seconds(5);) {
    absl::SleepFor(absl::Milliseconds(20));
    absl::MutexLock lock(&d.mu);
    if (!d.decodes.empty()) break;
  }
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time t0 = absl::Now();
  router_->Shutdown(absl::Milliseconds(200));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
  client.join();
  // The stream ended with an error event and [DONE], not a hang.
  ASSERT_GE(sse.events.size(), 2u) << sse.raw;
  EXPECT_EQ(sse.events.back(), "[DONE]");
  EXPECT_TRUE(sse.events[sse.events.size() - 2].contains("error")) << sse.raw;
}

}  // namespace
}  // namespace tandem::router
