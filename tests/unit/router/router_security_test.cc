// The router's input validation table (request_validation.h) and API-key authentication with
// per-tenant rate limits (auth.h), end to end in one process: a real RouterServer with its HTTP
// front door, a small fake colocated worker behind it, gRPC and httplib clients in front.
// Every bad request must be refused with INVALID_ARGUMENT / HTTP 400 naming the field, and the
// router must go on serving good requests afterwards.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "services/router/auth.h"
#include "services/router/router_server.h"
#include "tests/unit/router/router_fixture.h"
#include "tests/fakes/tiny_model.h"
#include "xxhash.h"

namespace tandem::router {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A colocated worker that streams two tokens for any request.
class FakeColocated final : public v1::DecodeWorker::Service {
 public:
  grpc::Status Decode(grpc::ServerContext*, const v1::DecodeRequest*,
                      grpc::ServerWriter<v1::GenerateResponse>* w) override {
    for (int i = 0; i < 2; ++i) {
      v1::GenerateResponse m;
      m.add_token_ids(100 + i);
      m.set_text(absl::StrCat("t", i));
      if (i == 1) {
        m.set_finished(true);
        m.set_finish_reason(v1::FINISH_REASON_LENGTH);
      }
      w->Write(m);
    }
    return grpc::Status::OK;
  }
};

class RouterSecurityTest : public RouterFixture {
 protected:
  static constexpr int kMaxMessage = 256 << 10;

  void StartRouter(std::shared_ptr<Authenticator> auth = nullptr) {
    RouterOptions o;
    o.default_timeout = absl::Seconds(30);
    o.retry_budget = absl::Milliseconds(200);
    o.max_message_bytes = kMaxMessage;
    o.auth = std::move(auth);
    RouterFixture::StartRouter(o);
    HostWorker(&fake_, "c0", v1::WORKER_ROLE_BOTH);  // the worker behind it
  }

  static v1::GenerateRequest Good() {
    v1::GenerateRequest r;
    r.set_text("hello");
    r.mutable_sampling()->set_max_tokens(4);
    return r;
  }

  // Generate to the end; the final status (its trailing metadata in *trailers when given).
  grpc::Status Generate(const v1::GenerateRequest& req, const std::string& key = "",
                        std::multimap<std::string, std::string>* trailers = nullptr) {
    grpc::ClientContext cc;
    cc.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (!key.empty()) cc.AddMetadata("authorization", "Bearer " + key);
    auto reader = inference_->Generate(&cc, req);
    v1::GenerateResponse m;
    int n = 0;
    while (reader->Read(&m)) ++n;
    grpc::Status st = reader->Finish();
    if (st.ok()) {
      EXPECT_EQ(n, 2);
    }
    if (trailers != nullptr) {
      for (const auto& [k, v] : cc.GetServerTrailingMetadata()) {
        trailers->emplace(std::string(k.data(), k.size()), std::string(v.data(), v.size()));
      }
    }
    return st;
  }

  httplib::Client Http() {
    httplib::Client c("127.0.0.1", router_->http_port());
    c.set_read_timeout(20, 0);
    return c;
  }
  httplib::Result PostCompletion(const json& body, const std::string& key = "") {
    httplib::Headers h;
    if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
    return Http().Post("/v1/completions", h, body.dump(), "application/json");
  }

