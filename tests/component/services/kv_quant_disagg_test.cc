// Quantised KV (int8, fp8-e4m3) through the real prefill -> decode handoff: gRPC on loopback,
// KV over the in-process transport. The scales live inside each slot's bytes, so the handoff
// moves them with the codes: the decode side's copy must checksum to what prefill computed,
// the tokens must equal a one-process run with the same KV type (prefill/decode identity), a
// damaged scale must be caught like any damaged byte, and a worker with another KV type (same
// block size in bytes: int8 vs fp8) must be refused rather than decoded from.
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "services/common/kv_layout.h"
#include "services/common/sampling_convert.h"
#include "tandem/kernels/kv_quant.h"
#include "tests/component/services/cluster_fixture.h"

namespace tandem::testing {
namespace {

using kernels::DType;

struct Param {
  std::string model;
  DType kv_type;
};

class QuantHandoffTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    model_ = LoadTestModel(GetParam().model);
    if (model_ == nullptr) GTEST_SKIP() << GetParam().model << " is not available here";
  }

  // Reserve on decode and prefill into the reservation, stopping before Decode.
  struct Handoff {
    v1::ReserveResponse reservation;
    v1::PrefillRequest request;
    v1::PrefillResponse response;
    grpc::Status status;
  };
  Handoff Prefill(TestCluster& c, const std::string& id, const std::vector<int32_t>& prompt,
                  const engine::SamplingParams& sp,
                  const std::function<void(v1::KvDestination*)>& edit = nullptr) {
    Handoff h;
    absl::StatusOr<v1::ReserveResponse> r =
        c.Reserve(id, static_cast<int>(prompt.size()), sp.max_tokens);
    EXPECT_TRUE(r.ok()) << r.status();
    h.reservation = *r;
    h.request.set_request_id(id);
    for (int32_t t : prompt) h.request.add_prompt_token_ids(t);
    *h.request.mutable_sampling() = services::SamplingToProto(sp);
    *h.request.mutable_destination() = r->destination();
    if (edit) edit(h.request.mutable_destination());
    h.status = c.Prefill(h.request, &h.response);
    return h;
  }
  static v1::DecodeRequest DecodeFor(const Handoff& h) {
    v1::DecodeRequest dr;
    dr.set_request_id(h.request.request_id());
    *dr.mutable_prompt_token_ids() = h.request.prompt_token_ids();
    *dr.mutable_sampling() = h.request.sampling();
    dr.set_first_token_id(h.response.first_token_id());
    *dr.mutable_block_checksums() = h.response.block_checksums();
    return dr;
  }

  std::shared_ptr<const engine::Model> model_;
};

TEST_P(QuantHandoffTest, TokensAndBlocksMatchOneProcessRun) {
  ClusterOptions co;
  co.kv_type = GetParam().kv_type;
  TestCluster c(model_, co);
  const engine::ModelConfig& cfg = model_->config();
  const uint64_t slot_bytes = kernels::KvQuantSlotBytes(cfg.n_head_kv, cfg.head_dim);
  const uint64_t bytes_per_pos = 2ull * cfg.n_layer * slot_bytes;
  int n = 0;
  // Partial, exact and multi-block prompts; prefill runs in 24-token chunks, the reference in
  // 64-token ones, so the identity does not depend on how positions were batched.
  for (int len : {5, 16, 17, 47, 100}) {
    SCOPED_TRACE(::testing::Message() << "prompt " << len);
    const auto prompt = TestPrompt(len, 300 + len);
    const engine::SamplingParams sp = Greedy(24);
    Handoff h = Prefill(c, "q" + std::to_string(n++), prompt, sp);
    ASSERT_TRUE(h.status.ok()) << h.status.error_message();
    EXPECT_EQ(h.reservation.destination().kv_dtype(),
              std::string(kernels::KvTypeName(GetParam().kv_type)));
    EXPECT_EQ(h.reservation.destination().block_bytes(), 16 * slot_bytes);
    // Codes and scales of exactly the prompt positions travelled.
    EXPECT_EQ(h.response.bytes_transferred(), bytes_per_pos * len);
    ASSERT_EQ(h.response.block_checksums_size(), services::BlocksFor(len, 16));
    // The decode pool's copy (scales included) checksums to what prefill computed on its own.
    std::vector<uint64_t> landed;
    std::vector<int32_t> blocks(h.reservation.destination().block_ids().begin(),
                                h.reservation.destination().block_ids().end());
    ASSERT_TRUE(c.decode
                    ->RunOnEngineThread([&](engine::Engine& e) {
                      landed = services::SequenceChecksums(e.kv(), blocks, len);
                    })
                    .ok());
    EXPECT_EQ(landed, std::vector<uint64_t>(h.response.block_checksums().begin(),
                                            h.response.block_checksums().end()));
    const Generated got = c.Decode(DecodeFor(h));
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    const Generated ref = ReferenceRun(model_, GetParam().kv_type, prompt, sp);
    EXPECT_EQ(got.tokens, ref.tokens);
    EXPECT_EQ(got.first_message_token, h.response.first_token_id());
  }
  EXPECT_EQ(c.DecodeStats().kv_integrity_failures(), 0u);
}

