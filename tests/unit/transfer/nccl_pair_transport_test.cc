// The nccl pair transport's join protocol on the CPU: fake ranks (host memory, an in-process
// rendezvous instead of ncclCommInitRank) and a join callback that calls the receiver
// directly instead of the gRPC RPC. The real ranks are covered by nccl_transport_test (gpu).
#include "common/transfer/nccl/nccl_pair_transport.h"

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/fakes/fake_nccl_rank.h"

namespace tandem::transfer {
namespace {

using Clock = std::chrono::steady_clock;
using testing::FakeRank;
using testing::World;
class NcclPairTransportTest : public ::testing::Test {
 protected:
  std::unique_ptr<NcclPairTransport> Make(std::string control, NcclJoinFn join) {
    NcclPairTransportOptions o;
    o.control_address = std::move(control);
    o.join = std::move(join);
    o.create_rank = [this]() -> absl::StatusOr<std::unique_ptr<NcclTransport>> {
      auto r = std::make_unique<FakeRank>(&world_);
      std::lock_guard<std::mutex> l(ranks_mu_);
      last_rank_ = r.get();
      return std::unique_ptr<NcclTransport>(std::move(r));
    };
    o.create_unique_id = [this]() -> absl::StatusOr<std::string> {
      return absl::StrCat("uid-", world_.next_id++);
    };
    auto t = NcclPairTransport::Create(std::move(o));
    EXPECT_TRUE(t.ok()) << t.status();
    return std::move(*t);
  }
  // A sender whose join reaches `receiver` in process, counting calls.
  std::unique_ptr<NcclPairTransport> Sender(NcclPairTransport* receiver) {
    return Make("", [this, receiver](const std::string& address, const NcclJoinRequest& req,
                                     Clock::time_point deadline) {
      joins_++;
      EXPECT_EQ(address, "decode-0:7000");
      return receiver->HandleJoin(req, deadline);
    });
  }
  static absl::Status Write(KvTransport& t, const RegionDescriptor& d, const std::string& bytes,
                            uint64_t offset) {
    return t.Write(d, {{bytes.data(), bytes.size(), offset}}, std::chrono::seconds(5));
  }

  World world_;
  std::atomic<int> joins_{0};
  std::mutex ranks_mu_;
  FakeRank* last_rank_ = nullptr;
};

TEST_F(NcclPairTransportTest, FirstWriteJoinsOnceThenBytesLand) {
  auto decode = Make("decode-0:7000", nullptr);
  auto prefill = Sender(decode.get());
  std::vector<char> pool(64, '.');
  auto d = decode->RegisterRegion(pool.data(), pool.size());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->peer_address, "ncclpair:" + decode->instance() + "@decode-0:7000");
  EXPECT_EQ(decode->capabilities().name, "nccl");
  EXPECT_TRUE(decode->capabilities().device_memory && decode->capabilities().cross_host);

