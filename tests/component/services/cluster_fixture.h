// A prefill worker and a decode worker, each behind a real gRPC server on a loopback port 0 and
// each with its own in-process KV transport, driven the way the router drives them:
// Reserve on decode, Prefill on prefill (KV lands in decode's pool), Decode on decode.
// Also the single-process reference: engine::Scheduler on one engine.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/transfer/transfer.h"
#include "engine/runtime/scheduler.h"
#include "grpcpp/grpcpp.h"
#include "services/common/grpc_server.h"
#include "services/decode/decode_service.h"
#include "services/prefill/prefill_service.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::testing {

// "tiny" (written by WriteTinyModel), "tiny-ARCH" (its ARCH variant: tiny-qwen3moe,
// tiny-gpt-oss, ...) or "stories260K" (null when ../shared/models is absent).
std::shared_ptr<const engine::Model> LoadTestModel(const std::string& which);

engine::EngineOptions TestEngineOptions(int max_batch_tokens, kernels::DType kv_type);

// Greedy decoding of exactly `max_tokens` tokens (EOS ignored), so runs compare token for token.
inline engine::SamplingParams Greedy(int max_tokens) {
  engine::SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = max_tokens;
  sp.ignore_eos = true;
  return sp;
}

// Deterministic prompt: BOS then pseudo-random ids in [3, 253).
std::vector<int32_t> TestPrompt(int n, uint32_t seed);

struct Generated {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  v1::FinishReason reason = v1::FINISH_REASON_UNSPECIFIED;
  int messages = 0;
  int32_t first_message_token = -1;
  v1::Usage usage;
  v1::PrefillResponse prefill;
  int32_t held_blocks = 0;  // Generate: the prompt blocks decode held (its Reserve's answer)
  std::vector<engine::TokenLogprobs> logprobs;  // with sampling.logprobs >= 0
};

// What engine::Scheduler produces for the request in one process.
Generated ReferenceRun(std::shared_ptr<const engine::Model> model, kernels::DType kv_type,
                       const std::vector<int32_t>& prompt, const engine::SamplingParams& sp);

struct ClusterOptions {
  kernels::DType kv_type = kernels::DType::kF32;
  int decode_kv_blocks = 0;  // 0: engine default
  // Short, so tests that end reservations undecoded see their pool at rest soon after.
  absl::Duration decode_quarantine = absl::Milliseconds(100);
  int prefill_max_batch_tokens = 24;  // small: forces chunked prefill
  std::function<void()> before_step;  // decode engine-loop hook
  std::function<void()> prefill_before_step;
  bool prefill_prefix_cache = true;
  // Decode's prefix cache (a later turn's Reserve holds what it has of the prompt).
  bool decode_prefix_cache = true;
  // tandem-kvstore for the prefill worker to onboard from and publish to (empty: none).
  std::string kvstore_address;
  absl::Duration kvstore_read_timeout = absl::Seconds(5);
  // Each worker's speculative configuration (the reserve handshake compares them).
  engine::SpeculativeOptions decode_speculative;
  engine::SpeculativeOptions prefill_speculative;
  // With a draft model, --draft-kv of each worker: decode asks prefill for the draft's prompt
  // K/V, and prefill loads the draft to compute them (true: "prefill"), or not ("decode").
  bool decode_draft_kv = true;
  bool prefill_draft_kv = true;
};

class TestCluster {
 public:
  TestCluster(std::shared_ptr<const engine::Model> model, const ClusterOptions& o = {});
  ~TestCluster();

  // With `prompt`, its tokens and `salt` go along, as the router sends them (decode then holds
  // what its prefix cache has of the prompt).
  absl::StatusOr<v1::ReserveResponse> Reserve(const std::string& id, int prompt_tokens,
                                              int max_tokens, uint32_t lease_ms = 10000,
                                              const std::vector<int32_t>* prompt = nullptr,
                                              uint64_t salt = 0);
  grpc::Status Prefill(const v1::PrefillRequest& req, v1::PrefillResponse* resp);
  // The decode worker's Cancel rpc: whether it knew `id` (a failed rpc is a test failure).
  bool CancelOnDecode(const std::string& id);
  // Reads a whole Decode stream.
  Generated Decode(const v1::DecodeRequest& req);
  // Reserve (with the prompt's tokens and the salt) -> Prefill -> Decode, as the router does.
  Generated Generate(const std::string& id, const std::vector<int32_t>& prompt,
                     const engine::SamplingParams& sp, uint64_t salt = 0);

  v1::WorkerStats DecodeStats();
  v1::WorkerStats PrefillStats();
  // Polls decode Stats until pred holds (explicit timeout).
  bool WaitForDecode(const std::function<bool(const v1::WorkerStats&)>& pred,
                     absl::Duration timeout = absl::Seconds(10));

  std::unique_ptr<transfer::KvTransport> decode_transport;
  std::unique_ptr<transfer::KvTransport> prefill_transport;
  std::unique_ptr<decode::DecodeWorker> decode;
  std::unique_ptr<prefill::PrefillWorker> prefill;
  std::unique_ptr<decode::DecodeService> decode_service;
  std::unique_ptr<prefill::PrefillService> prefill_service;
  std::unique_ptr<services::GrpcServer> decode_server;
  std::unique_ptr<services::GrpcServer> prefill_server;
  std::shared_ptr<grpc::Channel> decode_channel;
  std::shared_ptr<grpc::Channel> prefill_channel;
  std::unique_ptr<v1::DecodeWorker::Stub> decode_stub;
  std::unique_ptr<v1::PrefillWorker::Stub> prefill_stub;
};

}  // namespace tandem::testing
