// The router's Prometheus series, scraped from a real RouterServer (gRPC + HTTP on loopback
// port 0) in front of small fake prefill and decode workers: names and labels, counters that
// move with traffic, the TTFT breakdown on the final stream message and in its histogram, the
// replica recommendation against SLO flags, --metrics-port, and `promtool check metrics`.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "tests/fakes/child_process.h"
#include "services/common/grpc_status.h"
#include "services/router/router_server.h"
#include "tests/unit/router/router_fixture.h"
#include "tests/fakes/tiny_model.h"
#include "tests/unit/services/metrics_scrape.h"

namespace tandem::router {
namespace {

namespace fs = std::filesystem;
using ::tandem::testing::FreePort;
using ::tandem::testing::HttpGet;
using ::tandem::testing::SampleValue;

class FakeDecode final : public v1::DecodeWorker::Service {
 public:
  int tokens = 5;
  bool fail = false;
  absl::Mutex mu;
  std::vector<v1::DecodeRequest> decodes;

  grpc::Status Reserve(grpc::ServerContext*, const v1::ReserveRequest* req,
                       v1::ReserveResponse* resp) override {
    v1::KvDestination* d = resp->mutable_destination();
    d->set_decode_worker("d0");
    for (int i = 0; i < (req->prompt_tokens() + 15) / 16; ++i) d->add_block_ids(i);
    d->set_block_size(16);
    return grpc::Status::OK;
  }
  grpc::Status Decode(grpc::ServerContext*, const v1::DecodeRequest* req,
                      grpc::ServerWriter<v1::GenerateResponse>* w) override {
    {
      absl::MutexLock l(&mu);
      decodes.push_back(*req);
    }
    if (fail) return grpc::Status(grpc::StatusCode::INTERNAL, "injected decode failure");
    for (int i = 0; i < tokens; ++i) {
      absl::SleepFor(absl::Milliseconds(2));
      v1::GenerateResponse m;
      m.add_token_ids(i == 0 ? req->first_token_id() : 100 + i);
      m.set_text("x");
      if (i + 1 == tokens) {
        m.set_finished(true);
        m.set_finish_reason(v1::FINISH_REASON_LENGTH);
      }
      if (!w->Write(m)) return grpc::Status(grpc::StatusCode::CANCELLED, "gone");
    }
    return grpc::Status::OK;
  }
  grpc::Status Cancel(grpc::ServerContext*, const v1::CancelRequest*,
                      v1::CancelResponse*) override {
    return grpc::Status::OK;
  }
};

class FakePrefill final : public v1::PrefillWorker::Service {
 public:
  grpc::Status Prefill(grpc::ServerContext*, const v1::PrefillRequest*,
                       v1::PrefillResponse* resp) override {
    resp->set_first_token_id(42);
    resp->set_bytes_transferred(4096);
    resp->set_compute_seconds(0.25);
    resp->set_transfer_seconds(0.125);
    resp->set_onboard_seconds(0.0625);  // 32 prompt tokens reused, the slowest from host DRAM
    resp->set_onboard_tier("host");
    resp->set_onboarded_tokens(32);
    return grpc::Status::OK;
  }
  grpc::Status Cancel(grpc::ServerContext*, const v1::CancelRequest*,
                      v1::CancelResponse*) override {
    return grpc::Status::OK;
  }
};

class RouterMetricsTest : public RouterFixture {
 protected:
  void Start(RouterOptions o = {}) {
    o.retry_budget = absl::Seconds(1);
    StartRouter(o);
    HostWorker(&decode_, "d0", v1::WORKER_ROLE_DECODE);
    HostWorker(&prefill_, "p0", v1::WORKER_ROLE_PREFILL);
  }

  std::vector<v1::GenerateResponse> Generate(grpc::Status* status) {
    v1::GenerateRequest req;
    req.set_text("hello world");
    req.mutable_sampling()->set_max_tokens(5);
    req.mutable_sampling()->set_temperature(0);
    grpc::ClientContext cc;
    cc.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto reader = v1::Inference::NewStub(channel_)->Generate(&cc, req);
    std::vector<v1::GenerateResponse> out;
    v1::GenerateResponse m;
    while (reader->Read(&m)) out.push_back(m);
    *status = reader->Finish();
    return out;
  }

