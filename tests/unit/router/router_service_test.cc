// The router's gRPC services end to end, in one process: a real RouterServer on port 0 in front
// of small fake prefill and decode workers (real gRPC servers on port 0) that record what they
// are sent. Covers the disaggregated handoff, colocated fallback, validation, failover, deadline
// and cancellation propagation, admission limits, draining, leases and selection policies.
#include <atomic>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "services/common/grpc_status.h"
#include "services/router/router_server.h"
#include "tests/fakes/tiny_model.h"
#include "tools/tandem/cluster.h"

namespace tandem::router {
namespace {

namespace fs = std::filesystem;

// Milliseconds from now to the call's deadline (a huge number when it has none).
int64_t RemainingMs(const grpc::ServerContext* ctx) {
  return absl::ToInt64Milliseconds(services::FromChronoDeadline(ctx->deadline()) - absl::Now());
}

struct Recorded {
  absl::Mutex mu;
  std::vector<v1::ReserveRequest> reserves;
  std::vector<v1::PrefillRequest> prefills;
  std::vector<v1::DecodeRequest> decodes;
  std::vector<std::string> cancels;
  std::vector<std::string> prefill_started;  // request ids, as prefills begin
  std::vector<int64_t> remaining_ms;  // per call, in arrival order
  int streams_cut = 0;                // Decode streams that saw their call cancelled
};

class FakeDecode final : public v1::DecodeWorker::Service {
 public:
  explicit FakeDecode(std::string id) : id_(std::move(id)) {}
  grpc::Status reserve_status = grpc::Status::OK;
  int tokens = 5;
  absl::Duration token_delay = absl::ZeroDuration();
  Recorded rec;

  grpc::Status Reserve(grpc::ServerContext* ctx, const v1::ReserveRequest* req,
                       v1::ReserveResponse* resp) override {
    absl::MutexLock lock(&rec.mu);
    rec.reserves.push_back(*req);
    rec.remaining_ms.push_back(RemainingMs(ctx));
    if (!reserve_status.ok()) return reserve_status;
    v1::KvDestination* d = resp->mutable_destination();
    d->set_decode_worker(id_);
    d->set_region("region-of-" + id_);
    for (int i = 0; i < (req->prompt_tokens() + 15) / 16; ++i) d->add_block_ids(100 + i);
    d->set_block_size(16);
    return grpc::Status::OK;
  }

  grpc::Status Decode(grpc::ServerContext* ctx, const v1::DecodeRequest* req,
                      grpc::ServerWriter<v1::GenerateResponse>* w) override {
    {
      absl::MutexLock lock(&rec.mu);
      rec.decodes.push_back(*req);
      rec.remaining_ms.push_back(RemainingMs(ctx));
    }
    for (int i = 0; i < tokens; ++i) {
      for (absl::Time until = absl::Now() + token_delay; absl::Now() < until;) {
        if (ctx->IsCancelled()) {
          absl::MutexLock lock(&rec.mu);
          rec.streams_cut++;
          return grpc::Status(grpc::StatusCode::CANCELLED, "cut");
        }
        absl::SleepFor(absl::Milliseconds(2));
      }
      v1::GenerateResponse m;
      m.add_token_ids(i == 0 && !req->prefill_locally() ? req->first_token_id() : 100 + i);
      m.set_text(absl::StrCat("t", i, " "));
      if (i + 1 == tokens) {
        m.set_finished(true);
        m.set_finish_reason(v1::FINISH_REASON_LENGTH);
      }
      if (!w->Write(m)) {
        absl::MutexLock lock(&rec.mu);
        rec.streams_cut++;
        return grpc::Status(grpc::StatusCode::CANCELLED, "client gone");
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status Cancel(grpc::ServerContext*, const v1::CancelRequest* req,
                      v1::CancelResponse* resp) override {
    absl::MutexLock lock(&rec.mu);
    rec.cancels.push_back(req->request_id());
    resp->set_found(true);
    return grpc::Status::OK;
  }

 private:
  std::string id_;
};

class FakePrefill final : public v1::PrefillWorker::Service {
 public:
  grpc::Status status = grpc::Status::OK;
  absl::Duration delay;  // each prefill takes this long
  // Its KV cannot reach this decode worker: such a prefill fails UNAVAILABLE, marked as the
  // destination's fault as the real prefill service marks it.
  std::string unreachable_decode;
  Recorded rec;

  grpc::Status Prefill(grpc::ServerContext* ctx, const v1::PrefillRequest* req,
                       v1::PrefillResponse* resp) override {
    {
      absl::MutexLock lock(&rec.mu);
      rec.prefill_started.push_back(req->request_id());
    }
    absl::SleepFor(delay);
    absl::MutexLock lock(&rec.mu);
    rec.prefills.push_back(*req);
    rec.remaining_ms.push_back(RemainingMs(ctx));
    if (!status.ok()) return status;
    if (req->destination().decode_worker() == unreachable_decode) {
      ctx->AddTrailingMetadata(services::kFaultKey, services::kFaultDestination);
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "KV transfer to the decode worker failed: cannot reach peer");
    }
    resp->set_first_token_id(42);
    resp->add_block_checksums(11);
    resp->add_block_checksums(22);
    resp->set_bytes_transferred(1024);
    resp->set_compute_seconds(0.25);
    resp->set_transfer_seconds(0.125);
    resp->set_transport("fake");
    return grpc::Status::OK;
  }
  grpc::Status Cancel(grpc::ServerContext*, const v1::CancelRequest* req,
                      v1::CancelResponse*) override {
    absl::MutexLock lock(&rec.mu);
    rec.cancels.push_back(req->request_id());
    return grpc::Status::OK;
  }
};

// A gRPC server on 127.0.0.1:0 hosting one fake.
struct Hosted {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }
};

Hosted Host(grpc::Service* svc) {
  Hosted h;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &h.port);
  b.RegisterService(svc);
  h.server = b.BuildAndStart();
  return h;
}

class RouterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_path_ = new std::string(
        (fs::temp_directory_path() / absl::StrCat("router-tiny-", getpid(), ".gguf")).string());
    testing::TinyModelOptions mo;
    ASSERT_TRUE(testing::WriteTinyModel(mo, *model_path_).ok());
  }
  static void TearDownTestSuite() {
    fs::remove(*model_path_);
    delete model_path_;
  }
  void TearDown() override {
    for (Hosted& h : hosted_) h.server->Shutdown(std::chrono::system_clock::now());
    if (router_) router_->Shutdown(absl::ZeroDuration());
  }

