// The nccl transport's control plane on the CPU: JoinKvGroup over a real in-process gRPC
// server (port 0) between two pair transports with fake ranks, and the factory's answers on a
// machine without a GPU. The real ranks: nccl_transport_test (label gpu).
#include "services/common/nccl_join.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "services/common/grpc_server.h"
#include "services/common/transport_factory.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "tests/fakes/fake_nccl_rank.h"

#if defined(TANDEM_HAVE_CUDA)
#include "tandem/cuda/cuda_common.h"
#endif

namespace tandem::services {
namespace {

using Clock = std::chrono::steady_clock;

bool HaveGpu() {
#if defined(TANDEM_HAVE_CUDA)
  return kernels::cuda::VisibleDeviceCount() > 0;
#else
  return false;
#endif
}

// Only JoinKvGroup, the way DecodeService answers it.
class JoinOnlyService final : public v1::DecodeWorker::Service {
 public:
  explicit JoinOnlyService(KvJoinHandler h) : h_(std::move(h)) {}
  grpc::Status JoinKvGroup(grpc::ServerContext* ctx, const v1::JoinKvGroupRequest* req,
                           v1::JoinKvGroupResponse* resp) override {
    return HandleJoinKvGroup(h_, ctx, *req, resp);
  }

 private:
  KvJoinHandler h_;
};

class NcclJoinTest : public ::testing::Test {
 protected:
  std::unique_ptr<transfer::NcclPairTransport> Make(std::string control,
                                                    transfer::NcclJoinFn join) {
    transfer::NcclPairTransportOptions o;
    o.control_address = std::move(control);
    o.join = std::move(join);
    o.create_rank = [this]() -> absl::StatusOr<std::unique_ptr<transfer::NcclTransport>> {
      return std::unique_ptr<transfer::NcclTransport>(
          std::make_unique<testing::FakeRank>(&world_));
    };
    o.create_unique_id = [this]() -> absl::StatusOr<std::string> {
      return absl::StrCat("uid-", world_.next_id++);
    };
    auto t = transfer::NcclPairTransport::Create(std::move(o));
    EXPECT_TRUE(t.ok()) << t.status();
    return std::move(*t);
  }
  testing::World world_;
};

TEST_F(NcclJoinTest, FirstWriteJoinsOverGrpcAndTheBytesLand) {
  // The decode's descriptors must name its gRPC address, known only once the server is bound:
  // start the server on a placeholder handler first.
  std::unique_ptr<transfer::NcclPairTransport> decode;
  JoinOnlyService svc([&decode](const transfer::NcclJoinRequest& r, Clock::time_point d) {
    return decode->HandleJoin(r, d);
  });
  GrpcServerOptions so;
  so.services = {&svc};
  auto server = GrpcServer::Start(so);
  ASSERT_TRUE(server.ok()) << server.status();
  decode = Make((*server)->address(), nullptr);
  auto prefill = Make("", GrpcNcclJoin());

  std::vector<char> pool(32, '.');
  auto d = decode->RegisterRegion(pool.data(), pool.size());
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string bytes = "kv-bytes";
  absl::Status s = prefill->Write(*d, {{bytes.data(), bytes.size(), 4}}, std::chrono::seconds(10));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(std::string(pool.data() + 4, bytes.size()), bytes);
  EXPECT_EQ(decode->pair_counts().second, 1u);

  // A descriptor of an earlier instance at the same address: FAILED_PRECONDITION end to end.
  transfer::RegionDescriptor stale = *d;
  stale.peer_address = "ncclpair:feedfacefeedface@" + (*server)->address();
  s = prefill->Write(stale, {{bytes.data(), 1, 0}}, std::chrono::seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  (*server)->Shutdown(absl::Seconds(1));
}

TEST_F(NcclJoinTest, WorkerWithoutNcclAnswersUnimplementedAndADeadDecodeIsUnavailable) {
  JoinOnlyService svc(nullptr);
  GrpcServerOptions so;
  so.services = {&svc};
  auto server = GrpcServer::Start(so);
  ASSERT_TRUE(server.ok()) << server.status();
  transfer::NcclJoinFn join = GrpcNcclJoin();
  auto r = join((*server)->address(), {"a", "b"}, Clock::now() + std::chrono::seconds(5));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented) << r.status();
  const std::string address = (*server)->address();
  server->reset();
  const auto start = Clock::now();
  r = join(address, {"a", "b"}, Clock::now() + std::chrono::milliseconds(500));
  EXPECT_TRUE(r.status().code() == absl::StatusCode::kUnavailable ||
              r.status().code() == absl::StatusCode::kDeadlineExceeded)
      << r.status();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(3)) << "the join keeps its deadline";
}

TEST(NcclTransportFactoryTest, WithoutAGpuOrNcclTheFactorySaysWhy) {
  if (HaveGpu()) GTEST_SKIP() << "a CUDA device is present";
  TransportChoice c;
  c.kind = "nccl";
  KvJoinHandler h = [](const transfer::NcclJoinRequest&, Clock::time_point)
      -> absl::StatusOr<transfer::NcclJoinReply> { return absl::InternalError("stale"); };
  auto t = CreateTransport(c, &h);
  const std::vector<std::string> have = AvailableTransports();
  if (std::find(have.begin(), have.end(), "nccl") != have.end()) {
    EXPECT_EQ(t.status().code(), absl::StatusCode::kUnavailable) << t.status();
    EXPECT_NE(t.status().message().find("no CUDA device"), std::string::npos) << t.status();
  } else {
    EXPECT_EQ(t.status().code(), absl::StatusCode::kUnimplemented) << t.status();
  }
  EXPECT_FALSE(h) << "no handler from a failed factory";
}

}  // namespace
}  // namespace tandem::services