  FakeColocated fake_;
};

// ---- The validation table -------------------------------------------------------------------

struct Case {
  std::string name;
  std::function<void(v1::GenerateRequest*)> grpc;  // null: no gRPC form
  json http;                                       // merged into the base body; null: none
  std::string field;                               // the gRPC message starts with it
  std::string param;                               // the HTTP error's param
};

std::vector<Case> Table() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto s = [](v1::GenerateRequest* r) { return r->mutable_sampling(); };
  std::vector<int32_t> long_prompt(256, 5);
  json long_prompt_json = json::array();
  for (int32_t id : long_prompt) long_prompt_json.push_back(id);
  json many_stops = json::array();
  for (int i = 0; i < 17; ++i) many_stops.push_back(absl::StrCat("s", i));
  return {
      {"temperature<0",
       [=](auto* r) { s(r)->set_temperature(-0.5f); },
       {{"temperature", -0.5}},
       "sampling.temperature",
       "temperature"},
      {"temperature NaN", [=](auto* r) { s(r)->set_temperature(nan); }, nullptr,
       "sampling.temperature", ""},
      {"top_p=0", [=](auto* r) { s(r)->set_top_p(0); }, {{"top_p", 0}}, "sampling.top_p", "top_p"},
      {"top_p>1",
       [=](auto* r) { s(r)->set_top_p(1.5f); },
       {{"top_p", 1.5}},
       "sampling.top_p",
       "top_p"},
      {"top_p NaN", [=](auto* r) { s(r)->set_top_p(nan); }, nullptr, "sampling.top_p", ""},
      {"top_k<-1",
       [=](auto* r) { s(r)->set_top_k(-2); },
       {{"top_k", -2}},
       "sampling.top_k",
       "top_k"},
      {"min_p<0",
       [=](auto* r) { s(r)->set_min_p(-0.1f); },
       {{"min_p", -0.1}},
       "sampling.min_p",
       "min_p"},
      {"min_p>1",
       [=](auto* r) { s(r)->set_min_p(1.5f); },
       {{"min_p", 1.5}},
       "sampling.min_p",
       "min_p"},
      {"presence>2",
       [=](auto* r) { s(r)->set_presence_penalty(2.5f); },
       {{"presence_penalty", 2.5}},
       "sampling.presence_penalty",
       "presence_penalty"},
      {"frequency<-2",
       [=](auto* r) { s(r)->set_frequency_penalty(-3); },
       {{"frequency_penalty", -3}},
       "sampling.frequency_penalty",
       "frequency_penalty"},
      {"repetition=0",
       [=](auto* r) { s(r)->set_repetition_penalty(0); },
       {{"repetition_penalty", 0}},
       "sampling.repetition_penalty",
       "repetition_penalty"},
      {"repetition inf",
       [=](auto* r) { s(r)->set_repetition_penalty(std::numeric_limits<float>::infinity()); },
       nullptr, "sampling.repetition_penalty", ""},
      {"penalty_last_n<-1", [=](auto* r) { s(r)->set_penalty_last_n(-2); }, nullptr,
       "sampling.penalty_last_n", ""},
      {"max_tokens=0",
       [=](auto* r) { s(r)->set_max_tokens(0); },
       {{"max_tokens", 0}},
       "sampling.max_tokens",
       "max_tokens"},
      {"max_tokens beyond context",
       [=](auto* r) { s(r)->set_max_tokens(300); },
       {{"max_tokens", 300}},
       "sampling.max_tokens",
       "max_tokens"},
      {"too many stops",
       [=](auto* r) {
         for (int i = 0; i < 17; ++i) s(r)->add_stop(absl::StrCat("s", i));
       },
       {{"stop", many_stops}},
       "sampling.stop",
       "stop"},
      {"stop too long",
       [=](auto* r) { s(r)->add_stop(std::string(300, 'x')); },
       {{"stop", std::string(300, 'x')}},
       "sampling.stop",
       "stop"},
      {"empty stop", [=](auto* r) { s(r)->add_stop(""); }, nullptr, "sampling.stop", ""},
      {"stop id outside vocab",
       [=](auto* r) { s(r)->add_stop_token_ids(99999); },
       {{"stop_token_ids", {99999}}},
       "sampling.stop_token_ids",
       "stop_token_ids"},
      {"too many stop ids",
       [=](auto* r) {
         for (int i = 0; i < 300; ++i) s(r)->add_stop_token_ids(1);
       },
       nullptr, "sampling.stop_token_ids", ""},
      {"no prompt", [](auto* r) { r->clear_text(); }, nullptr, "prompt", ""},
      {"empty token ids",
       [](auto* r) { r->mutable_token_ids(); },
       {{"prompt", json::array()}},
       "prompt.token_ids",
       "prompt"},
      {"id outside vocab",
       [](auto* r) {
         r->mutable_token_ids()->add_ids(1);
         r->mutable_token_ids()->add_ids(99999);
       },
       {{"prompt", {1, 99999}}},
       "prompt.token_ids[1]",
       "prompt"},
      {"negative id",
       [](auto* r) { r->mutable_token_ids()->add_ids(-1); },
       {{"prompt", {-1}}},
       "prompt.token_ids[0]",
       "prompt"},
      {"prompt fills the context",
       [=](auto* r) {
         for (int32_t id : long_prompt) r->mutable_token_ids()->add_ids(id);
       },
       {{"prompt", long_prompt_json}},
       "prompt",
       "prompt"},
      {"request_id too long", [](auto* r) { r->set_request_id(std::string(300, 'r')); }, nullptr,
       "request_id", ""},
  };
}