  void StartRouter(RouterOptions o = {}) {
    o.model_path = *model_path_;
    o.host = "127.0.0.1";
    o.port = 0;
    if (o.worker_lease == RouterOptions().worker_lease) o.worker_lease = absl::Seconds(30);
    o.default_timeout = absl::Seconds(60);
    o.retry_budget = absl::Seconds(1);
    auto r = RouterServer::Create(o);
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = std::move(*r);
    channel_ = grpc::CreateChannel(router_->address(), grpc::InsecureChannelCredentials());
    inference_ = v1::Inference::NewStub(channel_);
    registry_ = v1::Registry::NewStub(channel_);
  }

  template <class Fake, class... Args>
  Fake& Own(Args&&... args) {
    fakes_.push_back(std::make_unique<Fake>(std::forward<Args>(args)...));
    return static_cast<Fake&>(*fakes_.back());
  }

  // Hosts the fake and registers it with the router through the Registry service.
  std::string Add(grpc::Service* svc, const std::string& id, v1::WorkerRole role,
                  int kv_blocks = 100) {
    hosted_.push_back(Host(svc));
    RegisterAt(id, role, hosted_.back().address(), kv_blocks);
    return hosted_.back().address();
  }
  void RegisterAt(const std::string& id, v1::WorkerRole role, const std::string& address,
                  int kv_blocks = 100) {
    v1::RegisterRequest rq;
    rq.set_worker_id(id);
    rq.set_role(role);
    rq.set_address(address);
    rq.set_model(*model_path_);
    rq.set_kv_blocks_total(kv_blocks);
    v1::RegisterResponse resp;
    grpc::ClientContext cc;
    ASSERT_TRUE(registry_->Register(&cc, rq, &resp).ok());
    EXPECT_GT(resp.lease_ms(), 0u);
  }

  static v1::GenerateRequest TextRequest(const std::string& text, int max_tokens = 5) {
    v1::GenerateRequest r;
    r.set_text(text);
    r.mutable_sampling()->set_max_tokens(max_tokens);
    r.mutable_sampling()->set_temperature(0);
    return r;
  }

  struct Outcome {
    grpc::Status status;
    std::vector<v1::GenerateResponse> messages;
    std::vector<int32_t> tokens;
    std::string text;
    std::multimap<std::string, std::string> trailers;
  };
  // A router with a 50 ms prefill backlog bound, one decode worker and one prefill worker that
  // takes `prefill_delay` per prefill and reports a fitted cost of 100 ms + 1 ms per token.
  FakePrefill& StartSloRouter(absl::Duration prefill_delay) {
    RouterOptions o;
    o.max_prefill_backlog = absl::Milliseconds(50);
    StartRouter(o);
    FakeDecode& decode = Own<FakeDecode>("d0");
    FakePrefill& prefill = Own<FakePrefill>();
    prefill.delay = prefill_delay;
    Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
    Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
    v1::HeartbeatRequest hb;
    hb.set_worker_id("p0");
    v1::StepCost& cost = *hb.mutable_stats()->mutable_step_cost();
    cost.set_intercept_s(0.1);
    cost.set_prefill_token_s(0.001);
    cost.set_steps(100);
    v1::HeartbeatResponse hr;
    grpc::ClientContext hc;
    EXPECT_TRUE(registry_->Heartbeat(&hc, hb, &hr).ok());
    return prefill;
  }
  static v1::GenerateRequest SloRequest(const std::string& id, v1::Priority p, uint32_t ttft_ms) {
    v1::GenerateRequest r = TextRequest("hi", 2);
    r.set_request_id(id);
    r.set_priority(p);
    r.set_ttft_target_ms(ttft_ms);
    return r;
  }
  // A router with one in-flight slot and `max_queue` waiting places, one decode and one prefill
  // worker streaming 1000 tokens `token_delay` apart, and a first request holding the slot.
  void HoldTheOnlySlot(int max_queue, absl::Duration token_delay) {
    RouterOptions o;
    o.max_inflight = 1;
    o.max_queue = max_queue;
    StartRouter(o);
    FakeDecode& decode = Own<FakeDecode>("d0");
    decode.tokens = 1000;
    decode.token_delay = token_delay;
    FakePrefill& prefill = Own<FakePrefill>();
    Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
    Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
    holder_cc_ = std::make_unique<grpc::ClientContext>();
    holder_cc_->set_deadline(services::ToChronoDeadline(absl::Now() + absl::Seconds(30)));
    holder_ = inference_->Generate(holder_cc_.get(), TextRequest("hi", 200));
    v1::GenerateResponse m;
    ASSERT_TRUE(holder_->Read(&m));
  }
  void ReleaseTheSlot() {
    holder_cc_->TryCancel();
    v1::GenerateResponse m;
    while (holder_->Read(&m)) {
    }
    holder_->Finish();
    holder_.reset();
  }
  // The context outlives the reader (members are destroyed in reverse order).
  std::unique_ptr<grpc::ClientContext> holder_cc_;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> holder_;

  Outcome Run(const v1::GenerateRequest& req, absl::Duration timeout = absl::Seconds(20)) {
    grpc::ClientContext cc;
    cc.set_deadline(services::ToChronoDeadline(absl::Now() + timeout));
    Outcome out;
    auto reader = inference_->Generate(&cc, req);
    v1::GenerateResponse m;
    while (reader->Read(&m)) {
      out.messages.push_back(m);
      out.tokens.insert(out.tokens.end(), m.token_ids().begin(), m.token_ids().end());
      out.text += m.text();
    }
    out.status = reader->Finish();
    for (const auto& [k, v] : cc.GetServerTrailingMetadata()) {
      out.trailers.emplace(std::string(k.data(), k.size()), std::string(v.data(), v.size()));
    }
    return out;
  }

