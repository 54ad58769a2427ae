// The device KV block checksum (tandem/cuda/kv_checksum.h) against the plain CPU reference
// (tandem/kernels/kv_checksum.h) on random pools (label gpu; skips cleanly without a device).
// The reference itself equals the production CPU checksum bit for bit
// (tests/unit/services/kv_layout_test.cc), so this closes GPU == CPU.
#include <cuda_runtime_api.h>

#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/cuda/cuda_common.h"
#include "tandem/cuda/kv_checksum.h"
#include "tandem/kernels/kv_checksum.h"

namespace tandem::kernels {
namespace {

TEST(CudaKvChecksumTest, EqualsTheCpuReferenceBitForBit) {
  if (cuda::VisibleDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(7);
  // 8-byte, 30-byte (tail words padded) and 1-byte slots; an offset pool start makes every
  // segment unaligned in the last case, so the byte-wise path runs too.
  struct Shape {
    uint64_t slot_bytes;
    int32_t layers;
    size_t pool_offset;
  };
  for (const Shape sh : {Shape{512, 4, 0}, Shape{30, 3, 0}, Shape{1, 2, 0}, Shape{256, 2, 3}}) {
    const int32_t block_size = 16, num_blocks = 9;
    const uint64_t block_bytes = block_size * sh.slot_bytes;
    const uint64_t kv_stride = num_blocks * block_bytes, layer_stride = 2 * kv_stride;
    std::vector<uint8_t> pool(sh.pool_offset + sh.layers * layer_stride);
    for (uint8_t& b : pool) b = static_cast<uint8_t>(rng());
    std::vector<int32_t> blocks = {8, 0, 4, 4, 2, 7}, slots = {16, 1, 9, 16, 0, 13};
    KvChecksumParams p;
    p.layer_stride = layer_stride;
    p.kv_stride = kv_stride;
    p.num_layers = sh.layers;
    p.block_bytes = block_bytes;
    p.slot_bytes = sh.slot_bytes;
    p.count = static_cast<int32_t>(blocks.size());
    std::vector<uint64_t> want(blocks.size());
    p.pool = pool.data() + sh.pool_offset;
    p.blocks = blocks.data();
    p.num_slots = slots.data();
    p.out = want.data();
    KvBlockChecksumsReference(p);

    uint8_t* d_pool = nullptr;
    int32_t* d_ids = nullptr;
    uint64_t* d_out = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_pool), pool.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_ids), 2 * sizeof(int32_t) * blocks.size()),
              cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_out), sizeof(uint64_t) * blocks.size()),
              cudaSuccess);
    cudaMemcpy(d_pool, pool.data(), pool.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(d_ids, blocks.data(), sizeof(int32_t) * blocks.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(d_ids + blocks.size(), slots.data(), sizeof(int32_t) * slots.size(),
               cudaMemcpyHostToDevice);
    cudaMemset(d_out, 0xCD, sizeof(uint64_t) * blocks.size());  // poisoned
    KvChecksumParams d = p;
    d.pool = d_pool + sh.pool_offset;
    d.blocks = d_ids;
    d.num_slots = d_ids + blocks.size();
    d.out = d_out;
    const absl::Status st = cuda::KvBlockChecksums(d, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    std::vector<uint64_t> got(blocks.size());
    ASSERT_EQ(cudaMemcpy(got.data(), d_out, sizeof(uint64_t) * got.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t i = 0; i < blocks.size(); ++i) {
      EXPECT_EQ(got[i], want[i]) << "slot_bytes " << sh.slot_bytes << " block " << blocks[i];
    }
    EXPECT_NE(want[0], want[2]);
    // A single flipped bit on the device changes that block's checksum, and only that one.
    const uint64_t at = sh.pool_offset + layer_stride + kv_stride + 4 * block_bytes + 5;
    pool[at] ^= 0x10;
    cudaMemcpy(d_pool + at, &pool[at], 1, cudaMemcpyHostToDevice);
    ASSERT_TRUE(cuda::KvBlockChecksums(d, nullptr).ok());
    cudaMemcpy(got.data(), d_out, sizeof(uint64_t) * got.size(), cudaMemcpyDeviceToHost);
    EXPECT_NE(got[2], want[2]);
    EXPECT_EQ(got[0], want[0]);
    cudaFree(d_pool);
    cudaFree(d_ids);
    cudaFree(d_out);
  }
}

}  // namespace
}  // namespace tandem::kernels