TEST_F(RouterSecurityTest, EveryBadGrpcRequestIsInvalidArgumentNamingTheField) {
  StartRouter();
  int checked = 0;
  for (const Case& c : Table()) {
    if (!c.grpc) continue;
    v1::GenerateRequest r = Good();
    c.grpc(&r);
    grpc::Status st = Generate(r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.name << ": " << st.error_message();
    EXPECT_TRUE(absl::StartsWith(st.error_message(), c.field))
        << c.name << ": '" << st.error_message() << "' does not start with " << c.field;
    ++checked;
  }
  EXPECT_GE(checked, 25);
  // Still serving.
  EXPECT_TRUE(Generate(Good()).ok());
  v1::GenerateRequest edge = Good();  // the limits themselves are accepted
  edge.mutable_sampling()->set_top_k(-1);
  edge.mutable_sampling()->set_top_p(1);
  edge.mutable_sampling()->set_min_p(1);
  edge.mutable_sampling()->set_presence_penalty(-2);
  edge.mutable_sampling()->set_frequency_penalty(2);
  edge.mutable_sampling()->set_temperature(0);
  for (int i = 0; i < 16; ++i) edge.mutable_sampling()->add_stop(std::string(256, 'a' + i));
  EXPECT_TRUE(Generate(edge).ok());
}

TEST_F(RouterSecurityTest, EveryBadHttpRequestIs400NamingTheParam) {
  StartRouter();
  int checked = 0;
  for (const Case& c : Table()) {
    if (c.http.is_null()) continue;
    json body = {{"prompt", "hello"}, {"max_tokens", 4}};
    body.update(c.http);
    httplib::Result r = PostCompletion(body);
    ASSERT_TRUE(r) << c.name;
    EXPECT_EQ(r->status, 400) << c.name << ": " << r->body;
    const json j = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(j.contains("error")) << c.name << ": " << r->body;
    EXPECT_EQ(j["error"]["type"], "invalid_request_error") << c.name;
    EXPECT_EQ(j["error"]["param"], c.param) << c.name << ": " << r->body;
    ++checked;
  }
  EXPECT_GE(checked, 18);
  httplib::Result ok = PostCompletion({{"prompt", "hello"}, {"max_tokens", 4}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

TEST_F(RouterSecurityTest, OversizedMessagesAreRefusedAndTheRouterStaysUp) {
  StartRouter();
  v1::GenerateRequest big = Good();
  big.set_text(std::string(kMaxMessage + 1024, 'a'));
  EXPECT_EQ(Generate(big).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  httplib::Result r = PostCompletion({{"prompt", std::string(kMaxMessage + 1024, 'a')}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_TRUE(Generate(Good()).ok());
  httplib::Result ok = PostCompletion({{"prompt", "hello"}, {"max_tokens", 4}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
}

// ---- API keys and rate limits -----------------------------------------------------------------

TEST(AuthenticatorTest, ParsesTextAndJsonKeyFiles) {
  auto a = Authenticator::Parse("# keys\n\nk-alice alice\n  k-bob\tbob 2 5 \nk-bob2 bob 2 5\n");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->num_keys(), 3u);
  EXPECT_EQ(*(*a)->Authenticate("Bearer k-alice"), "alice");
  EXPECT_EQ(*(*a)->Authenticate("bearer   k-bob2 "), "bob");
  auto j = Authenticator::Parse(
      R"({"keys": [{"key": "k1", "tenant": "t1", "rps": 1.5}, {"key": "k2", "tenant": "t2"}]})");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(*(*j)->Authenticate("Bearer k2"), "t2");
}

TEST(AuthenticatorTest, BadKeyFilesNameTheEntry) {
  struct Bad {
    std::string text, where;
  } bad[] = {
      {"k1 t1\nk1 t2\n", "line 2"},        // a key twice
      {"k1 t1\nonlykey\n", "line 2"},      // no tenant
      {"k1 t1 fast\n", "line 1"},          // rps not a number
      {"k1 t1 -1\n", "line 1"},            // negative rate
      {"k1 t 1 2\nk2 t 3 4\n", "line 2"},  // one tenant, two limits
      {R"({"keys": [{"key": "k"}]})", "keys[0]"},
      {"# nothing\n", "no key"},
      {"{not json", "JSON"},
  };
  for (const Bad& b : bad) {
    auto a = Authenticator::Parse(b.text);
    ASSERT_FALSE(a.ok()) << b.text;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(a.status().message(), b.where)) << a.status();
  }
  EXPECT_EQ(Authenticator::Load("/nonexistent/keys").status().code(), absl::StatusCode::kNotFound);
}

TEST(AuthenticatorTest, TenantDefaultsComeFromJsonAndAreChecked) {
  auto a = Authenticator::Parse(R"({"keys": [
      {"key": "k1", "tenant": "npc", "priority": "interactive", "ttft_target_ms": 400},
      {"key": "k2", "tenant": "npc", "priority": "interactive", "ttft_target_ms": 400},
      {"key": "k3", "tenant": "batch-jobs", "priority": "batch", "tpot_target_ms": 200},
      {"key": "k4", "tenant": "plain"}]})");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->DefaultsFor("npc"), (TenantDefaults{"interactive", 400, 0}));
  EXPECT_EQ((*a)->DefaultsFor("batch-jobs"), (TenantDefaults{"batch", 0, 200}));
  EXPECT_EQ((*a)->DefaultsFor("plain"), TenantDefaults{});
  struct Bad {
    std::string text, why;
  } bad[] = {
      {R"({"keys": [{"key": "k", "tenant": "t", "priority": "urgent"}]})", "\"priority\""},
      {R"({"keys": [{"key": "k", "tenant": "t", "priority": 1}]})", "\"priority\""},
      {R"({"keys": [{"key": "k", "tenant": "t", "ttft_target_ms": -1}]})", "ttft_target_ms"},
      {R"({"keys": [{"key": "k", "tenant": "t", "ttft_target_ms": 1.5}]})", "ttft_target_ms"},
      {R"({"keys": [{"key": "k", "tenant": "t", "tpot_target_ms": 3600001}]})", "tpot_target_ms"},
      {R"({"keys": [{"key": "k", "tenant": "t", "priority": "batch"},
                    {"key": "k2", "tenant": "t", "priority": "standard"}]})", "other defaults"},
  };
  for (const Bad& b : bad) {
    auto r = Authenticator::Parse(b.text);
    ASSERT_FALSE(r.ok()) << b.text;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(r.status().message(), b.why)) << r.status();
  }
}

TEST(AuthenticatorTest, RejectsMissingMalformedAndUnknownKeys) {
  auto a = Authenticator::Parse("k-alice alice\n");
  ASSERT_TRUE(a.ok());
  for (const char* h :
       {"", "k-alice", "Basic k-alice", "Bearer ", "Bearer k-alicex", "Bearer k-alic"}) {
    EXPECT_EQ((*a)->Authenticate(h).status().code(), absl::StatusCode::kUnauthenticated) << h;
  }
}

TEST(AuthenticatorTest, TokenBucketAllowsBurstThenRate) {
  auto a = Authenticator::Parse("k t 2 3\nfree u\n");
  ASSERT_TRUE(a.ok());
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  absl::Duration wait;
  for (int i = 0; i < 3; ++i) EXPECT_TRUE((*a)->Admit("t", t0, &wait).ok()) << i;
  absl::Status st = (*a)->Admit("t", t0, &wait);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NEAR(absl::ToDoubleSeconds(wait), 0.5, 1e-6);  // one token at 2/s
  EXPECT_TRUE(absl::StrContains(st.message(), "'t'")) << st;
  EXPECT_FALSE((*a)->Admit("t", t0 + absl::Milliseconds(250), &wait).ok());
  EXPECT_NEAR(absl::ToDoubleSeconds(wait), 0.25, 1e-6);
  EXPECT_TRUE((*a)->Admit("t", t0 + absl::Milliseconds(500), &wait).ok());
  EXPECT_FALSE((*a)->Admit("t", t0 + absl::Milliseconds(500), &wait).ok());
  // Refill is capped at the burst.
  for (int i = 0; i < 3; ++i) EXPECT_TRUE((*a)->Admit("t", t0 + absl::Hours(1), &wait).ok());
  EXPECT_FALSE((*a)->Admit("t", t0 + absl::Hours(1), &wait).ok());
  // No limit for a tenant without one.
  for (int i = 0; i < 100; ++i) EXPECT_TRUE((*a)->Admit("u", t0, &wait).ok());
}

TEST(AuthenticatorTest, TenantSaltIsXxh3OfSecretAndTenant) {
  const std::string buf = std::string("s3cret") + '\0' + "alice";
  EXPECT_EQ(TenantSalt("s3cret", "alice"), XXH3_64bits(buf.data(), buf.size()));
  EXPECT_NE(TenantSalt("s3cret", "alice"), TenantSalt("s3cret", "bob"));
  EXPECT_NE(TenantSalt("s3cret", "alice"), TenantSalt("other", "alice"));
  // The separator keeps ("ab", "c") and ("a", "bc") apart.
  EXPECT_NE(TenantSalt("ab", "c"), TenantSalt("a", "bc"));
  EXPECT_EQ(TenantSalt("s3cret", ""), 0u);
  auto a = Authenticator::Parse("k alice\n", "s3cret");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)->SaltFor("alice"), TenantSalt("s3cret", "alice"));
}