  static std::string* model_path_;
  std::unique_ptr<RouterServer> router_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Inference::Stub> inference_;
  std::unique_ptr<v1::Registry::Stub> registry_;
  // The fakes live here, not in test bodies, so TearDown shuts their servers down (and waits
  // for any handler still running) before they are destroyed.
  std::vector<std::unique_ptr<grpc::Service>> fakes_;
  std::vector<Hosted> hosted_;
};

std::string* RouterTest::model_path_ = nullptr;

TEST_F(RouterTest, DisaggregatedHandoffRelaysTheDecodeStream) {
  StartRouter();
  FakeDecode& decode = Own<FakeDecode>("d0");
  FakePrefill& prefill = Own<FakePrefill>();
  Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  v1::GenerateRequest req = TextRequest("hello world", 5);
  req.mutable_sampling()->set_seed(7);
  req.set_tpot_target_ms(40);
  Outcome out = Run(req);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();

  // What the client got: every decode message, annotated.
  ASSERT_EQ(out.messages.size(), 5u);
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{42, 101, 102, 103, 104}));
  EXPECT_EQ(out.text, "t0 t1 t2 t3 t4 ");
  const std::string rid = out.messages[0].request_id();
  EXPECT_FALSE(rid.empty());
  for (const auto& m : out.messages) {
    EXPECT_EQ(m.request_id(), rid);
    EXPECT_EQ(m.prefill_worker(), "p0");
    EXPECT_EQ(m.decode_worker(), "d0");
  }
  const v1::GenerateResponse& last = out.messages.back();
  EXPECT_TRUE(last.finished());
  EXPECT_EQ(last.finish_reason(), v1::FINISH_REASON_LENGTH);
  // The prompt as the router tokenised it (BOS added), shown once.
  v1::TokenizeRequest tq;
  tq.set_text("hello world");
  tq.set_add_special(true);
  v1::TokenizeResponse tr;
  grpc::ClientContext tc;
  ASSERT_TRUE(inference_->Tokenize(&tc, tq, &tr).ok());
  ASSERT_GT(tr.token_ids_size(), 1);
  EXPECT_EQ(tr.token_ids(0), 1);  // BOS
  std::vector<int32_t> prompt(tr.token_ids().begin(), tr.token_ids().end());
  EXPECT_EQ(std::vector<int32_t>(out.messages[0].prompt_token_ids().begin(),
                                 out.messages[0].prompt_token_ids().end()),
            prompt);
  EXPECT_EQ(out.messages[1].prompt_token_ids_size(), 0);
  EXPECT_EQ(last.usage().prompt_tokens(), static_cast<int>(prompt.size()));
  EXPECT_EQ(last.usage().completion_tokens(), 5);
  EXPECT_DOUBLE_EQ(out.messages[0].ttft().prefill_compute(), 0.25);
  EXPECT_DOUBLE_EQ(out.messages[0].ttft().kv_transfer(), 0.125);
  EXPECT_GT(out.messages[0].ttft().total(), 0);

  // What the workers got: one id across the hops, the reservation handed to prefill, the
  // prefill's first token and checksums handed to decode.
  absl::MutexLock l1(&decode.rec.mu);
  absl::MutexLock l2(&prefill.rec.mu);
  ASSERT_EQ(decode.rec.reserves.size(), 1u);
  ASSERT_EQ(prefill.rec.prefills.size(), 1u);
  ASSERT_EQ(decode.rec.decodes.size(), 1u);
  const v1::ReserveRequest& rs = decode.rec.reserves[0];
  const v1::PrefillRequest& pf = prefill.rec.prefills[0];
  const v1::DecodeRequest& dc = decode.rec.decodes[0];
  EXPECT_EQ(rs.request_id(), rid);
  EXPECT_EQ(pf.request_id(), rid);
  EXPECT_EQ(dc.request_id(), rid);
  EXPECT_EQ(rs.prompt_tokens(), static_cast<int>(prompt.size()));
  EXPECT_EQ(rs.max_tokens(), 5);
  EXPECT_GT(rs.lease_ms(), 0u);
  EXPECT_DOUBLE_EQ(rs.tpot_target_s(), 0.040);  // for the decode worker's TPOT admission
  EXPECT_EQ(pf.destination().region(), "region-of-d0");
  EXPECT_EQ(pf.destination().block_ids(0), 100);
  EXPECT_EQ(std::vector<int32_t>(pf.prompt_token_ids().begin(), pf.prompt_token_ids().end()),
            prompt);
  EXPECT_EQ(pf.sampling().seed(), 7u);
  EXPECT_EQ(pf.sampling().max_tokens(), 5);
  EXPECT_FALSE(dc.prefill_locally());
  EXPECT_EQ(dc.first_token_id(), 42);
  EXPECT_EQ(std::vector<uint64_t>(dc.block_checksums().begin(), dc.block_checksums().end()),
            (std::vector<uint64_t>{11, 22}));
  EXPECT_EQ(dc.sampling().seed(), 7u);
  EXPECT_TRUE(decode.rec.cancels.empty());
}

