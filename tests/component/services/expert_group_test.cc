// The leader's side of an expert-parallel group (services/common/expert_group.h) on a real gRPC
// server: which joins it refuses, membership following the Join stream, and the deadline on an
// answer. The ranks here are gRPC clients of this test with an inbox on the in-process transport;
// real expert-rank processes are tested in tests/fault/worker_kill_test.cc (ExpertGroupTest).
#include "services/common/expert_group.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/time/clock.h"
#include "common/transfer/inproc/inproc_transport.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "services/common/grpc_server.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::services {
namespace {

class ExpertGroupServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::TinyModelOptions o;
    o.arch = "qwen3moe";
    o.n_expert = 8;
    o.n_expert_used = 2;
    path_ = (std::filesystem::temp_directory_path() /
             ("tandem-epgroup-" + std::to_string(getpid()) + ".gguf"))
                .string();
    ASSERT_TRUE(testing::WriteTinyModel(o, path_).ok());
    auto m = engine::Model::Load(path_);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
    leader_transport_ = transfer::CreateInProcessTransport("leader");
    rank_transport_ = transfer::CreateInProcessTransport("rank");
    auto p = engine::ExpertPlacement::Contiguous(model_->config().n_layer, 8, 2);
    ASSERT_TRUE(p.ok());
    placement_ = *p;
    ExpertGroupOptions go;
    go.transport = leader_transport_.get();
    go.placement = placement_;
    go.model = model_.get();
    go.model_name = "tiny.gguf";
    go.capacity_rows = 16;
    go.timeout = absl::Milliseconds(300);
    go.worker_id = "leader";
    auto g = ExpertGroup::Create(go);
    ASSERT_TRUE(g.ok()) << g.status();
    group_ = std::move(*g);
    GrpcServerOptions so;
    so.services = {group_.get()};
    auto s = GrpcServer::Start(so);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    stub_ = v1::ExpertGroup::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
    inbox_.assign(1 << 20, 0);
    auto d = rank_transport_->RegisterRegion(inbox_.data(), inbox_.size());
    ASSERT_TRUE(d.ok()) << d.status();
    inbox_desc_ = *d;
  }
  void TearDown() override {
    group_->Shutdown();
    if (server_) server_->Shutdown(absl::Seconds(2));
    std::filesystem::remove(path_);
  }

  v1::JoinExpertGroupRequest GoodJoin() const {
    const engine::ModelConfig& c = model_->config();
    v1::JoinExpertGroupRequest r;
    r.set_rank(1);
    r.set_ranks(2);
    r.set_worker_id("rank-1");
    r.set_model("tiny.gguf");
    r.set_n_layer(c.n_layer);
    r.set_n_expert(c.n_expert);
    r.set_n_embd(c.n_embd);
    r.set_placement(placement_.ToJson().dump());
    r.set_capacity_rows(16);
    r.set_inbox(inbox_desc_.Serialize());
    return r;
  }

  // A Join held open on a thread of its own; Finish() ends it and says how.
  struct Member {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::ExpertGroupEvent>> reader;
    v1::ExpertGroupEvent event;
    bool joined = false;
  };
  std::unique_ptr<Member> Join(const v1::JoinExpertGroupRequest& r) {
    auto m = std::make_unique<Member>();
    m->ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    m->reader = stub_->Join(&m->ctx, r);
    m->joined = m->reader->Read(&m->event);
    return m;
  }
  grpc::StatusCode Refused(const v1::JoinExpertGroupRequest& r) {
    auto m = Join(r);
    EXPECT_FALSE(m->joined);
    return m->reader->Finish().error_code();
  }

  std::string path_;
  std::unique_ptr<engine::Model> model_;
  std::unique_ptr<transfer::KvTransport> leader_transport_, rank_transport_;
  engine::ExpertPlacement placement_;
  std::unique_ptr<ExpertGroup> group_;
  std::unique_ptr<GrpcServer> server_;
  std::unique_ptr<v1::ExpertGroup::Stub> stub_;
  std::vector<uint8_t> inbox_;
  transfer::RegionDescriptor inbox_desc_;
};

template <typename Pred>
bool WaitFor(absl::Duration timeout, Pred pred) {
  for (const absl::Time end = absl::Now() + timeout; !pred(); absl::SleepFor(absl::Milliseconds(5))) {
    if (absl::Now() >= end) return false;
  }
  return true;
}

