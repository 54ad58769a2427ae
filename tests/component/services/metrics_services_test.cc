// The services' Prometheus series, scraped over HTTP from a MetricsServer on an ephemeral port
// while real workers (tiny model, in-process KV transport) run requests: the decode worker
// (disaggregated and colocated), the prefill worker and the KV store. Checks the DESIGN.md
// names and labels, that each request moves the series it should by the right amount, and
// (where promtool is installed) that every exposition passes `promtool check metrics`.
#include <cmath>
#include <limits>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/transfer/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "services/common/metrics.h"
#include "services/common/sampling_convert.h"
#include "services/decode/decode_worker.h"
#include "services/kvstore/memory_tiers.h"
#include "services/kvstore/metrics.h"
#include "services/kvstore/tiered_store.h"
#include "services/prefill/prefill_worker.h"
#include "tests/component/services/cluster_fixture.h"
#include "tests/unit/services/metrics_scrape.h"

namespace tandem::testing {
namespace {

using services::Metrics;
using services::MetricsServer;

std::string Labels(const std::string& role) {
  return "{model_name=\"tiny\",role=\"" + role + "\"}";
}

std::string Series(const std::string& name, const std::string& role) {
  return "tandem_" + name + Labels(role);
}

std::string Success(const std::string& reason, const std::string& role) {
  return "tandem_request_success_total{finished_reason=\"" + reason +
         "\",model_name=\"tiny\",role=\"" + role + "\"}";
}

// Reads a stream to its final event; returns the events with a token and the final status.
struct Drained {
  int tokens = 0;
  absl::Status status = absl::InternalError("no final event");
};
Drained Drain(decode::TokenStream& s) {
  Drained d;
  engine::TokenEvent ev;
  while (s.Next(absl::Now() + absl::Seconds(30), &ev)) {
    if (ev.token >= 0) ++d.tokens;
    if (ev.finished) {
      d.status = ev.status;
      return d;
    }
  }
  return d;
}

// A metrics endpoint of its own for one service.
class Scraper {
 public:
  explicit Scraper(Metrics* m) {
    auto s = MetricsServer::Start("127.0.0.1", 0, m);
    EXPECT_TRUE(s.ok()) << s.status();
    if (s.ok()) server_ = std::move(*s);
  }
  std::string Get() {
    if (server_ == nullptr) return "";
    HttpReply r = HttpGet(server_->port(), "/metrics");
    EXPECT_EQ(r.status, 200);
    return r.body;
  }
  // Scrapes until `series` reads `want` (gauges settle one engine turn after a stream ends).
  std::optional<double> WaitFor(const std::string& series, double want) {
    std::optional<double> v;
    for (int i = 0; i < 200; ++i) {
      v = SampleValue(Get(), series);
      if (v == want) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return v;
  }

 private:
  std::unique_ptr<MetricsServer> server_;
};

// Every sample is a tandem_ series labelled with the model and `role`, except the exposer's
// own unlabelled exposer_* series (scrape counts, bytes and latency).
void ExpectContractLabels(const std::string& text, const std::string& role) {
  ASSERT_FALSE(text.empty());
  for (const std::string& line : SampleLines(text)) {
    if (line.rfind("exposer_", 0) == 0) continue;
    EXPECT_EQ(line.rfind("tandem_", 0), 0u) << line;
    EXPECT_NE(line.find("model_name=\"tiny\""), std::string::npos) << line;
    EXPECT_NE(line.find("role=\"" + role + "\""), std::string::npos) << line;
  }
}

class MetricsServicesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = LoadTestModel("tiny");
    ASSERT_NE(model_, nullptr);
  }

  std::unique_ptr<decode::DecodeWorker> MakeDecode(Metrics* m, const std::string& role,
                                                   transfer::KvTransport* transport,
                                                   std::function<void()> before_step = {}) {
    decode::DecodeWorkerOptions o;
    o.model = model_;
    o.engine = TestEngineOptions(64, kernels::DType::kF32);
    o.worker_id = "decode-0";
    o.transport = transport;
    o.quarantine = absl::Milliseconds(50);
    o.before_step = std::move(before_step);
    o.metrics = &m->Serving("tiny", role);
    o.util_metrics = &m->Utilization("tiny", role);
    o.peaks = {20.0, 100.0};  // given, not measured: the figures below divide by them
    auto w = decode::DecodeWorker::Create(o);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? std::move(*w) : nullptr;
  }