// A session's turns all go to one decode worker: the one of highest rendezvous weight for it
// (what every router replica computes alike), with the prompt's tokens and the tenant's salt in
// the Reserve (for decode's prefix cache) and the salt in the Decode. Sessions spread over the
// workers; requests without one are placed by load as before.
TEST_F(RouterTest, ASessionsTurnsGoToItsDecodeWorkerWithThePromptsTokens) {
  StartRouter();
  const std::vector<std::string> ids = {"d0", "d1", "d2"};
  std::vector<FakeDecode*> decodes;
  for (const std::string& id : ids) {
    decodes.push_back(&Own<FakeDecode>(id));
    Add(decodes.back(), id, v1::WORKER_ROLE_DECODE);
  }
  FakePrefill& prefill = Own<FakePrefill>();
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  std::set<std::string> used;
  for (int s = 0; s < 6; ++s) {
    const std::string session = absl::StrCat("npc-", s);
    std::string want = ids[0];
    for (const std::string& id : ids) {
      if (SessionWeight(session, id) > SessionWeight(session, want)) want = id;
    }
    for (int turn = 0; turn < 3; ++turn) {
      v1::GenerateRequest req = TextRequest(absl::StrCat("turn ", turn, " of ", session), 3);
      req.set_session_id(session);
      Outcome out = Run(req);
      ASSERT_TRUE(out.status.ok()) << out.status.error_message();
      EXPECT_EQ(out.messages.back().decode_worker(), want) << session << " turn " << turn;
      used.insert(out.messages.back().decode_worker());
    }
  }
  EXPECT_GT(used.size(), 1u) << "every session went to the same worker";
  for (FakeDecode* fake : decodes) {
    FakeDecode& d = *fake;
    absl::MutexLock l(&d.rec.mu);
    ASSERT_EQ(d.rec.reserves.size(), d.rec.decodes.size());
    for (size_t i = 0; i < d.rec.reserves.size(); ++i) {
      const v1::ReserveRequest& rs = d.rec.reserves[i];
      EXPECT_EQ(rs.prompt_token_ids_size(), rs.prompt_tokens());
      EXPECT_EQ(std::vector<int32_t>(rs.prompt_token_ids().begin(), rs.prompt_token_ids().end()),
                std::vector<int32_t>(d.rec.decodes[i].prompt_token_ids().begin(),
                                     d.rec.decodes[i].prompt_token_ids().end()));
      EXPECT_EQ(rs.salt(), d.rec.decodes[i].salt());
    }
  }
  // A session id longer than the router takes is refused before any worker sees it.
  v1::GenerateRequest long_id = TextRequest("x", 2);
  long_id.set_session_id(std::string(kMaxSessionIdBytes + 1, 's'));
  EXPECT_EQ(Run(long_id).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(RouterTest, RelaysEachMessageAsItIsProduced) {
  StartRouter();
  FakeDecode& decode = Own<FakeDecode>("d0");
  decode.tokens = 10;
  decode.token_delay = absl::Milliseconds(30);
  FakePrefill& prefill = Own<FakePrefill>();
  Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  grpc::ClientContext cc;
  cc.set_deadline(services::ToChronoDeadline(absl::Now() + absl::Seconds(20)));
  auto reader = inference_->Generate(&cc, TextRequest("hi", 10));
  v1::GenerateResponse m;
  std::vector<absl::Time> arrivals;
  while (reader->Read(&m)) arrivals.push_back(absl::Now());
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_EQ(arrivals.size(), 10u);
  // The worker spaces its messages 30 ms apart; buffering anywhere would bunch them up.
  for (size_t i = 1; i < arrivals.size(); ++i) {
    EXPECT_GT(arrivals[i] - arrivals[i - 1], absl::Milliseconds(15)) << "message " << i;
  }
}

TEST_F(RouterTest, OnlyColocatedWorkersGetPrefillLocally) {
  StartRouter();
  FakeDecode& both = Own<FakeDecode>("c0");
  FakeDecode& decode_only = Own<FakeDecode>("d0");
  Add(&both, "c0", v1::WORKER_ROLE_BOTH);
  Add(&decode_only, "d0", v1::WORKER_ROLE_DECODE);  // no prefill pool: not usable alone
  v1::GenerateRequest req;
  req.mutable_token_ids()->add_ids(1);
  req.mutable_token_ids()->add_ids(260);
  req.set_tpot_target_ms(25);
  Outcome out = Run(req);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.messages.back().decode_worker(), "c0");
  absl::MutexLock lock(&both.rec.mu);
  EXPECT_TRUE(both.rec.reserves.empty());
  ASSERT_EQ(both.rec.decodes.size(), 1u);
  EXPECT_TRUE(both.rec.decodes[0].prefill_locally());
  EXPECT_EQ(both.rec.decodes[0].prompt_token_ids_size(), 2);
  EXPECT_DOUBLE_EQ(both.rec.decodes[0].tpot_target_s(), 0.025);
  absl::MutexLock lock2(&decode_only.rec.mu);
  EXPECT_TRUE(decode_only.rec.decodes.empty());
}

TEST_F(RouterTest, InvalidRequestsNameTheFieldAndReachNoWorker) {
  StartRouter();
  FakeDecode& decode = Own<FakeDecode>("d0");
  FakePrefill& prefill = Own<FakePrefill>();
  Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  struct Case {
    v1::GenerateRequest req;
    grpc::StatusCode code;
    std::string needle;
  };
  std::vector<Case> cases;
  cases.push_back({v1::GenerateRequest(), grpc::StatusCode::INVALID_ARGUMENT, "prompt"});
  v1::GenerateRequest r = TextRequest("hi");
  r.mutable_sampling()->set_temperature(-1);
  cases.push_back({r, grpc::StatusCode::INVALID_ARGUMENT, "sampling.temperature"});
  r = TextRequest("hi");
  r.mutable_sampling()->set_top_p(0);
  cases.push_back({r, grpc::StatusCode::INVALID_ARGUMENT, "sampling.top_p"});
  r = TextRequest("hi", 300);  // the tiny model's context is 256
  cases.push_back({r, grpc::StatusCode::INVALID_ARGUMENT, "max_tokens"});
  r = TextRequest("hi", 0);
  cases.push_back({r, grpc::StatusCode::INVALID_ARGUMENT, "max_tokens"});
  r = v1::GenerateRequest();
  r.mutable_token_ids()->add_ids(1);
  r.mutable_token_ids()->add_ids(99999);
  cases.push_back({r, grpc::StatusCode::INVALID_ARGUMENT, "prompt.token_ids[1]"});
  r = v1::GenerateRequest();
  r.mutable_token_ids();
  cases.push_back({r, grpc::StatusCode::INVALID_ARGUMENT, "prompt.token_ids"});
  r = TextRequest("hi");
  r.set_model("gpt-9");
  cases.push_back({r, grpc::StatusCode::NOT_FOUND, "gpt-9"});
  r = TextRequest("hi");
  r.set_priority(static_cast<v1::Priority>(7));
  cases.push_back({r, grpc::StatusCode::INVALID_ARGUMENT, "priority"});
  for (const Case& c : cases) {
    Outcome out = Run(c.req);
    EXPECT_EQ(out.status.error_code(), c.code) << c.needle << ": " << out.status.error_message();
    EXPECT_NE(out.status.error_message().find(c.needle), std::string::npos)
        << out.status.error_message();
    EXPECT_TRUE(out.messages.empty());
  }
  absl::MutexLock lock(&decode.rec.mu);
  EXPECT_TRUE(decode.rec.reserves.empty());
}

TEST_F(RouterTest, NoWorkersIsUnavailable) {
  StartRouter();
  Outcome out = Run(TextRequest("hi"));
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(RouterTest, DeadlinePropagatesToEveryHop) {
  StartRouter();
  FakeDecode& decode = Own<FakeDecode>("d0");
  FakePrefill& prefill = Own<FakePrefill>();
  Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  Outcome out = Run(TextRequest("hi"), absl::Seconds(3));
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  absl::MutexLock l1(&decode.rec.mu);
  absl::MutexLock l2(&prefill.rec.mu);
  ASSERT_EQ(decode.rec.remaining_ms.size(), 2u);  // Reserve, Decode
  ASSERT_EQ(prefill.rec.remaining_ms.size(), 1u);
  for (int64_t ms :
       {decode.rec.remaining_ms[0], prefill.rec.remaining_ms[0], decode.rec.remaining_ms[1]}) {
    // gRPC sends deadlines as timeouts rounded up, so allow a few ms over.
    EXPECT_GT(ms, 1000);
    EXPECT_LE(ms, 3050);
  }
}

TEST_F(RouterTest, RequestsWithoutDeadlineGetTheRoutersDefault) {
  StartRouter();  // default_timeout 60 s
  FakeDecode& decode = Own<FakeDecode>("d0");
  FakePrefill& prefill = Own<FakePrefill>();
  Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  grpc::ClientContext cc;  // no deadline
  auto reader = inference_->Generate(&cc, TextRequest("hi"));
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
  }
  ASSERT_TRUE(reader->Finish().ok());
  absl::MutexLock l1(&decode.rec.mu);
  absl::MutexLock l2(&prefill.rec.mu);
  // Reserve gets the control timeout, the rest the router's default (plus gRPC's rounding).
  EXPECT_LE(decode.rec.remaining_ms[0], 5050);
  EXPECT_LE(prefill.rec.remaining_ms[0], 60050);
  EXPECT_GT(prefill.rec.remaining_ms[0], 50000);
  EXPECT_LE(decode.rec.remaining_ms[1], 60050);
}

TEST_F(RouterTest, ClientCancellationCutsTheStreamAndCancelsOnTheWorker) {
  StartRouter();
  FakeDecode& decode = Own<FakeDecode>("d0");
  decode.tokens = 500;
  decode.token_delay = absl::Milliseconds(20);
  FakePrefill& prefill = Own<FakePrefill>();
  Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  v1::GenerateRequest req = TextRequest("hi", 200);
  req.set_request_id("cancel-me");
  grpc::ClientContext cc;
  cc.set_deadline(services::ToChronoDeadline(absl::Now() + absl::Seconds(30)));
  auto reader = inference_->Generate(&cc, req);
  v1::GenerateResponse m;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&m));
  const absl::Time t0 = absl::Now();
  cc.TryCancel();
  while (reader->Read(&m)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The worker must learn promptly: its stream is cut and Cancel names the request.
  bool cut = false, cancelled = false;
  while (absl::Now() - t0 < absl::Seconds(5) && !(cut && cancelled)) {
    absl::SleepFor(absl::Milliseconds(10));
    absl::MutexLock lock(&decode.rec.mu);
    cut = decode.rec.streams_cut == 1;
    cancelled = std::find(decode.rec.cancels.begin(), decode.rec.cancels.end(), "cancel-me") !=
                decode.rec.cancels.end();
  }
  EXPECT_TRUE(cut);
  EXPECT_TRUE(cancelled);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  // The id is free again once the request is over.
  decode.tokens = 2;
  decode.token_delay = absl::ZeroDuration();
  Outcome again = Run(req);
  EXPECT_TRUE(again.status.ok()) << again.status.error_message();
}