TEST_P(QuantHandoffTest, DamagedScaleIsCaught) {
  ClusterOptions co;
  co.kv_type = GetParam().kv_type;
  TestCluster c(model_, co);
  const auto prompt = TestPrompt(40, 9);
  Handoff h = Prefill(c, "scale", prompt, Greedy(8));
  ASSERT_TRUE(h.status.ok()) << h.status.error_message();
  const int32_t victim = h.reservation.destination().block_ids(1);
  ASSERT_TRUE(c.decode
                  ->RunOnEngineThread([&](engine::Engine& e) {
                    engine::KvCache& kv = e.kv();
                    const auto& o = kv.options();
                    // A high byte of kv head 0's scale of slot 3: the codes are untouched.
                    const size_t at = victim * kv.block_bytes() + 3 * kv.slot_bytes() +
                                      kernels::KvQuantCodeBytes(o.num_kv_heads, o.head_dim) + 2;
                    kv.k_layer(0)[at] ^= 0x01;
                  })
                  .ok());
  const Generated g = c.Decode(DecodeFor(h));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::DATA_LOSS) << g.status.error_message();
  EXPECT_EQ(c.DecodeStats().kv_integrity_failures(), 1u);
}

TEST_P(QuantHandoffTest, OtherKvTypeIsRefused) {
  ClusterOptions co;
  co.kv_type = GetParam().kv_type;
  TestCluster c(model_, co);
  // The other 8-bit type has the same block_bytes, so only the dtype tells them apart.
  const DType other = GetParam().kv_type == DType::kI8 ? DType::kFp8E4M3 : DType::kI8;
  Handoff h = Prefill(c, "mixed", TestPrompt(20, 4), Greedy(4), [&](v1::KvDestination* d) {
    d->set_kv_dtype(std::string(kernels::KvTypeName(other)));
  });
  EXPECT_EQ(h.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(h.status.error_message().find("kv_dtype"), std::string::npos)
      << h.status.error_message();
  // And an f32 destination (different dtype and block size).
  Handoff f = Prefill(c, "mixed-f32", TestPrompt(20, 4), Greedy(4), [&](v1::KvDestination* d) {
    d->set_kv_dtype("f32");
    d->set_block_bytes(4ull * 16 * d->num_kv_heads() * d->head_dim());
  });
  EXPECT_EQ(f.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

INSTANTIATE_TEST_SUITE_P(Types, QuantHandoffTest,
                         ::testing::Values(Param{"tiny", DType::kI8}, Param{"tiny", DType::kFp8E4M3},
                                           Param{"stories260K", DType::kI8},
                                           Param{"stories260K", DType::kFp8E4M3}),
                         [](const auto& info) {
                           return info.param.model + "_" +
                                  std::string(kernels::KvTypeName(info.param.kv_type));
                         });

}  // namespace
}  // namespace tandem::testing
