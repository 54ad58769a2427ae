// NcclTransport between two GPUs of this machine (two ranks in one process, one thread each
// for the blocking Init). Label `gpu`; skips cleanly without two CUDA devices.
#include <cuda_runtime_api.h>

#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "common/transfer/nccl/nccl_pair_transport.h"
#include "common/transfer/nccl/nccl_transport.h"
#include "gtest/gtest.h"

namespace tandem::transfer {
namespace {

int DeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

TEST(NcclTransportTest, NoDeviceIsUnavailableNotACrash) {
  if (DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
  auto t = NcclTransport::Create({});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnavailable) << t.status();
}

TEST(NcclTransportTest, WritesLandBetweenTwoGpusAndOutOfRangeIsRefused) {
  if (DeviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices";
  auto id = NcclTransport::CreateUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  auto a = NcclTransport::Create({.device = 0});
  auto b = NcclTransport::Create({.device = 1});
  ASSERT_TRUE(a.ok() && b.ok());
  absl::Status sa, sb;
  std::thread ta([&] { sa = (*a)->Init(0, 2, *id); });
  std::thread tb([&] { sb = (*b)->Init(1, 2, *id); });
  ta.join();
  tb.join();
  ASSERT_TRUE(sa.ok()) << sa;
  ASSERT_TRUE(sb.ok()) << sb;

  constexpr size_t kBytes = 8 << 20;
  std::vector<uint8_t> host_src(kBytes), poison(kBytes);
  std::mt19937_64 rng(5);
  for (auto& v : host_src) v = static_cast<uint8_t>(rng());
  for (auto& v : poison) v = static_cast<uint8_t>(rng());
  void *src = nullptr, *region = nullptr;
  cudaSetDevice(0);
  ASSERT_EQ(cudaMalloc(&src, kBytes), cudaSuccess);
  cudaMemcpy(src, host_src.data(), kBytes, cudaMemcpyHostToDevice);
  cudaSetDevice(1);
  ASSERT_EQ(cudaMalloc(&region, kBytes), cudaSuccess);
  cudaMemcpy(region, poison.data(), kBytes, cudaMemcpyHostToDevice);
  auto d = (*b)->RegisterRegion(region, kBytes);
  ASSERT_TRUE(d.ok()) << d.status();

  auto* s = static_cast<uint8_t*>(src);
  std::vector<WriteOp> ops = {{s, 4096, 0}, {s + 100, 0, 77}, {s + 8192, 3 << 20, 1 << 20}};
  absl::Status w = (*a)->Write(*d, ops, std::chrono::seconds(20));
  ASSERT_TRUE(w.ok()) << w;
  std::vector<uint8_t> expect = poison;
  std::copy(host_src.begin(), host_src.begin() + 4096, expect.begin());
  std::copy(host_src.begin() + 8192, host_src.begin() + 8192 + (3 << 20),
            expect.begin() + (1 << 20));
  std::vector<uint8_t> got(kBytes);
  cudaMemcpy(got.data(), region, kBytes, cudaMemcpyDeviceToHost);
  EXPECT_TRUE(got == expect);

  absl::Status bad = (*a)->Write(*d, {{s, 4096, kBytes - 10}}, std::chrono::seconds(20));
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_EQ((*a)->stats().bytes_written, 4096u + (3u << 20));
  EXPECT_EQ((*b)->stats().bytes_received, 4096u + (3u << 20));
}


TEST(NcclTransportTest, InitGivesUpAtItsDeadlineWhenNoPeerJoins) {
  if (DeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  auto id = NcclTransport::CreateUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  auto a = NcclTransport::Create({.device = 0});
  ASSERT_TRUE(a.ok()) << a.status();
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = (*a)->Init(0, 2, *id, start + std::chrono::milliseconds(500));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  a->reset();  // must not hang on the aborted communicator
}

// The workers' "nccl" backend with real ranks: a pair transport per GPU, the join called in
// process (the gRPC half is nccl_join_test's).
TEST(NcclTransportTest, PairTransportJoinsOnFirstWriteBetweenTwoGpus) {
  if (DeviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices";
  auto make = [](int device, std::string control, NcclJoinFn join) {
    NcclPairTransportOptions o;
    o.control_address = std::move(control);
    o.join = std::move(join);
    o.create_rank = [device] { return NcclTransport::Create({.device = device}); };
    o.create_unique_id = [] { return NcclTransport::CreateUniqueId(); };
    auto t = NcclPairTransport::Create(std::move(o));
    EXPECT_TRUE(t.ok()) << t.status();
    return std::move(*t);
  };
  std::unique_ptr<NcclPairTransport> decode = make(1, "decode:1", nullptr);
  int joins = 0;
  std::unique_ptr<NcclPairTransport> prefill =
      make(0, "", [&](const std::string&, const NcclJoinRequest& r,
                      std::chrono::steady_clock::time_point d) {
        joins++;
        return decode->HandleJoin(r, d);
      });
  constexpr size_t kBytes = 1 << 20;
  std::vector<uint8_t> host_src(kBytes), back(kBytes);
  std::mt19937_64 rng(9);
  for (auto& v : host_src) v = static_cast<uint8_t>(rng());
  void *src = nullptr, *region = nullptr;
  cudaSetDevice(0);
  ASSERT_EQ(cudaMalloc(&src, kBytes), cudaSuccess);
  cudaMemcpy(src, host_src.data(), kBytes, cudaMemcpyHostToDevice);
  cudaSetDevice(1);
  ASSERT_EQ(cudaMalloc(&region, kBytes), cudaSuccess);
  cudaMemset(region, 0xA5, kBytes);  // poison
  auto d = decode->RegisterRegion(region, kBytes);
  ASSERT_TRUE(d.ok()) << d.status();
  auto* s = static_cast<uint8_t*>(src);
  ASSERT_TRUE(prefill->Write(*d, {{s, kBytes / 2, 0}}, std::chrono::seconds(30)).ok());
  ASSERT_TRUE(prefill->Write(*d, {{s + kBytes / 2, kBytes / 2, kBytes / 2}},
                             std::chrono::seconds(30)).ok());
  EXPECT_EQ(joins, 1);
  cudaSetDevice(1);
  cudaMemcpy(back.data(), region, kBytes, cudaMemcpyDeviceToHost);
  EXPECT_EQ(back, host_src);
  EXPECT_EQ(prefill->stats().bytes_written, kBytes);
  prefill.reset();
  decode.reset();
  cudaFree(region);
  cudaSetDevice(0);
  cudaFree(src);
}

}  // namespace
}  // namespace tandem::transfer
