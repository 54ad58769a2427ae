// CudaIpcTransport (label gpu): without a device, Create is FAILED_PRECONDITION "no CUDA
// device" (runs everywhere); with one, device-to-device writes land byte for byte, bad input is
// refused by kind, and a host region cannot be registered. Writes between two processes run in
// `make gpu-check` (a 1P+1D cluster on one GPU over cuda_ipc).
#include "common/transfer/cuda_ipc/cuda_ipc_transport.h"

#include <cuda_runtime_api.h>

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::transfer {
namespace {

int Devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

#define SKIP_WITHOUT_DEVICE() \
  if (Devices() == 0) GTEST_SKIP() << "no CUDA device"

TEST(CudaIpcTransportTest, WithoutADeviceCreateIsFailedPrecondition) {
  if (Devices() > 0) GTEST_SKIP() << "a CUDA device is present";
  absl::StatusOr<std::unique_ptr<KvTransport>> t = CreateCudaIpcTransport({});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("no CUDA device"), std::string::npos) << t.status();
}

TEST(CudaIpcTransportTest, CapabilitiesSayDeviceMemoryOnOneNode) {
  SKIP_WITHOUT_DEVICE();
  auto t = CreateCudaIpcTransport({});
  ASSERT_TRUE(t.ok()) << t.status();
  const Capabilities c = (*t)->capabilities();
  EXPECT_EQ(c.name, "cuda_ipc");
  EXPECT_TRUE(c.device_memory);
  EXPECT_TRUE(c.one_sided);
  EXPECT_FALSE(c.cross_host);
}

TEST(CudaIpcTransportTest, DeviceWritesLandByteForByte) {
  SKIP_WITHOUT_DEVICE();
  auto rx = CreateCudaIpcTransport({});
  auto tx = CreateCudaIpcTransport({});
  ASSERT_TRUE(rx.ok() && tx.ok());
  constexpr size_t kRegion = 1 << 20, kSrc = 64 << 10;
  uint8_t *region = nullptr, *src = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&region), kRegion), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&src), kSrc), cudaSuccess);
  cudaMemset(region, 0xCD, kRegion);  // poisoned
  std::vector<uint8_t> host(kSrc);
  std::mt19937 rng(3);
  for (uint8_t& b : host) b = static_cast<uint8_t>(rng());
  cudaMemcpy(src, host.data(), kSrc, cudaMemcpyHostToDevice);
  // Registered from inside the allocation: the descriptor carries the offset.
  absl::StatusOr<RegionDescriptor> d = (*rx)->RegisterRegion(region + 4096, kRegion - 4096);
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<RegionDescriptor> parsed = RegionDescriptor::Parse(d->Serialize());
  ASSERT_TRUE(parsed.ok());
  std::vector<WriteOp> ops = {{src, 1000, 0}, {src + 1000, kSrc - 1000, 200000}};
  ASSERT_TRUE((*tx)->Write(*parsed, ops, std::chrono::seconds(10)).ok());
  std::vector<uint8_t> got(kRegion);
  cudaMemcpy(got.data(), region, kRegion, cudaMemcpyDeviceToHost);
  EXPECT_TRUE(std::equal(host.begin(), host.begin() + 1000, got.begin() + 4096));
  EXPECT_TRUE(std::equal(host.begin() + 1000, host.end(), got.begin() + 4096 + 200000));
  EXPECT_EQ(got[4096 + 1000], 0xCD);  // nothing between the ops
  EXPECT_EQ((*tx)->stats().bytes_written, kSrc);

  // An op past the region's end fails as a whole.
  absl::Status st = (*tx)->Write(*parsed, {{src, 16, kRegion - 4096 - 8}}, std::chrono::seconds(5));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  // A deadline already past.
  absl::Status late;
  bool called = false;
  (*tx)->WriteAsync(*parsed, {{src, 16, 0}}, std::chrono::steady_clock::now(), [&](absl::Status s) {
    late = s;
    called = true;
  });
  EXPECT_TRUE(called);
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  (*tx)->ForgetPeer(parsed->peer_address);
  EXPECT_TRUE((*rx)->DeregisterRegion(d->region_id).ok());
  EXPECT_EQ((*rx)->DeregisterRegion(d->region_id).code(), absl::StatusCode::kNotFound);
  cudaFree(src);
  cudaFree(region);
}

TEST(CudaIpcTransportTest, RefusesHostMemoryAndOtherNodes) {
  SKIP_WITHOUT_DEVICE();
  auto t = CreateCudaIpcTransport({});
  ASSERT_TRUE(t.ok());
  std::vector<uint8_t> host(4096);
  absl::StatusOr<RegionDescriptor> d = (*t)->RegisterRegion(host.data(), host.size());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();

  uint8_t* region = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&region), 4096), cudaSuccess);
  absl::StatusOr<RegionDescriptor> ok = (*t)->RegisterRegion(region, 4096);
  ASSERT_TRUE(ok.ok());
  RegionDescriptor other = *ok;
  other.peer_address = "cuda_ipc/another-node/1/abc";
  absl::Status st = (*t)->Write(other, {{region, 8, 0}}, std::chrono::seconds(5));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  other.peer_address = "ucx-something";
  st = (*t)->Write(other, {{region, 8, 0}}, std::chrono::seconds(5));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  cudaFree(region);
}

}  // namespace
}  // namespace tandem::transfer