std::shared_ptr<Authenticator> Keys() {
  auto a = Authenticator::Parse("k-alice alice\nk-bob bob 0.01 2\n", "secret");
  EXPECT_TRUE(a.ok()) << a.status();
  return std::shared_ptr<Authenticator>(std::move(*a));
}

TEST_F(RouterSecurityTest, GrpcNeedsAValidKeyAndLimitsEachTenant) {
  StartRouter(Keys());
  EXPECT_EQ(Generate(Good()).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Generate(Good(), "k-mallory").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Generate(Good(), "k-alice").ok());
  {
    grpc::ClientContext cc;
    v1::ListModelsResponse resp;
    EXPECT_EQ(inference_->ListModels(&cc, {}, &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext cc;
    cc.AddMetadata("authorization", "Bearer k-bob");
    v1::ListModelsResponse resp;
    EXPECT_TRUE(inference_->ListModels(&cc, {}, &resp).ok());  // not counted against the rate
  }
  // bob: a burst of 2, then about one request per 100 s.
  EXPECT_TRUE(Generate(Good(), "k-bob").ok());
  EXPECT_TRUE(Generate(Good(), "k-bob").ok());
  std::multimap<std::string, std::string> trailers;
  grpc::Status st = Generate(Good(), "k-bob", &trailers);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  ASSERT_EQ(trailers.count("retry-after"), 1u);
  EXPECT_GE(std::stoi(trailers.find("retry-after")->second), 90);
  // Other tenants are not held up by bob's limit.
  EXPECT_TRUE(Generate(Good(), "k-alice").ok());
}

TEST_F(RouterSecurityTest, TenantDefaultTargetsApplyWhereTheRequestIsSilent) {
  auto keys = Authenticator::Parse(R"({"keys": [
      {"key": "k-npc", "tenant": "npc", "priority": "interactive", "ttft_target_ms": 1},
      {"key": "k-plain", "tenant": "plain"}]})");
  ASSERT_TRUE(keys.ok()) << keys.status();
  StartRouter(std::shared_ptr<Authenticator>(std::move(*keys)));
  // The worker reports a fitted step cost, so the router predicts TTFTs (slo.h).
  v1::HeartbeatRequest hb;
  hb.set_worker_id("c0");
  v1::StepCost& cost = *hb.mutable_stats()->mutable_step_cost();
  cost.set_intercept_s(0.01);
  cost.set_prefill_token_s(0.001);
  cost.set_steps(100);
  v1::HeartbeatResponse hr;
  grpc::ClientContext hc;
  ASSERT_TRUE(registry_->Heartbeat(&hc, hb, &hr).ok());
  // npc's default target of 1 ms is below any prediction: refused at once.
  std::multimap<std::string, std::string> trailers;
  grpc::Status st = Generate(Good(), "k-npc", &trailers);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "target 1 ms")) << st.error_message();
  EXPECT_EQ(trailers.count("retry-after"), 1u);
  // The request's own target wins over the tenant's.
  v1::GenerateRequest own = Good();
  own.set_ttft_target_ms(60000);
  EXPECT_TRUE(Generate(own, "k-npc").ok());
  // Another tenant has no defaults.
  EXPECT_TRUE(Generate(Good(), "k-plain").ok());
}