TEST_F(RouterTest, FailsOverFromAFullDecodeAndADeadPrefillWorker) {
  StartRouter();
  FakeDecode& full = Own<FakeDecode>("d0-full");
  FakeDecode& good = Own<FakeDecode>("d1");
  full.reserve_status = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "no blocks");
  Add(&full, "d0-full", v1::WORKER_ROLE_DECODE, /*kv_blocks=*/1000);  // looks best, is full
  Add(&good, "d1", v1::WORKER_ROLE_DECODE, /*kv_blocks=*/10);
  // A prefill worker whose process is gone: its port no longer listens.
  Hosted dead;
  {
    FakePrefill& gone = Own<FakePrefill>();
    dead = Host(&gone);
    dead.server->Shutdown(std::chrono::system_clock::now());
    dead.server->Wait();
  }
  RegisterAt("p0-dead", v1::WORKER_ROLE_PREFILL, dead.address());
  FakePrefill& prefill = Own<FakePrefill>();
  Add(&prefill, "p1", v1::WORKER_ROLE_PREFILL);
  Outcome out = Run(TextRequest("hi"));
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.messages.back().decode_worker(), "d1");
  EXPECT_EQ(out.messages.back().prefill_worker(), "p1");
  absl::MutexLock l1(&full.rec.mu);
  absl::MutexLock l2(&good.rec.mu);
  EXPECT_EQ(full.rec.reserves.size(), 1u);
  EXPECT_TRUE(full.rec.decodes.empty());
  EXPECT_EQ(good.rec.decodes.size(), 1u);
  EXPECT_TRUE(good.rec.cancels.empty());  // the reservation survived the prefill retry
}

TEST_F(RouterTest, FailedPrefillReleasesTheReservation) {
  StartRouter();
  FakeDecode& decode = Own<FakeDecode>("d0");
  FakePrefill& prefill = Own<FakePrefill>();
  prefill.status = grpc::Status(grpc::StatusCode::INTERNAL, "boom");
  Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  v1::GenerateRequest req = TextRequest("hi");
  req.set_request_id("doomed");
  Outcome out = Run(req);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_NE(out.status.error_message().find("prefill worker p0"), std::string::npos);
  absl::MutexLock lock(&decode.rec.mu);
  EXPECT_EQ(decode.rec.cancels, std::vector<std::string>{"doomed"});
  EXPECT_TRUE(decode.rec.decodes.empty());
}

