// PackKvBlocks / UnpackKvBlocks against direct indexing of the cache layout.
#include "tandem/kernels/kv_pack.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::kernels {
namespace {

TEST(KvPackTest, PackGathersEveryRegionAndUnpackRestoresExactly) {
  std::mt19937 rng(7);
  // Odd block size on purpose: nothing may assume alignment.
  for (size_t block_bytes : {size_t{4096}, size_t{4104}, size_t{37}}) {
    const int32_t num_blocks = 23, n_regions = 6, n = 9;
    const size_t region_stride = num_blocks * block_bytes;
    std::vector<uint8_t> cache(region_stride * n_regions);
    for (auto& b : cache) b = static_cast<uint8_t>(rng());
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(n);  // distinct, out of order

    KvPackParams p;
    p.region_stride = region_stride;
    p.n_regions = n_regions;
    p.block_bytes = block_bytes;
    p.blocks = ids.data();
    p.n_blocks = n;
    ASSERT_EQ(KvPackedBytes(p), size_t(n_regions) * n * block_bytes);
    std::vector<uint8_t> packed(KvPackedBytes(p), 0xAB);
    PackKvBlocks(p, cache.data(), packed.data());
    for (int r = 0; r < n_regions; ++r) {
      for (int i = 0; i < n; ++i) {
        const uint8_t* want = cache.data() + r * region_stride + size_t(ids[i]) * block_bytes;
        const uint8_t* got = packed.data() + (size_t(r) * n + i) * block_bytes;
        ASSERT_EQ(0, std::memcmp(want, got, block_bytes)) << r << " " << i;
      }
    }

    // Unpack into a different cache: only the request's blocks change, to the packed bytes.
    std::vector<uint8_t> other(cache.size());
    for (auto& b : other) b = static_cast<uint8_t>(rng());
    std::vector<uint8_t> expect = other;
    for (int r = 0; r < n_regions; ++r) {
      for (int i = 0; i < n; ++i) {
        const size_t off = r * region_stride + size_t(ids[i]) * block_bytes;
        std::memcpy(expect.data() + off, cache.data() + off, block_bytes);
      }
    }
    UnpackKvBlocks(p, packed.data(), other.data());
    ASSERT_EQ(other, expect) << block_bytes;
  }
}

}  // namespace
}  // namespace tandem::kernels