TEST_F(RouterSecurityTest, HttpNeedsAValidKeyAndLimitsEachTenant) {
  StartRouter(Keys());
  httplib::Result r = Http().Get("/v1/models");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(r->get_header_value("WWW-Authenticate"), "Bearer");
  json j = json::parse(r->body, nullptr, false);
  EXPECT_EQ(j["error"]["code"], "invalid_api_key") << r->body;
  EXPECT_EQ(j["error"]["type"], "invalid_request_error") << r->body;
  r = Http().Get("/v1/models", {{"Authorization", "Bearer k-nope"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  r = Http().Get("/v1/models", {{"Authorization", "Bearer k-alice"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  r = Http().Get("/health");  // probes need no key
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);

  const json body = {{"prompt", "hello"}, {"max_tokens", 4}};
  r = PostCompletion(body);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  r = PostCompletion(body, "k-alice");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(PostCompletion(body, "k-bob")->status, 200);
  EXPECT_EQ(PostCompletion(body, "k-bob")->status, 200);
  r = PostCompletion(body, "k-bob");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 429) << r->body;
  EXPECT_GE(std::stoi(r->has_header("Retry-After") ? r->get_header_value("Retry-After") : "0"), 90);
  j = json::parse(r->body, nullptr, false);
  EXPECT_EQ(j["error"]["type"], "rate_limit_error") << r->body;
  EXPECT_EQ(PostCompletion(body, "k-alice")->status, 200);
}

}  // namespace
}  // namespace tandem::router