  std::string Scrape() {
    testing::HttpReply r = HttpGet(router_->http_port(), "/metrics");
    EXPECT_EQ(r.status, 200);
    return r.body;
  }
  // `tandem_NAME{model_name="...",role="router"<extra>}`.
  std::string Series(const std::string& name, const std::string& extra = "",
                     const std::string& role = "router") const {
    return absl::StrCat("tandem_", name, "{model_name=\"", router_->model().id(), "\",role=\"",
                        role, "\"", extra, "}");
  }
  // Labels are rendered sorted: finished_reason comes first.
  std::string Success(const std::string& reason) const {
    return absl::StrCat("tandem_request_success_total{finished_reason=\"", reason,
                        "\",model_name=\"", router_->model().id(), "\",role=\"router\"}");
  }
  double Value(const std::string& text, const std::string& series) {
    std::optional<double> v = SampleValue(text, series);
    EXPECT_TRUE(v.has_value()) << series << " missing from:\n" << text;
    return v.value_or(-1);
  }

  FakeDecode decode_;
  FakePrefill prefill_;
};

TEST_F(RouterMetricsTest, SeriesExistAtZeroBeforeTraffic) {
  Start();
  const std::string text = Scrape();
  for (const char* h : {"time_to_first_token_seconds", "e2e_request_latency_seconds",
                        "inter_token_latency_seconds", "request_queue_time_seconds"}) {
    EXPECT_EQ(Value(text, Series(absl::StrCat(h, "_count"))), 0) << h;
  }
  EXPECT_EQ(Value(text, Series("num_requests_running")), 0);
  EXPECT_EQ(Value(text, Series("num_requests_waiting")), 0);
  EXPECT_EQ(Value(text, Series("migrations_total")), 0);
  for (const char* r : services::kFinishReasons) {
    EXPECT_EQ(Value(text, Success(r)), 0);
  }
  for (const char* stage : kTtftStages) {
    EXPECT_EQ(
        Value(text, Series("ttft_breakdown_seconds_count", absl::StrCat(",stage=\"", stage, "\""))),
        0)
        << stage;
  }
  // One prefill and one decode worker, no latency yet: stay at one each.
  EXPECT_EQ(Value(text, Series("recommended_replicas", "", "prefill")), 1);
  EXPECT_EQ(Value(text, Series("recommended_replicas", "", "decode")), 1);
}

TEST_F(RouterMetricsTest, CountersMoveAndTheBreakdownArrivesInTheFinalMessage) {
  Start();
  constexpr int kRequests = 3;
  for (int i = 0; i < kRequests; ++i) {
    grpc::Status st;
    std::vector<v1::GenerateResponse> msgs = Generate(&st);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(msgs.size(), 5u);
    const v1::GenerateResponse& last = msgs.back();
    ASSERT_TRUE(last.finished());
    ASSERT_TRUE(last.has_ttft());
    const v1::TtftBreakdown& t = last.ttft();
    EXPECT_DOUBLE_EQ(t.prefill_compute(), 0.25);
    EXPECT_DOUBLE_EQ(t.kv_transfer(), 0.125);
    EXPECT_GE(t.queue(), 0);
    EXPECT_GT(t.first_decode_step(), 0);
    EXPECT_GT(t.total(), 0);
    EXPECT_TRUE(t.has_prefix_onboarding_tiers());
    EXPECT_EQ(t.prefix_onboarding_tiers().device(), 0);
    EXPECT_DOUBLE_EQ(t.prefix_onboarding_tiers().host(), 0.0625);
    EXPECT_EQ(t.prefix_onboarding_tiers().ssd(), 0);
    EXPECT_DOUBLE_EQ(t.prefix_onboarding(), 0.0625);
    EXPECT_EQ(last.usage().cached_prompt_tokens(), 32);
    // The same breakdown as on the first message.
    EXPECT_EQ(msgs.front().ttft().SerializeAsString(), t.SerializeAsString());
  }
  {
    // The router passes the prefill worker's transfer report on to decode.
    absl::MutexLock l(&decode_.mu);
    ASSERT_EQ(decode_.decodes.size(), static_cast<size_t>(kRequests));
    EXPECT_EQ(decode_.decodes[0].kv_transfer_bytes(), 4096u);
    EXPECT_DOUBLE_EQ(decode_.decodes[0].kv_transfer_seconds(), 0.125);
  }
  const std::string text = Scrape();
  EXPECT_EQ(Value(text, Series("time_to_first_token_seconds_count")), kRequests);
  EXPECT_EQ(Value(text, Series("e2e_request_latency_seconds_count")), kRequests);
  EXPECT_EQ(Value(text, Series("request_queue_time_seconds_count")), kRequests);
  EXPECT_EQ(Value(text, Series("inter_token_latency_seconds_count")), kRequests * 4);
  // Each inter-token gap includes the fake's 2 ms sleep.
  EXPECT_GE(Value(text, Series("inter_token_latency_seconds_sum")), kRequests * 4 * 0.002);
  EXPECT_GE(Value(text, Series("e2e_request_latency_seconds_sum")),
            Value(text, Series("time_to_first_token_seconds_sum")));
  EXPECT_EQ(Value(text, Success("length")), kRequests);
  EXPECT_EQ(Value(text, Success("stop")), 0);
  EXPECT_EQ(Value(text, Series("migrations_total")), 0);
  EXPECT_EQ(Value(text, Series("num_requests_running")), 0);
  EXPECT_DOUBLE_EQ(Value(text, Series("ttft_breakdown_seconds_sum", ",stage=\"prefill_compute\"")),
                   kRequests * 0.25);
  EXPECT_DOUBLE_EQ(Value(text, Series("ttft_breakdown_seconds_sum", ",stage=\"kv_transfer\"")),
                   kRequests * 0.125);
  EXPECT_EQ(Value(text, Series("ttft_breakdown_seconds_count", ",stage=\"prefix_onboarding_ssd\"")),
            kRequests);
  EXPECT_EQ(Value(text, Series("ttft_breakdown_seconds_sum", ",stage=\"prefix_onboarding_ssd\"")),
            0);
  EXPECT_DOUBLE_EQ(
      Value(text, Series("ttft_breakdown_seconds_sum", ",stage=\"prefix_onboarding_host\"")),
      kRequests * 0.0625);
  EXPECT_EQ(Value(text, Series("ttft_breakdown_seconds_count", ",stage=\"first_decode_step\"")),
            kRequests);

  // A failed request counts as an error and still has an e2e latency.
  decode_.fail = true;
  grpc::Status st;
  Generate(&st);
  EXPECT_FALSE(st.ok());
  const std::string after = Scrape();
  EXPECT_EQ(Value(after, Success("error")), 1);
  EXPECT_EQ(Value(after, Series("e2e_request_latency_seconds_count")), kRequests + 1);
  EXPECT_EQ(Value(after, Series("time_to_first_token_seconds_count")), kRequests);

  // promtool finds nothing at all.
  testing::PromtoolResult pr = testing::PromtoolCheckMetrics(after);
  if (!pr.available) GTEST_SKIP() << "promtool not installed";
  EXPECT_EQ(pr.exit_code, 0) << pr.output;
}

TEST_F(RouterMetricsTest, RecommendsReplicasFromSloTargets) {
  RouterOptions o;
  o.autoscale.slo_ttft_s = 1e-6;  // unreachable: prefill must scale to the cap
  o.autoscale.slo_itl_s = 100;    // trivially met: decode stays at the minimum
  o.autoscale.max_replicas = 9;
  Start(o);
  grpc::Status st;
  Generate(&st);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const std::string text = Scrape();
  EXPECT_EQ(Value(text, Series("recommended_replicas", "", "prefill")), 9);
  EXPECT_EQ(Value(text, Series("recommended_replicas", "", "decode")), 1);
  const AutoscaleInputs in = router_->router_metrics().last_inputs();
  EXPECT_EQ(in.current_prefill, 1);
  EXPECT_EQ(in.current_decode, 1);
  EXPECT_GT(in.p90_ttft_s, 0);
  EXPECT_GT(in.p90_itl_s, 0);
  // Measured prefill capacity: the prompt's tokens over the fake's 0.25 s of compute.
  EXPECT_GT(in.prefill_capacity_tps, 0);
  EXPECT_GT(in.prompt_tokens_per_s, 0);
}

TEST_F(RouterMetricsTest, ServesOnItsOwnMetricsPortToo) {
  RouterOptions o;
  o.metrics_port = FreePort();
  ASSERT_GT(o.metrics_port, 0);
  Start(o);
  ASSERT_EQ(router_->metrics_port(), o.metrics_port);
  testing::HttpReply r = HttpGet(o.metrics_port, "/metrics");
  ASSERT_EQ(r.status, 200);
  EXPECT_TRUE(SampleValue(r.body, Series("time_to_first_token_seconds_count")).has_value());
  EXPECT_TRUE(SampleValue(r.body, Series("recommended_replicas", "", "decode")).has_value());
}

}  // namespace
}  // namespace tandem::router