  std::unique_ptr<prefill::PrefillWorker> MakePrefill(Metrics* m,
                                                      transfer::KvTransport* transport) {
    prefill::PrefillWorkerOptions o;
    o.model = model_;
    o.engine = TestEngineOptions(24, kernels::DType::kF32);
    o.worker_id = "prefill-0";
    o.transport = transport;
    o.metrics = &m->Serving("tiny", "prefill");
    o.util_metrics = &m->Utilization("tiny", "prefill");
    o.peaks = {20.0, 100.0};
    auto w = prefill::PrefillWorker::Create(o);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? std::move(*w) : nullptr;
  }

  // Reserve on decode, prefill into it; the DecodeRequest to send next (kv_transfer_* passed on
  // as the router is to do), and the prefill's answer.
  std::pair<v1::DecodeRequest, v1::PrefillResponse> ReserveAndPrefill(
      decode::DecodeWorker& d, prefill::PrefillWorker& p, const std::string& id,
      const std::vector<int32_t>& prompt, const engine::SamplingParams& sp) {
    v1::ReserveRequest rr;
    rr.set_request_id(id);
    rr.set_prompt_tokens(static_cast<int32_t>(prompt.size()));
    rr.set_max_tokens(sp.max_tokens);
    absl::StatusOr<v1::ReserveResponse> res = d.Reserve(rr);
    EXPECT_TRUE(res.ok()) << res.status();
    v1::PrefillRequest pr;
    pr.set_request_id(id);
    for (int32_t t : prompt) pr.add_prompt_token_ids(t);
    *pr.mutable_sampling() = services::SamplingToProto(sp);
    if (res.ok()) *pr.mutable_destination() = res->destination();
    absl::StatusOr<v1::PrefillResponse> presp = p.Prefill(pr, absl::Now() + absl::Seconds(30));
    EXPECT_TRUE(presp.ok()) << presp.status();
    v1::DecodeRequest dr;
    dr.set_request_id(id);
    for (int32_t t : prompt) dr.add_prompt_token_ids(t);
    *dr.mutable_sampling() = services::SamplingToProto(sp);
    if (!presp.ok()) return {dr, {}};
    dr.set_first_token_id(presp->first_token_id());
    for (uint64_t c : presp->block_checksums()) dr.add_block_checksums(c);
    dr.set_kv_transfer_bytes(presp->bytes_transferred());
    dr.set_kv_transfer_seconds(presp->transfer_seconds());
    return {dr, *presp};
  }

