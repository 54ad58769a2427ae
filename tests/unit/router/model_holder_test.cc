// The router's model without the weights: a worker's model card (services/common/model_card.h)
// served over real gRPC on port 0, learned by ModelHolder on the first registration; a
// registration whose card fetch fails is refused with UNAVAILABLE and retried on the next; a
// worker with another model's card is refused with FAILED_PRECONDITION naming both.
#include "services/router/model_holder.h"

#include <filesystem>

#include "gtest/gtest.h"
#include "services/common/grpc_server.h"
#include "services/common/model_card.h"
#include "tests/fakes/tiny_model.h"
#include "tests/unit/kvstore/test_util.h"

namespace tandem::router {
namespace {

using services::BuildModelCard;
using services::GrpcServer;
using services::ModelCardService;

std::string WriteModel(const std::string& dir, const std::string& name, int32_t n_ctx,
                       kernels::DType type = kernels::DType::kF32) {
  testing::TinyModelOptions o;
  o.n_ctx = n_ctx;
  o.type = type;
  const std::string path = dir + "/" + name;
  EXPECT_TRUE(testing::WriteTinyModel(o, path).ok());
  return path;
}

std::unique_ptr<GrpcServer> Serve(ModelCardService* s) {
  services::GrpcServerOptions o;
  o.services = {s};
  auto server = GrpcServer::Start(o);
  EXPECT_TRUE(server.ok()) << server.status();
  return std::move(*server);
}

v1::RegisterRequest Registration(const std::string& id, const std::string& address,
                                 const v1::ModelCard& card) {
  v1::RegisterRequest r;
  r.set_worker_id(id);
  r.set_address(address);
  r.set_model(card.model());
  r.set_model_card_hash(card.card_hash());
  return r;
}

TEST(ModelCardTest, HasTheMetadataAndNoTensorsAndIgnoresTheWeightType) {
  kvstore::testing::ScratchDir dir;
  const std::string f32 = WriteModel(dir.path(), "tiny.gguf", 256);
  const std::string q8 = WriteModel(dir.path(), "tiny-q8.gguf", 256, kernels::DType::kQ8_0);
  auto card = BuildModelCard(f32, 128);
  ASSERT_TRUE(card.ok()) << card.status();
  EXPECT_EQ(card->model(), "tiny.gguf");
  EXPECT_EQ(card->ctx_size(), 128);
  EXPECT_LT(card->gguf().size(), std::filesystem::file_size(f32) / 4);
  const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(card->gguf().data()),
                                       card->gguf().size());
  EXPECT_EQ(services::ModelCardHash(bytes), card->card_hash());
  auto file = gguf::GgufFile::FromBuffer(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->get()->tensors().empty());
  EXPECT_NE(file->get()->Find("tokenizer.ggml.tokens"), nullptr);
  // The same model quantised: the same card. Another context length: another card.
  EXPECT_EQ(BuildModelCard(q8, 0)->card_hash(), card->card_hash());
  const std::string other = WriteModel(dir.path(), "other.gguf", 512);
  EXPECT_NE(BuildModelCard(other, 0)->card_hash(), card->card_hash());
  EXPECT_FALSE(BuildModelCard(dir.path() + "/missing.gguf", 0).ok());
}

TEST(ModelHolderTest, LearnsTheModelFromTheFirstWorkersCard) {
  kvstore::testing::ScratchDir dir;
  const std::string path = WriteModel(dir.path(), "tiny.gguf", 256);
  auto from_file = RouterModel::Load(path, "", 0);
  ASSERT_TRUE(from_file.ok());
  ModelCardService card(*BuildModelCard(path, 0));
  auto server = Serve(&card);

  int learned = 0;
  ModelHolderOptions o;
  o.on_learned = [&](const RouterModel& m) {
    ++learned;
    EXPECT_EQ(m.id(), "tiny");
  };
  auto holder = std::move(*ModelHolder::Create(o));
  EXPECT_EQ(holder->model(), nullptr);
  EXPECT_EQ(holder->chat(), nullptr);

  ASSERT_TRUE(holder->Admit(Registration("decode-0", server->address(), card.card())).ok());
  ASSERT_NE(holder->model(), nullptr);
  EXPECT_EQ(learned, 1);
  EXPECT_TRUE(holder->learned_from_card());
  const RouterModel& m = *holder->model();
  EXPECT_EQ(m.id(), "tiny");
  EXPECT_TRUE(m.Matches("tiny.gguf"));
  EXPECT_EQ(m.ctx_size(), (*from_file)->ctx_size());
  EXPECT_EQ(m.vocab_size(), (*from_file)->vocab_size());
  EXPECT_EQ(m.config().n_layer, (*from_file)->config().n_layer);
  // The tokenizer is the file's, token for token.
  const std::string text = "hello world, a tiny test";
  EXPECT_EQ(m.tokenizer().Encode(text, true, true),
            (*from_file)->tokenizer().Encode(text, true, true));
  // A second worker of the same model joins without another fetch.
  EXPECT_TRUE(holder->Admit(Registration("prefill-0", "127.0.0.1:1", card.card())).ok());
  EXPECT_EQ(learned, 1);
}

TEST(ModelHolderTest, RefusesAWorkerWithAnotherModelsCard) {
  kvstore::testing::ScratchDir dir;
  ModelCardService a(*BuildModelCard(WriteModel(dir.path(), "tiny.gguf", 256), 0));
  const v1::ModelCard b = *BuildModelCard(WriteModel(dir.path(), "other.gguf", 512), 0);
  auto server = Serve(&a);
  auto holder = std::move(*ModelHolder::Create(ModelHolderOptions{}));
  ASSERT_TRUE(holder->Admit(Registration("decode-0", server->address(), a.card())).ok());
  const absl::Status st = holder->Admit(Registration("decode-1", "127.0.0.1:1", b));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("other.gguf"), std::string::npos) << st;
  EXPECT_NE(st.message().find("'tiny'"), std::string::npos) << st;
  EXPECT_EQ(holder->model()->id(), "tiny");
}