// The retry policy: a KV transfer that fails (UNAVAILABLE from the prefill worker) is retried on
// another prefill worker by default, and fails the request at once with prefill_retries = 0;
// either way the spoiled reservation is released.
TEST_F(RouterTest, PrefillRetriesDecideRetryOrFail) {
  for (const int retries : {3, 0}) {
    SCOPED_TRACE(retries);
    RouterOptions o;
    o.prefill_retries = retries;
    StartRouter(o);
    FakeDecode& decode = Own<FakeDecode>("d0");
    FakePrefill& broken = Own<FakePrefill>();
    broken.status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "kv transfer to d0 timed out");
    FakePrefill& good = Own<FakePrefill>();
    Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
    Add(&broken, "p0-broken", v1::WORKER_ROLE_PREFILL);
    Add(&good, "p1", v1::WORKER_ROLE_PREFILL);
    v1::GenerateRequest req = TextRequest("hi");
    req.set_request_id(absl::StrCat("r", retries));
    // The registry hands out equally loaded workers round-robin: send until the broken one has
    // had a request, and judge that request.
    Outcome out;
    for (int i = 0; i < 4; ++i) {
      req.set_request_id(absl::StrCat("r", retries, "-", i));
      out = Run(req);
      absl::MutexLock l(&broken.rec.mu);
      if (!broken.rec.prefills.empty()) break;
    }
    {
      absl::MutexLock l(&broken.rec.mu);
      ASSERT_FALSE(broken.rec.prefills.empty());
    }
    if (retries > 0) {
      ASSERT_TRUE(out.status.ok()) << out.status.error_message();
      EXPECT_EQ(out.messages.back().prefill_worker(), "p1");
    } else {
      EXPECT_EQ(out.status.error_code(), grpc::StatusCode::UNAVAILABLE);
      EXPECT_NE(out.status.error_message().find("p0-broken"), std::string::npos);
      absl::MutexLock l(&good.rec.mu);
      EXPECT_TRUE(good.rec.prefills.empty() ||
                  good.rec.prefills.back().request_id() != req.request_id());
    }
    absl::MutexLock l(&decode.rec.mu);
    EXPECT_FALSE(decode.rec.cancels.empty());  // the spoiled reservation went back
    router_->Shutdown(absl::ZeroDuration());
    router_.reset();
  }
}

// A decode worker the prefill workers' KV cannot reach (it came up without a usable address):
// the prefill worker says the fault is its destination's, so the router passes over that decode
// worker, not the prefill worker, and redoes the handoff on another decode worker with the same
// prefill worker; the spoiled reservation goes back.
TEST_F(RouterTest, AnUnreachableDecodeWorkerIsPassedOverNotThePrefillWorker) {
  StartRouter();
  FakeDecode& bad = Own<FakeDecode>("d-bad");
  FakeDecode& good = Own<FakeDecode>("d-good");
  FakePrefill& prefill = Own<FakePrefill>();
  prefill.unreachable_decode = "d-bad";
  Add(&bad, "d-bad", v1::WORKER_ROLE_DECODE);
  Add(&good, "d-good", v1::WORKER_ROLE_DECODE);
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  // The registry hands out equally loaded workers round-robin: some requests go to d-bad first.
  int tried_bad_first = 0;
  for (int i = 0; i < 4; ++i) {
    v1::GenerateRequest req = TextRequest("hi");
    req.set_request_id(absl::StrCat("r", i));
    Outcome out = Run(req);
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
    EXPECT_EQ(out.messages.back().decode_worker(), "d-good");
    EXPECT_EQ(out.messages.back().prefill_worker(), "p0");
    absl::MutexLock l(&bad.rec.mu);
    const bool reserved_bad =
        std::any_of(bad.rec.reserves.begin(), bad.rec.reserves.end(),
                    [&](const v1::ReserveRequest& r) { return r.request_id() == req.request_id(); });
    if (reserved_bad) {
      ++tried_bad_first;
      EXPECT_NE(std::find(bad.rec.cancels.begin(), bad.rec.cancels.end(), req.request_id()),
                bad.rec.cancels.end())
          << "the spoiled reservation on d-bad was not released";
    }
  }
  EXPECT_GE(tried_bad_first, 1);
}

// The only decode worker fails the request's Reserve as unreachable: the request fails, and the
// client reads why the worker was passed over, not only that none was left.
TEST_F(RouterTest, NoWorkerLeftSaysHowTheOnesPassedOverFailed) {
  StartRouter();
  FakeDecode& decode = Own<FakeDecode>("d0");
  decode.reserve_status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "kv pool is offline");
  FakePrefill& prefill = Own<FakePrefill>();
  Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  const Outcome out = Run(TextRequest("hi"));
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  const std::string& m = out.status.error_message();
  EXPECT_NE(m.find("no decode worker available"), std::string::npos) << m;
  EXPECT_NE(m.find("d0"), std::string::npos) << m;
  EXPECT_NE(m.find("kv pool is offline"), std::string::npos) << m;
}

