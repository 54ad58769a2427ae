#include "tests/component/services/cluster_fixture.h"

#include <unistd.h>

#include <filesystem>
#include <map>

#include "absl/synchronization/mutex.h"
#include "common/transfer/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "services/common/sampling_convert.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::testing {

std::shared_ptr<const engine::Model> LoadTestModel(const std::string& which) {
  static absl::Mutex mu;
  static auto* cache = new std::map<std::string, std::shared_ptr<const engine::Model>>();
  absl::MutexLock l(&mu);
  auto it = cache->find(which);
  if (it != cache->end()) return it->second;
  std::shared_ptr<const engine::Model> m;
  if (which == "tiny" || which.starts_with("tiny-")) {
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("tandem-svc-" + which + "-" + std::to_string(getpid()) + ".gguf"))
                                 .string();
    TinyModelOptions o;
    if (which != "tiny") o.arch = which.substr(5);  // tiny-qwen3moe, tiny-gpt-oss, ...
    EXPECT_TRUE(WriteTinyModel(o, path).ok());
    auto loaded = engine::Model::Load(path);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    std::filesystem::remove(path);  // mapped: the file may go
    if (loaded.ok()) m = std::move(*loaded);
  } else if (which == "stories260K") {
    const std::string path =
        std::string(TANDEM_SHARED_MODELS_DIR) + "/stories260K/stories260K.gguf";
    if (std::filesystem::exists(path)) {
      auto loaded = engine::Model::Load(path);
      EXPECT_TRUE(loaded.ok()) << loaded.status();
      if (loaded.ok()) m = std::move(*loaded);
    }
  }
  (*cache)[which] = m;
  return m;
}

engine::EngineOptions TestEngineOptions(int max_batch_tokens, kernels::DType kv_type) {
  engine::EngineOptions o;
  o.threads = 1;
  o.ctx_size = 256;
  o.max_seqs = 4;
  o.max_batch_tokens = max_batch_tokens;
  o.kv_type = kv_type;
  return o;
}

std::vector<int32_t> TestPrompt(int n, uint32_t seed) {
  std::vector<int32_t> t = {1};
  for (int i = 1; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    t.push_back(3 + (seed >> 8) % 250);
  }
  return t;
}

Generated ReferenceRun(std::shared_ptr<const engine::Model> model, kernels::DType kv_type,
                       const std::vector<int32_t>& prompt, const engine::SamplingParams& sp) {
  auto e = engine::Engine::Create(std::move(model), TestEngineOptions(64, kv_type));
  EXPECT_TRUE(e.ok()) << e.status();
  engine::Scheduler s(e->get());
  Generated g;
  engine::GenerationRequest r;
  r.id = "ref";
  r.prompt = prompt;
  r.sampling = sp;
  r.on_event = [&](const engine::TokenEvent& ev) {
    if (ev.token >= 0) g.tokens.push_back(ev.token);
    if (ev.logprobs) g.logprobs.push_back(*ev.logprobs);
    g.text += ev.text;
    if (ev.finished) {
      g.reason = ev.reason == engine::FinishReason::kStop ? v1::FINISH_REASON_STOP
                                                          : v1::FINISH_REASON_LENGTH;
    }
  };
  EXPECT_TRUE(s.Submit(std::move(r)).ok());
  EXPECT_TRUE(s.RunUntilIdle().ok());
  return g;
}

TestCluster::TestCluster(std::shared_ptr<const engine::Model> model, const ClusterOptions& o) {
  decode_transport = transfer::CreateInProcessTransport("decode");
  prefill_transport = transfer::CreateInProcessTransport("prefill");

  decode::DecodeWorkerOptions d;
  d.model = model;
  d.engine = TestEngineOptions(64, o.kv_type);
  d.engine.kv_blocks = o.decode_kv_blocks;
  d.worker_id = "decode-0";
  d.transport = decode_transport.get();
  d.before_step = o.before_step;
  d.quarantine = o.decode_quarantine;
  d.prefix_cache = o.decode_prefix_cache;
  d.speculative = o.decode_speculative;
  d.draft_kv_from_prefill = o.decode_draft_kv;
  auto dw = decode::DecodeWorker::Create(d);
  EXPECT_TRUE(dw.ok()) << dw.status();
  decode = std::move(*dw);

  prefill::PrefillWorkerOptions p;
  p.model = model;
  p.engine = TestEngineOptions(o.prefill_max_batch_tokens, o.kv_type);
  p.worker_id = "prefill-0";
  p.speculative = o.prefill_speculative;
  p.draft_kv = o.prefill_draft_kv;
  p.transport = prefill_transport.get();
  p.before_step = o.prefill_before_step;
  p.prefix_cache = o.prefill_prefix_cache;
  p.kvstore.address = o.kvstore_address;
  p.kvstore.read_timeout = o.kvstore_read_timeout;
  auto pw = prefill::PrefillWorker::Create(p);
  EXPECT_TRUE(pw.ok()) << pw.status();
  prefill = std::move(*pw);

  decode_service = std::make_unique<decode::DecodeService>(decode.get());
  prefill_service = std::make_unique<prefill::PrefillService>(prefill.get());
  services::GrpcServerOptions so;
  so.services = {decode_service.get()};
  decode_server = std::move(*services::GrpcServer::Start(so));
  so.services = {prefill_service.get()};
  prefill_server = std::move(*services::GrpcServer::Start(so));
  decode_channel =
      grpc::CreateChannel(decode_server->address(), grpc::InsecureChannelCredentials());
  prefill_channel =
      grpc::CreateChannel(prefill_server->address(), grpc::InsecureChannelCredentials());
  decode_stub = v1::DecodeWorker::NewStub(decode_channel);
  prefill_stub = v1::PrefillWorker::NewStub(prefill_channel);
}