TEST_F(ExpertGroupServiceTest, RefusesRanksThatDoNotFitTheGroup) {
  v1::JoinExpertGroupRequest r = GoodJoin();
  r.set_rank(0);
  EXPECT_EQ(Refused(r), grpc::StatusCode::INVALID_ARGUMENT);
  r.set_rank(2);
  EXPECT_EQ(Refused(r), grpc::StatusCode::INVALID_ARGUMENT);
  r = GoodJoin();
  r.set_model("other.gguf");
  EXPECT_EQ(Refused(r), grpc::StatusCode::FAILED_PRECONDITION);
  r = GoodJoin();
  r.set_ranks(4);
  EXPECT_EQ(Refused(r), grpc::StatusCode::FAILED_PRECONDITION);
  r = GoodJoin();
  engine::ExpertPlacement other = placement_;
  std::swap(other.layers[0][0], other.layers[0][1]);
  r.set_placement(other.ToJson().dump());
  EXPECT_EQ(Refused(r), grpc::StatusCode::FAILED_PRECONDITION);
  r = GoodJoin();
  r.set_capacity_rows(15);
  EXPECT_EQ(Refused(r), grpc::StatusCode::FAILED_PRECONDITION);
  r = GoodJoin();
  r.set_inbox("not a descriptor");
  EXPECT_EQ(Refused(r), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(group_->complete());
}

// The group is complete exactly while the rank's Join stream is open; a second join of the same
// rank is refused; once the rank is gone, work for it fails at once.
TEST_F(ExpertGroupServiceTest, MembershipFollowsTheJoinStream) {
  EXPECT_FALSE(group_->complete());
  engine::ExpertWork work;
  work.Clear(0, /*one_token=*/true);
  work.expert = {5};
  work.rows = {1};
  std::vector<float> row(model_->config().n_embd, 0.5f);
  EXPECT_EQ(group_->Send(1, work, row.data()).code(), absl::StatusCode::kUnavailable);

  auto member = Join(GoodJoin());
  ASSERT_TRUE(member->joined);
  EXPECT_GT(member->event.session(), 0u);
  EXPECT_TRUE(group_->complete());
  EXPECT_EQ(Refused(GoodJoin()), grpc::StatusCode::ALREADY_EXISTS);

  // Work lands in the inbox: header after the doorbell, then the doorbell itself.
  ASSERT_TRUE(group_->Send(1, work, row.data()).ok());
  uint64_t bell = 0, seq = 0;
  std::memcpy(&bell, inbox_.data(), sizeof(bell));
  std::memcpy(&seq, inbox_.data() + 64, sizeof(seq));
  EXPECT_EQ(bell, seq);
  EXPECT_EQ(bell >> 32, member->event.session());

  member->ctx.TryCancel();
  (void)member->reader->Finish();
  EXPECT_TRUE(WaitFor(absl::Seconds(2), [&] { return !group_->complete(); }));
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(group_->Send(1, work, row.data()).code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(100));

  // The rank may join again: a new session.
  auto again = Join(GoodJoin());
  ASSERT_TRUE(again->joined);
  EXPECT_GT(again->event.session(), member->event.session());
  EXPECT_TRUE(group_->complete());
}

// A rank that takes work and never answers: Receive gives up at the group's deadline, not
// before, and the rank is dropped (its stream ends DEADLINE_EXCEEDED).
TEST_F(ExpertGroupServiceTest, AnUnansweredExchangeEndsAtTheDeadlineAndDropsTheRank) {
  auto member = Join(GoodJoin());
  ASSERT_TRUE(member->joined);
  engine::ExpertWork work;
  work.Clear(1, /*one_token=*/false);
  work.expert = {4, 6};
  work.rows = {2, 1};
  std::vector<float> rows(3 * model_->config().n_embd, 0.25f);
  ASSERT_TRUE(group_->Send(1, work, rows.data()).ok());
  const absl::Time t0 = absl::Now();
  absl::StatusOr<const float*> got = group_->Receive(1, 3);
  const absl::Duration waited = absl::Now() - t0;
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  EXPECT_GE(waited, absl::Milliseconds(290));
  EXPECT_LT(waited, absl::Seconds(2));
  EXPECT_FALSE(group_->complete());
  EXPECT_EQ(member->reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
}

}  // namespace
}  // namespace tandem::services