// SLO admission against a prefill worker whose fitted cost makes one prefill 100+ ms and that
// really takes 300 ms: a request whose TTFT target the backlog would break is refused at once
// with retry-after and never reaches a worker; with a 50 ms backlog bound the router holds the
// others in its queue while the worker is busy and sends the interactive one before the batch
// one that came first.
TEST_F(RouterTest, SloAdmissionRefusesPredictedMissesAndSendsTheUrgentFirst) {
  FakePrefill& prefill = StartSloRouter(absl::Milliseconds(300));
  ASSERT_FALSE(HasFatalFailure());
  auto started = [&] {
    absl::MutexLock l(&prefill.rec.mu);
    return prefill.rec.prefill_started;
  };
  // Nothing ahead: predicted about 100 ms, within 2 s.
  Outcome first_out;
  std::thread first([&] { first_out = Run(SloRequest("first", v1::PRIORITY_STANDARD, 2000)); });
  while (started().empty()) absl::SleepFor(absl::Milliseconds(1));
  // Behind it: 100 ms of backlog and 100 ms of its own, past a 150 ms target.
  const absl::Time t0 = absl::Now();
  Outcome refused = Run(SloRequest("refused", v1::PRIORITY_INTERACTIVE, 150));
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(150)) << "refused at once, not after waiting";
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.status.error_message().find("predicted time to first token"),
            std::string::npos)
      << refused.status.error_message();
  ASSERT_EQ(refused.trailers.count("retry-after"), 1u);
  EXPECT_EQ(router_->inference().slo_rejected(), 1u);
  // The backlog is over the bound: a batch request and then an interactive one wait here.
  Outcome batch_out, urgent_out;
  std::thread batch([&] { batch_out = Run(SloRequest("batch", v1::PRIORITY_BATCH, 0)); });
  while (router_->admission().waiting() != 1) absl::SleepFor(absl::Milliseconds(1));
  std::thread urgent([&] { urgent_out = Run(SloRequest("urgent", v1::PRIORITY_INTERACTIVE, 5000)); });
  while (router_->admission().waiting() != 2) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(started().size(), 1u);
  first.join();
  batch.join();
  urgent.join();
  for (const Outcome* out : {&first_out, &batch_out, &urgent_out}) {
    EXPECT_TRUE(out->status.ok()) << out->status.error_message();
  }
  EXPECT_EQ(started(), (std::vector<std::string>{"first", "urgent", "batch"}));
}