  std::shared_ptr<const engine::Model> model_;
};

TEST_F(MetricsServicesTest, DisaggregatedRequestMovesDecodeAndPrefillSeries) {
  Metrics dm, pm;  // two processes in production: one registry each
  auto dt = transfer::CreateInProcessTransport("decode");
  auto pt = transfer::CreateInProcessTransport("prefill");
  auto decode = MakeDecode(&dm, "decode", dt.get());
  auto prefill = MakePrefill(&pm, pt.get());
  ASSERT_NE(decode, nullptr);
  ASSERT_NE(prefill, nullptr);
  Scraper ds(&dm), ps(&pm);

  constexpr int kRequests = 2, kTokens = 9;
  uint64_t bytes = 0;
  double transfer_seconds = 0;
  for (int i = 0; i < kRequests; ++i) {
    const std::string id = "req-" + std::to_string(i);
    auto [dr, presp] =
        ReserveAndPrefill(*decode, *prefill, id, TestPrompt(40 + i, 7 + i), Greedy(kTokens));
    ASSERT_GT(presp.bytes_transferred(), 0u);
    bytes += presp.bytes_transferred();
    transfer_seconds += presp.transfer_seconds();
    auto stream = decode->StartDecode(dr);
    ASSERT_TRUE(stream.ok()) << stream.status();
    const Drained d = Drain(**stream);
    ASSERT_TRUE(d.status.ok()) << d.status;
    ASSERT_EQ(d.tokens, kTokens);
  }

  // Decode: every token but each request's first is an inter-token interval; TTFT is not
  // decode's to measure when prefill produced the first token.
  EXPECT_EQ(ds.WaitFor(Series("num_requests_running", "decode"), 0), 0);
  EXPECT_EQ(ds.WaitFor(Series("kv_cache_usage_perc", "decode"), 0), 0);
  const std::string d = ds.Get();
  ExpectContractLabels(d, "decode");
  EXPECT_NE(d.find("# TYPE tandem_inter_token_latency_seconds histogram"), std::string::npos);
  EXPECT_EQ(SampleValue(d, Series("inter_token_latency_seconds_count", "decode")),
            kRequests * (kTokens - 1))
      << d;
  EXPECT_GT(*SampleValue(d, Series("inter_token_latency_seconds_sum", "decode")), 0);
  EXPECT_EQ(SampleValue(d, Series("e2e_request_latency_seconds_count", "decode")), kRequests);
  EXPECT_EQ(SampleValue(d, Series("request_queue_time_seconds_count", "decode")), kRequests);
  EXPECT_EQ(SampleValue(d, Series("time_to_first_token_seconds_count", "decode")), 0);
  EXPECT_EQ(SampleValue(d, Success("length", "decode")), kRequests);
  EXPECT_EQ(SampleValue(d, Success("stop", "decode")), 0);
  EXPECT_EQ(SampleValue(d, Series("kv_transfer_bytes_count", "decode")), kRequests);
  EXPECT_EQ(SampleValue(d, Series("kv_transfer_bytes_sum", "decode")), double(bytes));
  EXPECT_EQ(SampleValue(d, Series("kv_transfer_seconds_count", "decode")), kRequests);
  EXPECT_NEAR(*SampleValue(d, Series("kv_transfer_seconds_sum", "decode")), transfer_seconds, 1e-9);
  EXPECT_EQ(SampleValue(d, Series("num_requests_waiting", "decode")), 0);
  EXPECT_EQ(SampleValue(d, Series("kv_integrity_failures_total", "decode")), 0);

  // Prefill: its own view of the same transfers, queue time and request latency.
  EXPECT_EQ(ps.WaitFor(Series("num_requests_running", "prefill"), 0), 0);
  const std::string p = ps.Get();
  ExpectContractLabels(p, "prefill");
  EXPECT_EQ(SampleValue(p, Series("kv_transfer_bytes_count", "prefill")), kRequests) << p;
  EXPECT_EQ(SampleValue(p, Series("kv_transfer_bytes_sum", "prefill")), double(bytes));
  EXPECT_EQ(SampleValue(p, Series("kv_transfer_seconds_count", "prefill")), kRequests);
  EXPECT_EQ(SampleValue(p, Series("request_queue_time_seconds_count", "prefill")), kRequests);
  EXPECT_EQ(SampleValue(p, Series("e2e_request_latency_seconds_count", "prefill")), kRequests);
  EXPECT_GT(*SampleValue(p, Series("e2e_request_latency_seconds_sum", "prefill")), 0);
  EXPECT_EQ(SampleValue(p, Series("num_requests_waiting", "prefill")), 0);
  EXPECT_EQ(SampleValue(p, Series("kv_cache_usage_perc", "prefill")), 0);
  // Utilisation: one observation per engine step (a 40-token prompt is 2 chunks of 24 tokens
  // at most), the gauges in (0, 1], and the step cost reported in Stats for the heartbeat.
  for (const auto& [text, role] : {std::pair{d, "decode"}, std::pair{p, "prefill"}}) {
    SCOPED_TRACE(role);
    const std::optional<double> steps =
        SampleValue(text, Series("engine_step_seconds_count", role));
    ASSERT_TRUE(steps.has_value()) << text;
    EXPECT_GE(*steps, role == std::string("decode") ? kRequests * (kTokens - 1) : 2 * kRequests);
    EXPECT_EQ(SampleValue(text, Series("step_bandwidth_utilization_count", role)), *steps);
    EXPECT_EQ(SampleValue(text, Series("step_flops_utilization_count", role)), *steps);
    // The gauge is a decayed mean of the steps' ratios, so it lies within the buckets the
    // per-step histogram filled. A tiny model in cache can beat a DRAM peak by any factor,
    // so the bound comes from the observations, not from a constant.
    for (const auto& [g, h] :
         {std::pair{"model_bandwidth_utilization", "step_bandwidth_utilization"},
          std::pair{"model_flops_utilization", "step_flops_utilization"}}) {
      SCOPED_TRACE(g);
      const std::optional<double> v = SampleValue(text, Series(g, role));
      ASSERT_TRUE(v.has_value());
      EXPECT_GT(*v, 0);
      EXPECT_TRUE(std::isfinite(*v));
      double below = 0, above = std::numeric_limits<double>::infinity();
      for (const double le : {0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0}) {
        const std::string bucket = "tandem_" + std::string(h) +
                                   "_bucket{model_name=\"tiny\",role=\"" + role + "\",le=\"" +
                                   absl::StrCat(le) + "\"}";
        const std::optional<double> n = SampleValue(text, bucket);
        ASSERT_TRUE(n.has_value()) << bucket << "\n" << text;
        if (*n == 0) below = le;
        if (*n == *steps && le < above) above = le;
      }
      EXPECT_GE(*v, below);
      EXPECT_LE(*v, above);
    }
  }
  for (const v1::WorkerStats& st : {decode->Stats(), prefill->Stats()}) {
    const v1::StepCost& c = st.step_cost();
    EXPECT_EQ(c.device(), "cpu");
    EXPECT_GT(c.steps(), 0u);
    EXPECT_GT(c.mbu(), 0);
    EXPECT_EQ(c.peak_read_gbs(), 20.0);
    EXPECT_EQ(c.peak_gflops(), 100.0);
    EXPECT_TRUE(std::isfinite(c.intercept_s()) && std::isfinite(c.decode_seq_s()));
  }
  EXPECT_GT(decode->Stats().step_cost().steps(), 0u);
  // The bytes histogram put each request in the bucket of its size, not +Inf only.
  const std::string le_inf =
      "tandem_kv_transfer_bytes_bucket{model_name=\"tiny\",role=\"prefill\","
      "le=\"+Inf\"}";
  EXPECT_EQ(SampleValue(p, le_inf), kRequests) << p;
  EXPECT_EQ(SampleValue(p,
                        "tandem_kv_transfer_bytes_bucket{model_name=\"tiny\","
                        "role=\"prefill\",le=\"4096\"}"),
            0);

  decode.reset();
  prefill.reset();
}

TEST_F(MetricsServicesTest, ColocatedRequestsRecordTtftAndEveryQueueWait) {
  Metrics m;
  auto decode = MakeDecode(&m, "both", nullptr);
  ASSERT_NE(decode, nullptr);
  Scraper s(&m);
  // More requests than max_seqs (4): some wait in the scheduler's queue.
  constexpr int kRequests = 7, kTokens = 6;
  std::vector<std::shared_ptr<decode::TokenStream>> streams;
  for (int i = 0; i < kRequests; ++i) {
    v1::DecodeRequest r;
    r.set_request_id("colo-" + std::to_string(i));
    for (int32_t t : TestPrompt(30 + 3 * i, 50 + i)) r.add_prompt_token_ids(t);
    *r.mutable_sampling() = services::SamplingToProto(Greedy(kTokens));
    r.set_prefill_locally(true);
    auto st = decode->StartDecode(r);
    ASSERT_TRUE(st.ok()) << st.status();
    streams.push_back(*st);
  }
  for (auto& st : streams) {
    const Drained d = Drain(*st);
    ASSERT_TRUE(d.status.ok()) << d.status;
    ASSERT_EQ(d.tokens, kTokens);
  }
  EXPECT_EQ(s.WaitFor(Series("num_requests_running", "both"), 0), 0);
  const std::string t = s.Get();
  ExpectContractLabels(t, "both");
  EXPECT_EQ(SampleValue(t, Series("time_to_first_token_seconds_count", "both")), kRequests) << t;
  EXPECT_GT(*SampleValue(t, Series("time_to_first_token_seconds_sum", "both")), 0);
  EXPECT_EQ(SampleValue(t, Series("request_queue_time_seconds_count", "both")), kRequests);
  EXPECT_EQ(SampleValue(t, Series("inter_token_latency_seconds_count", "both")),
            kRequests * (kTokens - 1));
  EXPECT_EQ(SampleValue(t, Series("e2e_request_latency_seconds_count", "both")), kRequests);
  EXPECT_EQ(SampleValue(t, Success("length", "both")), kRequests);
  // No KV arrived from elsewhere.
  EXPECT_EQ(SampleValue(t, Series("kv_transfer_bytes_count", "both")), 0);
  EXPECT_GT(*SampleValue(t, Series("request_queue_time_seconds_sum", "both")), 0);
}

// A speculating worker's draft and acceptance series follow its scheduler's counts, labelled
// with the proposer; a request that opts out adds nothing.
TEST_F(MetricsServicesTest, SpeculativeSeriesCountDraftsAndAcceptances) {
  Metrics m;
  decode::DecodeWorkerOptions o;
  o.model = model_;
  o.engine = TestEngineOptions(64, kernels::DType::kF32);
  o.worker_id = "decode-0";
  o.metrics = &m.Serving("tiny", "both");
  o.speculative.method = engine::SpecMethod::kNgram;
  o.spec_metrics = &m.Speculative("tiny", "both", "ngram");
  auto w = decode::DecodeWorker::Create(o);
  ASSERT_TRUE(w.ok()) << w.status();
  Scraper s(&m);
  const std::string labels = "{model_name=\"tiny\",proposer=\"ngram\",role=\"both\"}";
  auto run = [&](bool speculative) {
    for (int i = 0; i < 3; ++i) {
      v1::DecodeRequest r;
      r.set_request_id(absl::StrCat("spec-", speculative, "-", i));
      const auto phrase = TestPrompt(6 + i, 70 + i);
      for (int k = 0; k < 4; ++k) {
        for (int32_t t : phrase) r.add_prompt_token_ids(t);
      }
      engine::SamplingParams sp = Greedy(24);
      sp.speculative = speculative;
      *r.mutable_sampling() = services::SamplingToProto(sp);
      r.set_prefill_locally(true);
      auto st = (*w)->StartDecode(r);
      ASSERT_TRUE(st.ok()) << st.status();
      const Drained d = Drain(**st);
      ASSERT_TRUE(d.status.ok()) << d.status;
      ASSERT_EQ(d.tokens, 24);
    }
    EXPECT_EQ(s.WaitFor(Series("num_requests_running", "both"), 0), 0);
  };
  run(/*speculative=*/false);
  std::string t = s.Get();
  EXPECT_EQ(SampleValue(t, "tandem_spec_draft_tokens_total" + labels), 0) << t;
  EXPECT_EQ(SampleValue(t, "tandem_spec_acceptance_length_count" + labels), 0) << t;
  run(/*speculative=*/true);
  // Counters move one engine turn after the last event.
  std::optional<double> drafts;
  for (int i = 0; i < 200 && !(drafts > 0.0); ++i) {
    t = s.Get();
    drafts = SampleValue(t, "tandem_spec_draft_tokens_total" + labels);
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(drafts.has_value()) << t;
  EXPECT_GT(*drafts, 0) << t;
  const std::optional<double> accepted =
      SampleValue(t, "tandem_spec_accepted_tokens_total" + labels);
  ASSERT_TRUE(accepted.has_value());
  EXPECT_LE(*accepted, *drafts);
  // One observation per verify step, of the drafts it kept: the sum is the accepted count.
  EXPECT_GT(*SampleValue(t, "tandem_spec_acceptance_length_count" + labels), 0) << t;
  EXPECT_EQ(SampleValue(t, "tandem_spec_acceptance_length_sum" + labels), *accepted) << t;
  ExpectContractLabels(t, "both");
}

TEST_F(MetricsServicesTest, CancelledAndCorruptRequestsAreCounted) {
  Metrics dm, pm;
  auto dt = transfer::CreateInProcessTransport("decode");
  auto pt = transfer::CreateInProcessTransport("prefill");
  // Slow steps, so a cancel lands mid-generation.
  auto decode = MakeDecode(&dm, "decode", dt.get(), [] { absl::SleepFor(absl::Milliseconds(2)); });
  auto prefill = MakePrefill(&pm, pt.get());
  ASSERT_NE(decode, nullptr);
  ASSERT_NE(prefill, nullptr);
  Scraper ds(&dm);

  // A damaged checksum: refused before decoding, counted once.
  auto [bad, unused] = ReserveAndPrefill(*decode, *prefill, "bad", TestPrompt(33, 3), Greedy(4));
  ASSERT_GT(bad.block_checksums_size(), 0);
  bad.set_block_checksums(0, bad.block_checksums(0) ^ 1);
  EXPECT_EQ(decode->StartDecode(bad).status().code(), absl::StatusCode::kDataLoss);

  // A cancelled colocated request.
  v1::DecodeRequest r;
  r.set_request_id("cancel-me");
  for (int32_t t : TestPrompt(10, 9)) r.add_prompt_token_ids(t);
  *r.mutable_sampling() = services::SamplingToProto(Greedy(200));
  r.set_prefill_locally(true);
  auto stream = decode->StartDecode(r);
  ASSERT_TRUE(stream.ok()) << stream.status();
  engine::TokenEvent first;
  ASSERT_TRUE((*stream)->Next(absl::Now() + absl::Seconds(30), &first));
  ASSERT_FALSE(first.finished);
  EXPECT_TRUE(decode->Cancel("cancel-me"));
  const Drained d = Drain(**stream);
  EXPECT_EQ(d.status.code(), absl::StatusCode::kCancelled) << d.status;

  const std::string t = ds.Get();
  EXPECT_EQ(SampleValue(t, Series("kv_integrity_failures_total", "decode")), 1) << t;
  EXPECT_EQ(SampleValue(t, Success("cancelled", "decode")), 1);
  EXPECT_EQ(SampleValue(t, Success("length", "decode")), 0);
  EXPECT_EQ(SampleValue(t, Series("e2e_request_latency_seconds_count", "decode")), 1);
  // The refused request never reached the scheduler.
  EXPECT_EQ(SampleValue(t, Series("request_queue_time_seconds_count", "decode")), 1);
  EXPECT_EQ(SampleValue(t, Series("kv_transfer_bytes_count", "decode")), 0);
}

// A KV reference-count bug (here a block released twice, done on the engine thread as a bug
// would do it) is refused by the pool, counted in kv_invariant_violations_total and logged, and
// the worker goes on serving correctly.
TEST_F(MetricsServicesTest, KvInvariantViolationsAreCountedAndServingGoesOn) {
  Metrics dm;
  auto dt = transfer::CreateInProcessTransport("decode");
  auto decode = MakeDecode(&dm, "decode", dt.get(), nullptr);
  ASSERT_NE(decode, nullptr);
  Scraper ds(&dm);
  EXPECT_EQ(SampleValue(ds.Get(), Series("kv_invariant_violations_total", "decode")), 0);
  absl::Status refused;
  ASSERT_TRUE(decode
                  ->RunOnEngineThread([&](engine::Engine& e) {
                    engine::BlockPool& pool = e.kv().pool();
                    const int32_t b = *pool.Allocate();
                    EXPECT_TRUE(pool.Unref(b).ok());
                    refused = pool.Unref(b);  // the bug
                  })
                  .ok());
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  v1::DecodeRequest r;
  r.set_request_id("after");
  for (int32_t t : TestPrompt(10, 9)) r.add_prompt_token_ids(t);
  *r.mutable_sampling() = services::SamplingToProto(Greedy(8));
  r.set_prefill_locally(true);
  auto stream = decode->StartDecode(r);
  ASSERT_TRUE(stream.ok()) << stream.status();
  const Drained d = Drain(**stream);
  EXPECT_TRUE(d.status.ok()) << d.status;
  const std::string t = ds.Get();
  EXPECT_EQ(SampleValue(t, Series("kv_invariant_violations_total", "decode")), 1) << t;
  const v1::WorkerStats st = decode->Stats();
  EXPECT_EQ(st.kv_blocks_free(), st.kv_blocks_total()) << "no block lost or doubled";
}

TEST_F(MetricsServicesTest, KvStoreSeriesFollowTheStore) {
  kvstore::TieredStoreConfig c;
  c.device_slot_bytes = 4096;
  c.device = {8 * 4096, 1.0, 1.0};
  c.host = {1 << 20, 1.0, 1.0};
  c.ssd = {0};  // disabled: no series
  auto store = kvstore::TieredStore::Create(c);
  ASSERT_TRUE(store.ok()) << store.status();
  Metrics m;
  kvstore::ExportKvStoreMetrics(store->get(), "tiny", "kvstore", &m);
  Scraper s(&m);
  const std::string device =
      "tandem_kvstore_tier_bytes{model_name=\"tiny\",role=\"kvstore\","
      "tier=\"" +
      kvstore::DeviceTierLabel() + "\"}";
  std::string t = s.Get();
  ExpectContractLabels(t, "kvstore");
  EXPECT_NE(t.find("# TYPE tandem_kvstore_tier_bytes gauge"), std::string::npos) << t;
  EXPECT_EQ(SampleValue(t, device), 0);
  EXPECT_EQ(t.find("tier=\"ssd\""), std::string::npos);
  EXPECT_EQ(SampleValue(t, Series("kv_integrity_failures_total", "kvstore")), 0);

  std::vector<uint8_t> block(1000);
  for (size_t i = 0; i < block.size(); ++i) block[i] = static_cast<uint8_t>(i * 131 + 7);
  for (uint64_t h = 1; h <= 3; ++h) ASSERT_TRUE((*store)->Put(h, block).ok());
  ASSERT_TRUE((*store)->Get(2).ok());
  t = s.Get();  // the scrape hook refreshed the series from the store
  const uint64_t used = (*store)->stats().tiers[0].used_bytes;  // whole device slots
  EXPECT_GE(used, 3000u);
  EXPECT_EQ(SampleValue(t, device), double(used)) << t;
  EXPECT_EQ(SampleValue(t,
                        "tandem_kvstore_tier_hits_total{model_name=\"tiny\","
                        "role=\"kvstore\",tier=\"" +
                            kvstore::DeviceTierLabel() + "\"}"),
            1);
  EXPECT_EQ(SampleValue(t,
                        "tandem_kvstore_tier_blocks{model_name=\"tiny\","
                        "role=\"kvstore\",tier=\"" +
                            kvstore::DeviceTierLabel() + "\"}"),
            3);

  // Integrity failures are summed over tiers and only ever go up.
  kvstore::TieredStoreStats st;
  st.tiers[0].name = "device";
  st.tiers[2].name = "ssd";
  st.tiers[2].integrity_failures = 2;
  Metrics lone;
  kvstore::UpdateKvStoreMetrics(st, "tiny", "kvstore", &lone);
  EXPECT_EQ(SampleValue(lone.Render(), Series("kv_integrity_failures_total", "kvstore")), 2);
  st.tiers[0].integrity_failures = 1;
  kvstore::UpdateKvStoreMetrics(st, "tiny", "kvstore", &lone);
  EXPECT_EQ(SampleValue(lone.Render(), Series("kv_integrity_failures_total", "kvstore")), 3);
}

// Every service's exposition, after real traffic, through `promtool check metrics`: clean, no
// finding at all (the tandem_ prefix keeps clear of the colons promtool reserves for rules).
TEST_F(MetricsServicesTest, PromtoolAcceptsEveryServiceExposition) {
  if (!PromtoolCheckMetrics("").available) {
    GTEST_SKIP() << "promtool is not installed (Debian package `prometheus`, installed by "
                    "scripts/setup.sh); skipping the exposition lint";
  }
  Metrics dm, pm, km;
  auto dt = transfer::CreateInProcessTransport("decode");
  auto pt = transfer::CreateInProcessTransport("prefill");
  auto decode = MakeDecode(&dm, "decode", dt.get());
  auto prefill = MakePrefill(&pm, pt.get());
  ASSERT_NE(decode, nullptr);
  ASSERT_NE(prefill, nullptr);
  auto [dr, presp] = ReserveAndPrefill(*decode, *prefill, "lint", TestPrompt(20, 1), Greedy(5));
  auto stream = decode->StartDecode(dr);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE(Drain(**stream).status.ok());

  kvstore::TieredStoreConfig c;
  c.device_slot_bytes = 4096;
  c.device = {8 * 4096, 1.0, 1.0};
  c.host = {1 << 20, 1.0, 1.0};
  c.ssd = {0};
  auto store = kvstore::TieredStore::Create(c);
  ASSERT_TRUE(store.ok()) << store.status();
  kvstore::ExportKvStoreMetrics(store->get(), "tiny", "kvstore", &km);

  for (auto [name, m] : {std::pair{"decode", &dm}, {"prefill", &pm}, {"kvstore", &km}}) {
    Scraper s(m);
    const std::string text = s.Get();
    ASSERT_FALSE(text.empty()) << name;
    const PromtoolResult r = PromtoolCheckMetrics(text);
    // 0: clean; 3: lint findings; 1: parse errors.
    EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
  }
  decode.reset();
  prefill.reset();
}

}  // namespace
}  // namespace tandem::testing
