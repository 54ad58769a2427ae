// KV handoff facts: block checksums cover exactly the prompt slots of every layer's K and V in
// layer order (checked against bytes written through KvCache::Write, not through the layout
// formula under test), and a destination of another shape is refused by name.
#include "services/common/kv_layout.h"

#include <cstring>
#include <random>

#include "common/transfer/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "services/common/kv_pool.h"
#include "tandem/kernels/kv_checksum.h"
#include "tandem/kernels/kv_quant.h"

namespace tandem::services {
namespace {

engine::KvCacheOptions Shape(kernels::DType type = kernels::DType::kF32) {
  engine::KvCacheOptions o;
  o.num_layers = 3;
  o.num_kv_heads = 2;
  o.head_dim = 8;
  o.block_size = 4;
  o.num_blocks = 5;
  o.type = type;
  return o;
}

std::unique_ptr<engine::KvCache> PoisonedCache(const engine::KvCacheOptions& o, uint32_t seed) {
  auto kv = std::move(*engine::KvCache::Create(o));
  std::mt19937 rng(seed);
  for (uint8_t& b : kv->memory()) b = static_cast<uint8_t>(rng());
  return kv;
}

// The checksum of tandem/kernels/kv_checksum.h over `bytes`, taken as consecutive segments of
// `seg_len` bytes (K of layer 0, V of layer 0, K of layer 1, ...), by the plain reference.
uint64_t ReferenceOverSegments(const std::string& bytes, uint64_t seg_len, uint64_t slot_bytes) {
  kernels::KvChecksumParams p;
  p.pool = reinterpret_cast<const uint8_t*>(bytes.data());
  p.layer_stride = 2 * seg_len;
  p.kv_stride = seg_len;
  p.num_layers = static_cast<int32_t>(bytes.size() / (2 * seg_len));
  p.block_bytes = seg_len;
  p.slot_bytes = slot_bytes;
  const int32_t block = 0, slots = static_cast<int32_t>(seg_len / slot_bytes);
  uint64_t out = 0;
  p.blocks = &block;
  p.num_slots = &slots;
  p.count = 1;
  p.out = &out;
  kernels::KvBlockChecksumsReference(p);
  return out;
}

TEST(KvLayoutTest, ChecksumIsTheKeyedSumOverPromptSlotsOfKThenVPerLayer) {
  const engine::KvCacheOptions o = Shape();
  auto kv = PoisonedCache(o, 1);
  const int32_t block = 3, filled = 3;
  const int64_t slot = int64_t{o.num_kv_heads} * o.head_dim;
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  std::string expect_bytes;
  const int32_t table[] = {block};
  for (int32_t l = 0; l < o.num_layers; ++l) {
    std::vector<float> k(filled * slot), v(filled * slot);
    for (float& x : k) x = u(rng);
    for (float& x : v) x = u(rng);
    for (int32_t p = 0; p < filled; ++p) {
      kv->Write(l, table, p, k.data() + p * slot, v.data() + p * slot);
    }
    expect_bytes.append(reinterpret_cast<const char*>(k.data()), k.size() * sizeof(float));
    expect_bytes.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  }
  const uint64_t sum = BlockChecksum(*kv, block, filled);
  const size_t slot_bytes = slot * sizeof(float);
  EXPECT_EQ(sum, ReferenceOverSegments(expect_bytes, filled * slot_bytes, slot_bytes));

  // Bytes past the filled slots, and other blocks, are not part of the block's checksum.
  kv->k_layer(0)[block * kv->block_bytes() + filled * slot_bytes] ^= 0x40;
  kv->v_layer(2)[(block - 1) * kv->block_bytes()] ^= 0x40;
  kv->k_layer(1)[(block + 1) * kv->block_bytes()] ^= 0x40;
  EXPECT_EQ(BlockChecksum(*kv, block, filled), sum);
  // Any byte of the filled slots, K or V, first or last layer, is.
  for (uint8_t* p : {kv->k_layer(0) + block * kv->block_bytes(),
                     kv->v_layer(2) + block * kv->block_bytes() + filled * slot_bytes - 1,
                     kv->v_layer(0) + block * kv->block_bytes() + slot_bytes + 5}) {
    *p ^= 0x01;
    EXPECT_NE(BlockChecksum(*kv, block, filled), sum);
    *p ^= 0x01;
  }
  EXPECT_EQ(BlockChecksum(*kv, block, filled), sum);
}

// The production CPU checksum against the plain reference the CUDA kernel is also checked
// against (tests/unit/kernels/cuda_kv_checksum_test.cc), on random pools of every KV type, with
// slot sizes that are not a multiple of 8 bytes (zero-padded tail words), every fill level and
// scattered block tables: bit for bit, so GPU and CPU checksums of the same bytes compare equal.
TEST(KvLayoutTest, ChecksumEqualsTheKernelReferenceOnRandomPools) {
  int cases = 0;
  for (kernels::DType t : {kernels::DType::kF32, kernels::DType::kF16, kernels::DType::kI8,
                           kernels::DType::kFp8E4M3}) {
    for (int32_t head_dim : {8, 5, 64}) {
      engine::KvCacheOptions o = Shape(t);
      o.num_kv_heads = head_dim == 5 ? 3 : 2;
      o.head_dim = head_dim;
      o.block_size = 16;
      o.num_blocks = 7;
      absl::StatusOr<std::unique_ptr<engine::KvCache>> made = engine::KvCache::Create(o);
      if (!made.ok()) continue;  // a shape this KV type does not take
      auto kv = std::move(*made);
      std::mt19937 rng(static_cast<uint32_t>(head_dim * 31 + static_cast<int>(t)));
      for (uint8_t& b : kv->memory()) b = static_cast<uint8_t>(rng());
      std::vector<int32_t> blocks = {6, 0, 3, 5, 1}, slots;
      for (size_t i = 0; i < blocks.size(); ++i) slots.push_back(static_cast<int32_t>(rng() % 17));
      slots[0] = 16;
      slots[1] = 1;
      std::vector<uint64_t> ref(blocks.size(), 0);
      kernels::KvChecksumParams p;
      p.pool = kv->k_layer(0);
      p.layer_stride = 2 * kv->layer_bytes();
      p.kv_stride = kv->layer_bytes();
      p.num_layers = o.num_layers;
      p.block_bytes = kv->block_bytes();
      p.slot_bytes = kv->slot_bytes();
      p.blocks = blocks.data();
      p.num_slots = slots.data();
      p.count = static_cast<int32_t>(blocks.size());
      p.out = ref.data();
      kernels::KvBlockChecksumsReference(p);
      for (size_t i = 0; i < blocks.size(); ++i) {
        EXPECT_EQ(BlockChecksum(*kv, blocks[i], slots[i]), ref[i])
            << kernels::KvTypeName(t) << " head_dim " << head_dim << " slot_bytes "
            << kv->slot_bytes() << " block " << blocks[i] << " slots " << slots[i];
        ++cases;
      }
      // Different blocks of random data differ (the sum is not degenerate).
      EXPECT_NE(ref[0], ref[2]);
    }
  }
  EXPECT_GE(cases, 40);
}

// Every single-bit flip of a block's covered bytes changes its checksum (a flip changes one
// word, hence one bijectively mixed term of the sum).
TEST(KvLayoutTest, EverySingleBitFlipChangesTheChecksum) {
  engine::KvCacheOptions o = Shape(kernels::DType::kF16);
  o.num_kv_heads = 3;
  o.head_dim = 5;  // 30-byte slots: tail words are padded
  auto kv = PoisonedCache(o, 9);
  const int32_t block = 2, filled = 3;
  const uint64_t sum = BlockChecksum(*kv, block, filled);
  const size_t len = filled * kv->slot_bytes();
  int flips = 0;
  for (int32_t l = 0; l < o.num_layers; ++l) {
    for (uint8_t* seg : {kv->k_layer(l), kv->v_layer(l)}) {
      uint8_t* p = seg + block * kv->block_bytes();
      for (size_t i = 0; i < len; ++i) {
        for (int b = 0; b < 8; ++b) {
          p[i] ^= uint8_t(1u << b);
          EXPECT_NE(BlockChecksum(*kv, block, filled), sum) << "layer " << l << " byte " << i;
          p[i] ^= uint8_t(1u << b);
          ++flips;
        }
      }
    }
  }
  EXPECT_EQ(flips, 2 * o.num_layers * int(len) * 8);
  EXPECT_EQ(BlockChecksum(*kv, block, filled), sum);
}

TEST(KvLayoutTest, SequenceChecksumsFollowTheBlockTable) {
  for (kernels::DType t : {kernels::DType::kF32, kernels::DType::kF16}) {
    auto kv = PoisonedCache(Shape(t), 3);
    const std::vector<int32_t> table = {4, 1, 0};
    const std::vector<uint64_t> sums = SequenceChecksums(*kv, table, 6);
    ASSERT_EQ(sums.size(), 2u);
    EXPECT_EQ(sums[0], BlockChecksum(*kv, 4, 4));
    EXPECT_EQ(sums[1], BlockChecksum(*kv, 1, 2));
    EXPECT_NE(sums[0], sums[1]);
    EXPECT_EQ(SequenceChecksums(*kv, table, 8).size(), 2u);
    EXPECT_EQ(SequenceChecksums(*kv, table, 9).size(), 3u);
  }
  EXPECT_EQ(BlocksFor(0, 16), 0);
  EXPECT_EQ(BlocksFor(1, 16), 1);
  EXPECT_EQ(BlocksFor(16, 16), 1);
  EXPECT_EQ(BlocksFor(17, 16), 2);
}

TEST(KvLayoutTest, LayoutDescribesThePool) {
  auto kv = PoisonedCache(Shape(kernels::DType::kF16), 4);
  v1::KvDestination d;
  FillKvLayout(*kv, &d);
  EXPECT_EQ(d.kv_dtype(), "f16");
  EXPECT_EQ(d.block_bytes(), 4u * 2 * 8 * 2);
  // Offsets computed from the published strides land where the cache keeps its data.
  const uint8_t* base = kv->memory().data();
  EXPECT_EQ(kv->k_layer(2) - base, static_cast<ptrdiff_t>(2 * d.layer_stride()));
  EXPECT_EQ(kv->v_layer(2) - base, static_cast<ptrdiff_t>(2 * d.layer_stride() + d.kv_stride()));
  EXPECT_EQ(kv->memory().size(), d.num_layers() * d.layer_stride());
  EXPECT_TRUE(CheckSameKvShape(d, *kv).ok());
}

TEST(KvLayoutTest, AnotherShapeIsRefusedByName) {
  auto kv = PoisonedCache(Shape(), 5);
  v1::KvDestination good;
  FillKvLayout(*kv, &good);
  // A pool with more blocks has longer strides but the same shape: fine.
  v1::KvDestination bigger = good;
  bigger.set_kv_stride(good.kv_stride() * 4);
  bigger.set_layer_stride(good.layer_stride() * 4);
  EXPECT_TRUE(CheckSameKvShape(bigger, *kv).ok());

  struct Case {
    const char* field;
    std::function<void(v1::KvDestination&)> change;
  };
  const std::vector<Case> cases = {
      {"block_size", [](v1::KvDestination& d) { d.set_block_size(8); }},
      {"num_layers", [](v1::KvDestination& d) { d.set_num_layers(4); }},
      {"num_kv_heads", [](v1::KvDestination& d) { d.set_num_kv_heads(4); }},
      {"head_dim", [](v1::KvDestination& d) { d.set_head_dim(16); }},
      {"kv_dtype", [](v1::KvDestination& d) { d.set_kv_dtype("f16"); }},
      {"block_bytes", [](v1::KvDestination& d) { d.set_block_bytes(d.block_bytes() + 4); }},
      {"strides", [](v1::KvDestination& d) { d.set_layer_stride(d.kv_stride()); }},
  };
  for (const Case& c : cases) {
    v1::KvDestination d = good;
    c.change(d);
    const absl::Status st = CheckSameKvShape(d, *kv);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << c.field;
    EXPECT_NE(st.message().find(c.field), std::string::npos) << st;
  }
}

// A transport that says it can hold device memory; nothing is ever registered with it.
class DeviceCapableTransport : public transfer::KvTransport {
 public:
  transfer::Capabilities capabilities() const override {
    return {.name = "device-capable", .one_sided = true, .device_memory = true};
  }
  absl::StatusOr<transfer::RegionDescriptor> RegisterRegion(void*, uint64_t) override {
    return absl::UnimplementedError("not in this test");
  }
  absl::Status DeregisterRegion(uint64_t) override { return absl::NotFoundError("none"); }
  void WriteAsync(const transfer::RegionDescriptor&, std::vector<transfer::WriteOp>,
                  std::chrono::steady_clock::time_point,
                  std::function<void(absl::Status)> done) override {
    done(absl::UnimplementedError("not in this test"));
  }
  void ForgetPeer(const std::string&) override {}
  transfer::TransportStats stats() const override { return {}; }
};

// A worker's KV pool stays where its transport can reach it: a GPU pool with a host-only
// transport is refused at start with what is needed, never staged through host memory.
TEST(KvPoolTest, GpuWorkerPoolNeedsAGpuAndADeviceMemoryTransport) {
  engine::EngineOptions o;
  std::unique_ptr<transfer::KvTransport> host = transfer::CreateInProcessTransport("kv-pool-test");
  EXPECT_TRUE(CheckWorkerKvPlacement(o, host.get()).ok());
  EXPECT_TRUE(CheckWorkerKvPlacement(o, nullptr).ok());
  o.device = engine::Device::kCuda;
  DeviceCapableTransport device;
  if (!engine::CheckDeviceAvailable(engine::Device::kCuda).ok()) {
    // No GPU (or no CUDA in this build): refused first for that, whatever the transport.
    for (const transfer::KvTransport* t : {host.get(), static_cast<transfer::KvTransport*>(&device),
                                           static_cast<transfer::KvTransport*>(nullptr)}) {
      const absl::Status st = CheckWorkerKvPlacement(o, t);
      EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
#if defined(TANDEM_HAVE_CUDA)
      EXPECT_NE(st.message().find("no CUDA device"), std::string::npos) << st;
#else
      EXPECT_NE(st.message().find("built without CUDA"), std::string::npos) << st;
#endif
    }
    return;
  }
  // With a GPU: a host-only transport cannot carry a device pool; a device-memory one can.
  const absl::Status st = CheckWorkerKvPlacement(o, host.get());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("'inproc'"), std::string::npos) << st;
  EXPECT_NE(st.message().find("cuda_ipc"), std::string::npos) << st;
  EXPECT_TRUE(CheckWorkerKvPlacement(o, &device).ok());
  EXPECT_TRUE(CheckWorkerKvPlacement(o, nullptr).ok());
}

}  // namespace
}  // namespace tandem::services