TEST_F(RouterTest, AQueuedRequestOvertakenPastItsTargetLeavesInsteadOfBeingServedLate) {
  FakePrefill& prefill = StartSloRouter(absl::Milliseconds(400));
  ASSERT_FALSE(HasFatalFailure());
  Outcome first_out, batch_out, urgent_out;
  std::thread first([&] { first_out = Run(SloRequest("first", v1::PRIORITY_STANDARD, 0)); });
  while (true) {
    {
      absl::MutexLock l(&prefill.rec.mu);
      if (!prefill.rec.prefill_started.empty()) break;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  // Predicted about 210 ms, within 600 ms: it queues. The urgent request behind it goes first
  // when the gate opens (400 ms on), so the batch one could start no sooner than 800 ms: past
  // 600 ms less its own 104 ms and the 50 ms backlog bound (446 ms), it leaves.
  const absl::Time t0 = absl::Now();
  std::thread batch([&] { batch_out = Run(SloRequest("batch", v1::PRIORITY_BATCH, 600)); });
  while (router_->admission().waiting() != 1) absl::SleepFor(absl::Milliseconds(1));
  std::thread urgent([&] { urgent_out = Run(SloRequest("urgent", v1::PRIORITY_INTERACTIVE, 0)); });
  batch.join();
  const absl::Duration waited = absl::Now() - t0;
  EXPECT_EQ(batch_out.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << batch_out.status.error_message();
  EXPECT_EQ(batch_out.trailers.count("retry-after"), 1u);
  EXPECT_GE(waited, absl::Milliseconds(420));
  EXPECT_LT(waited, absl::Milliseconds(800)) << "it left at its give-up time";
  EXPECT_EQ(router_->inference().slo_rejected(), 1u);
  first.join();
  urgent.join();
  EXPECT_TRUE(first_out.status.ok()) << first_out.status.error_message();
  EXPECT_TRUE(urgent_out.status.ok()) << urgent_out.status.error_message();
  absl::MutexLock l(&prefill.rec.mu);
  EXPECT_EQ(prefill.rec.prefill_started, (std::vector<std::string>{"first", "urgent"}));
}

TEST_F(RouterTest, AdmissionRefusesBeyondItsLimits) {
  ASSERT_NO_FATAL_FAILURE(HoldTheOnlySlot(/*max_queue=*/0, absl::Milliseconds(10)));
  Outcome second = Run(TextRequest("hi"));
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  ASSERT_EQ(second.trailers.count("retry-after"), 1u);  // when to come back
  EXPECT_EQ(second.trailers.find("retry-after")->second, "1");
  ReleaseTheSlot();
}

TEST_F(RouterTest, AnInteractiveRequestDisplacesAQueuedBatchOne) {
  // Every stream: about 3 s, far longer than the steps below.
  ASSERT_NO_FATAL_FAILURE(HoldTheOnlySlot(/*max_queue=*/1, absl::Milliseconds(3)));
  v1::GenerateRequest batch = TextRequest("hi", 3);
  batch.set_priority(v1::PRIORITY_BATCH);
  Outcome batch_out;
  std::thread queued([&] { batch_out = Run(batch); });
  while (router_->admission().waiting() != 1) absl::SleepFor(absl::Milliseconds(1));
  // The queue is full; another batch request finds nothing less urgent to displace.
  EXPECT_EQ(Run(batch).status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  v1::GenerateRequest urgent = TextRequest("hi", 3);
  urgent.set_priority(v1::PRIORITY_INTERACTIVE);
  Outcome urgent_out;
  std::thread interactive([&] { urgent_out = Run(urgent); });
  queued.join();
  EXPECT_EQ(batch_out.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(batch_out.status.error_message().find("displaced"), std::string::npos)
      << batch_out.status.error_message();
  EXPECT_EQ(batch_out.trailers.count("retry-after"), 1u);
  ReleaseTheSlot();
  interactive.join();
  EXPECT_TRUE(urgent_out.status.ok()) << urgent_out.status.error_message();
  EXPECT_FALSE(urgent_out.tokens.empty());
}

TEST_F(RouterTest, DrainingAndDeregisteredWorkersGetNoNewRequests) {
  StartRouter();
  FakeDecode& d0 = Own<FakeDecode>("d0");
  FakeDecode& d1 = Own<FakeDecode>("d1");
  FakePrefill& prefill = Own<FakePrefill>();
  Add(&d0, "d0", v1::WORKER_ROLE_DECODE);
  Add(&d1, "d1", v1::WORKER_ROLE_DECODE);
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  v1::HeartbeatRequest hb;
  hb.set_worker_id("d0");
  hb.set_draining(true);
  v1::HeartbeatResponse hr;
  grpc::ClientContext hc;
  ASSERT_TRUE(registry_->Heartbeat(&hc, hb, &hr).ok());
  EXPECT_TRUE(hr.known());
  for (int i = 0; i < 4; ++i) {
    Outcome out = Run(TextRequest("hi"));
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
    EXPECT_EQ(out.messages.back().decode_worker(), "d1");
  }
  v1::DeregisterRequest dr;
  dr.set_worker_id("d1");
  v1::DeregisterResponse dresp;
  grpc::ClientContext dc;
  ASSERT_TRUE(registry_->Deregister(&dc, dr, &dresp).ok());
  EXPECT_EQ(Run(TextRequest("hi")).status.error_code(), grpc::StatusCode::UNAVAILABLE);
  absl::MutexLock lock(&d0.rec.mu);
  EXPECT_TRUE(d0.rec.reserves.empty());
}

TEST_F(RouterTest, ExpiredLeaseDropsASilentWorker) {
  RouterOptions o;
  o.worker_lease = absl::Milliseconds(300);
  StartRouter(o);
  FakeDecode& decode = Own<FakeDecode>("d0");
  Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
  auto list = [&] {
    v1::ListWorkersResponse resp;
    grpc::ClientContext cc;
    EXPECT_TRUE(registry_->ListWorkers(&cc, v1::ListWorkersRequest(), &resp).ok());
    return resp;
  };
  ASSERT_EQ(list().workers_size(), 1);
  EXPECT_EQ(list().workers(0).role(), v1::WORKER_ROLE_DECODE);
  const absl::Time t0 = absl::Now();
  while (list().workers_size() != 0 && absl::Now() - t0 < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(list().workers_size(), 0);
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(250));
  v1::HeartbeatRequest hb;
  hb.set_worker_id("d0");
  v1::HeartbeatResponse hr;
  grpc::ClientContext hc;
  ASSERT_TRUE(registry_->Heartbeat(&hc, hb, &hr).ok());
  EXPECT_FALSE(hr.known());
}

TEST_F(RouterTest, ShutdownLetsRunningStreamsFinishRefusesNewOnesAndIsPromptWhenIdle) {
  StartRouter();
  FakeDecode& decode = Own<FakeDecode>("d0");
  decode.tokens = 40;
  decode.token_delay = absl::Milliseconds(10);
  FakePrefill& prefill = Own<FakePrefill>();
  Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
  Add(&prefill, "p0", v1::WORKER_ROLE_PREFILL);
  grpc::ClientContext cc;
  cc.set_deadline(services::ToChronoDeadline(absl::Now() + absl::Seconds(30)));
  auto reader = inference_->Generate(&cc, TextRequest("hi", 40));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));
  const absl::Time t0 = absl::Now();
  std::thread stopper([&] { router_->Shutdown(absl::Seconds(10)); });
  // The running stream completes in full.
  int messages = 1;
  while (reader->Read(&m)) messages++;
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(messages, 40);
  stopper.join();
  // Done soon after the stream, although this test still holds an idle connection.
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
  EXPECT_EQ(Run(TextRequest("hi")).status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

// Prefill p0 reports a long queue: least-load avoids it, round-robin rotates anyway.
class PolicyTest : public RouterTest, public ::testing::WithParamInterface<Policy> {};

TEST_P(PolicyTest, PrefillSelectionFollowsThePolicy) {
  RouterOptions o;
  o.policy = GetParam();
  StartRouter(o);
  FakeDecode& decode = Own<FakeDecode>("d0");
  FakePrefill& p0 = Own<FakePrefill>();
  FakePrefill& p1 = Own<FakePrefill>();
  Add(&decode, "d0", v1::WORKER_ROLE_DECODE);
  Add(&p0, "p0", v1::WORKER_ROLE_PREFILL);
  Add(&p1, "p1", v1::WORKER_ROLE_PREFILL);
  v1::HeartbeatRequest hb;
  hb.set_worker_id("p0");
  hb.mutable_stats()->set_waiting(9);
  v1::HeartbeatResponse hr;
  grpc::ClientContext hc;
  ASSERT_TRUE(registry_->Heartbeat(&hc, hb, &hr).ok());
  std::vector<std::string> order;
  for (int i = 0; i < 4; ++i) {
    Outcome out = Run(TextRequest("hi"));
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
    order.push_back(out.messages.back().prefill_worker());
  }
  if (GetParam() == Policy::kRoundRobin) {
    EXPECT_EQ(order, (std::vector<std::string>{"p0", "p1", "p0", "p1"}));
  } else {
    EXPECT_EQ(order, (std::vector<std::string>{"p1", "p1", "p1", "p1"}));
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, PolicyTest,
                         ::testing::Values(Policy::kLeastLoad, Policy::kRoundRobin),
                         [](const auto& info) {
                           return info.param == Policy::kLeastLoad ? "LeastLoad" : "RoundRobin";
                         });

TEST_F(RouterTest, ListModelsTokenizeAndHealth) {
  StartRouter();
  v1::ListModelsResponse lm;
  grpc::ClientContext c1;
  ASSERT_TRUE(inference_->ListModels(&c1, v1::ListModelsRequest(), &lm).ok());
  ASSERT_EQ(lm.models_size(), 1);
  EXPECT_EQ(lm.models(0).id(), fs::path(*model_path_).stem().string());
  EXPECT_EQ(lm.models(0).architecture(), "llama");
  EXPECT_EQ(lm.models(0).context_length(), 256);
  EXPECT_GT(lm.models(0).vocab_size(), 259);
  v1::TokenizeRequest tq;
  tq.set_text("ab");
  v1::TokenizeResponse tr;
  grpc::ClientContext c2;
  ASSERT_TRUE(inference_->Tokenize(&c2, tq, &tr).ok());
  EXPECT_GT(tr.token_ids_size(), 0);
  EXPECT_NE(tr.token_ids(0), 1);  // no BOS without add_special
  absl::StatusOr<bool> serving = tools::CheckHealth(router_->address(), absl::Seconds(5));
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_TRUE(*serving);
  EXPECT_FALSE(tools::CheckHealth("127.0.0.1:1", absl::Milliseconds(500)).ok());
}

}  // namespace
}  // namespace tandem::router