  ASSERT_TRUE(Write(*prefill, *d, "hello", 3).ok());
  ASSERT_TRUE(Write(*prefill, *d, "world", 20).ok());
  EXPECT_EQ(std::string(pool.data() + 3, 5), "hello");
  EXPECT_EQ(std::string(pool.data() + 20, 5), "world");
  EXPECT_EQ(joins_.load(), 1) << "the pair is cached after the first write";
  EXPECT_EQ(prefill->pair_counts(), (std::pair<size_t, size_t>{1, 0}));
  EXPECT_EQ(decode->pair_counts(), (std::pair<size_t, size_t>{0, 1}));
  EXPECT_EQ(prefill->stats().bytes_written, 10u);
  EXPECT_EQ(prefill->stats().bytes_written_by_lanes.at("nccl"), 10u);
}

TEST_F(NcclPairTransportTest, RestartedReceiverRefusesOldDescriptors) {
  auto decode = Make("decode-0:7000", nullptr);
  auto prefill = Sender(decode.get());
  std::vector<char> pool(16, '.');
  auto d = decode->RegisterRegion(pool.data(), pool.size());
  ASSERT_TRUE(d.ok());
  RegionDescriptor stale = *d;
  stale.peer_address = "ncclpair:0123456789abcdef@decode-0:7000";
  absl::Status s = Write(*prefill, stale, "x", 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(prefill->pair_counts().first, 0u) << "a failed join leaves no pair";
}

TEST_F(NcclPairTransportTest, FailedJoinReachesTheWriteAndTheNextWriteJoinsAgain) {
  auto decode = Make("decode-0:7000", nullptr);
  std::atomic<bool> down{true};
  auto prefill = Make("", [&](const std::string&, const NcclJoinRequest& req,
                              Clock::time_point deadline) -> absl::StatusOr<NcclJoinReply> {
    joins_++;
    if (down) return absl::UnavailableError("decode unreachable");
    return decode->HandleJoin(req, deadline);
  });
  std::vector<char> pool(16, '.');
  auto d = decode->RegisterRegion(pool.data(), pool.size());
  ASSERT_TRUE(d.ok());
  absl::Status s = Write(*prefill, *d, "abc", 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("decode-0:7000"), std::string::npos) << s;
  down = false;
  ASSERT_TRUE(Write(*prefill, *d, "abc", 0).ok());
  EXPECT_EQ(std::string(pool.data(), 3), "abc");
  EXPECT_EQ(joins_.load(), 2);
}

TEST_F(NcclPairTransportTest, ReceiverThatNeverJoinsCostsTheWriteItsDeadlineOnly) {
  // The join answers, but no rank 0 ever Inits: rank 1's Init must give up at the deadline.
  auto prefill = Make("", [](const std::string&, const NcclJoinRequest&,
                             Clock::time_point) -> absl::StatusOr<NcclJoinReply> {
    return NcclJoinReply{.unique_id = "orphan", .regions = {{1, 100}}};
  });
  RegionDescriptor d{.peer_address = "ncclpair:abcd@decode-0:7000", .region_id = 1, .length = 8};
  const std::string bytes = "x";
  const auto start = Clock::now();
  absl::Status s = prefill->Write(d, {{bytes.data(), 1, 0}}, std::chrono::milliseconds(200));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(3));
  EXPECT_EQ(prefill->pair_counts().first, 0u);
}

TEST_F(NcclPairTransportTest, SenderThatNeverJoinsIsFreedOnTheReceiverAfterTheDeadline) {
  auto decode = Make("decode-0:7000", nullptr);
  auto r = decode->HandleJoin({decode->instance(), "gone-prefill"},
                              Clock::now() + std::chrono::milliseconds(100));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(decode->pair_counts().second, 1u);
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (decode->pair_counts().second != 0 && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(decode->pair_counts().second, 0u);
  while (world_.live_ranks.load() != 0 && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(world_.live_ranks.load(), 0) << "the orphaned rank must be destroyed";
}

TEST_F(NcclPairTransportTest, BrokenCommunicatorIsDroppedAndRebuilt) {
  auto decode = Make("decode-0:7000", nullptr);
  auto prefill = Sender(decode.get());
  std::vector<char> pool(16, '.');
  auto d = decode->RegisterRegion(pool.data(), pool.size());
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(Write(*prefill, *d, "a", 0).ok());
  FakeRank* sender_rank;
  {
    std::lock_guard<std::mutex> l(ranks_mu_);
    sender_rank = last_rank_;  // the sender's rank is made after the receiver's
  }
  sender_rank->Break();
  EXPECT_EQ(Write(*prefill, *d, "b", 1).code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(Write(*prefill, *d, "c", 2).ok());
  EXPECT_EQ(std::string(pool.data(), 3), "a.c");
  EXPECT_EQ(joins_.load(), 2);
  EXPECT_EQ(decode->pair_counts().second, 1u) << "the sender's new pair replaced its old one";
}

TEST_F(NcclPairTransportTest, RegionNewerThanThePairJoinsAgain) {
  auto decode = Make("decode-0:7000", nullptr);
  auto prefill = Sender(decode.get());
  std::vector<char> a(8, '.'), b(8, '.');
  auto da = decode->RegisterRegion(a.data(), a.size());
  ASSERT_TRUE(da.ok());
  ASSERT_TRUE(Write(*prefill, *da, "1", 0).ok());
  auto db = decode->RegisterRegion(b.data(), b.size());
  ASSERT_TRUE(db.ok());
  ASSERT_TRUE(Write(*prefill, *db, "2", 0).ok());
  EXPECT_EQ(b[0], '2');
  EXPECT_EQ(joins_.load(), 2);
  EXPECT_TRUE(decode->DeregisterRegion(da->region_id).ok());
  EXPECT_EQ(decode->DeregisterRegion(da->region_id).code(), absl::StatusCode::kNotFound);
}

TEST_F(NcclPairTransportTest, ForeignDescriptorsAndSenderOnlyRegistrationAreRefused) {
  auto prefill = Make("", [](const std::string&, const NcclJoinRequest&, Clock::time_point)
                              -> absl::StatusOr<NcclJoinReply> { return NcclJoinReply{}; });
  RegionDescriptor ucx{.peer_address = "\x01ucx-worker-address", .region_id = 1, .length = 8};
  const std::string bytes = "x";
  EXPECT_EQ(prefill->Write(ucx, {{bytes.data(), 1, 0}}, std::chrono::seconds(1)).code(),
            absl::StatusCode::kInvalidArgument);
  char buf[8];
  EXPECT_EQ(prefill->RegisterRegion(buf, 8).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto decode = Make("decode-0:7000", nullptr);
  RegionDescriptor d{.peer_address = "ncclpair:x@y:1", .region_id = 1, .length = 8};
  EXPECT_EQ(decode->Write(d, {{bytes.data(), 1, 0}}, std::chrono::seconds(1)).code(),
            absl::StatusCode::kFailedPrecondition)
      << "a transport without a join callback cannot send";
}

}  // namespace
}  // namespace tandem::transfer