TEST(ModelHolderTest, AFailedFetchRefusesThatRegistrationAndTheNextOneRetries) {
  kvstore::testing::ScratchDir dir;
  ModelCardService card(*BuildModelCard(WriteModel(dir.path(), "tiny.gguf", 256), 0));
  int dead_port;
  {
    auto probe = Serve(&card);  // a port nobody listens on afterwards
    dead_port = probe->port();
  }
  ModelHolderOptions o;
  o.fetch_timeout = absl::Milliseconds(300);
  auto holder = std::move(*ModelHolder::Create(o));
  const absl::Time t0 = absl::Now();
  const absl::Status st = holder->Admit(
      Registration("decode-0", "127.0.0.1:" + std::to_string(dead_port), card.card()));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));  // bounded by the fetch deadline
  EXPECT_EQ(holder->model(), nullptr);
  auto server = Serve(&card);
  EXPECT_TRUE(holder->Admit(Registration("decode-0", server->address(), card.card())).ok());
  EXPECT_NE(holder->model(), nullptr);
}

TEST(ModelHolderTest, WithAModelFileItIsKnownAtOnceAndAdmitsEveryone) {
  kvstore::testing::ScratchDir dir;
  ModelHolderOptions o;
  o.model_path = WriteModel(dir.path(), "tiny.gguf", 256);
  o.need_chat = true;
  auto holder = ModelHolder::Create(o);
  ASSERT_TRUE(holder.ok()) << holder.status();
  ASSERT_NE((*holder)->model(), nullptr);
  ASSERT_NE((*holder)->chat(), nullptr);
  EXPECT_FALSE((*holder)->learned_from_card());
  v1::RegisterRequest r;
  r.set_worker_id("w");
  r.set_address("127.0.0.1:1");
  EXPECT_TRUE((*holder)->Admit(r).ok());  // the registry checks model names as before
  o.model_path = dir.path() + "/missing.gguf";
  EXPECT_FALSE(ModelHolder::Create(o).ok());
}

}  // namespace
}  // namespace tandem::router