TestCluster::~TestCluster() {
  // Servers first (no handler may touch a worker being destroyed), then workers, then the
  // transports they use.
  decode_server.reset();
  prefill_server.reset();
  prefill.reset();
  decode.reset();
}

absl::StatusOr<v1::ReserveResponse> TestCluster::Reserve(const std::string& id, int prompt_tokens,
                                                         int max_tokens, uint32_t lease_ms,
                                                         const std::vector<int32_t>* prompt,
                                                         uint64_t salt) {
  v1::ReserveRequest req;
  req.set_request_id(id);
  req.set_prompt_tokens(prompt_tokens);
  if (prompt != nullptr) req.mutable_prompt_token_ids()->Add(prompt->begin(), prompt->end());
  req.set_salt(salt);
  req.set_max_tokens(max_tokens);
  req.set_lease_ms(lease_ms);
  v1::ReserveResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status st = decode_stub->Reserve(&ctx, req, &resp);
  if (!st.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
  }
  return resp;
}

grpc::Status TestCluster::Prefill(const v1::PrefillRequest& req, v1::PrefillResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return prefill_stub->Prefill(&ctx, req, resp);
}

Generated TestCluster::Decode(const v1::DecodeRequest& req) {
  Generated g;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = decode_stub->Decode(&ctx, req);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (g.messages++ == 0 && msg.token_ids_size() > 0) g.first_message_token = msg.token_ids(0);
    for (int32_t t : msg.token_ids()) g.tokens.push_back(t);
    for (const v1::TokenLogprobs& l : msg.logprobs()) {
      g.logprobs.push_back(services::LogprobsFromProto(l));
    }
    g.text += msg.text();
    EXPECT_EQ(msg.request_id(), req.request_id());
    EXPECT_EQ(msg.decode_worker(), "decode-0");
    if (msg.finished()) {
      g.reason = msg.finish_reason();
      g.usage = msg.usage();
    }
  }
  g.status = reader->Finish();
  return g;
}

Generated TestCluster::Generate(const std::string& id, const std::vector<int32_t>& prompt,
                                const engine::SamplingParams& sp, uint64_t salt) {
  Generated g;
  absl::StatusOr<v1::ReserveResponse> r =
      Reserve(id, static_cast<int>(prompt.size()), sp.max_tokens, 10000, &prompt, salt);
  if (!r.ok()) {
    g.status = grpc::Status(static_cast<grpc::StatusCode>(r.status().code()),
                            std::string(r.status().message()));
    return g;
  }
  v1::PrefillRequest pr;
  pr.set_request_id(id);
  for (int32_t t : prompt) pr.add_prompt_token_ids(t);
  *pr.mutable_sampling() = services::SamplingToProto(sp);
  *pr.mutable_destination() = r->destination();
  pr.set_salt(salt);
  v1::PrefillResponse presp;
  grpc::Status st = Prefill(pr, &presp);
  if (!st.ok()) {
    g.status = st;
    return g;
  }
  v1::DecodeRequest dr;
  dr.set_request_id(id);
  *dr.mutable_prompt_token_ids() = pr.prompt_token_ids();
  *dr.mutable_sampling() = pr.sampling();
  dr.set_first_token_id(presp.first_token_id());
  dr.set_salt(salt);
  // As the router does: the first token's log-probabilities travel with it.
  if (presp.has_first_token_logprobs()) {
    *dr.mutable_first_token_logprobs() = presp.first_token_logprobs();
  }
  *dr.mutable_block_checksums() = presp.block_checksums();
  *dr.mutable_draft_block_checksums() = presp.draft_block_checksums();
  g = Decode(dr);
  g.prefill = presp;
  g.held_blocks = r->destination().held_blocks();
  return g;
}

bool TestCluster::CancelOnDecode(const std::string& id) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::CancelRequest req;
  req.set_request_id(id);
  v1::CancelResponse resp;
  const grpc::Status st = decode_stub->Cancel(&ctx, req, &resp);
  EXPECT_TRUE(st.ok()) << "Cancel " << id << ": " << st.error_message();
  return st.ok() && resp.found();
}

v1::WorkerStats TestCluster::DecodeStats() {
  grpc::ClientContext ctx;
  v1::WorkerStats s;
  EXPECT_TRUE(decode_stub->Stats(&ctx, v1::WorkerStatsRequest(), &s).ok());
  return s;
}

v1::WorkerStats TestCluster::PrefillStats() {
  grpc::ClientContext ctx;
  v1::WorkerStats s;
  EXPECT_TRUE(prefill_stub->Stats(&ctx, v1::WorkerStatsRequest(), &s).ok());
  return s;
}

bool TestCluster::WaitForDecode(const std::function<bool(const v1::WorkerStats&)>& pred,
                                absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  for (;;) {
    if (pred(DecodeStats())) return true;
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
}

}  // namespace tandem::testing
