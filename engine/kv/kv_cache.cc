#include "engine/kv/kv_cache.h"

#include <sys/mman.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"
#include "tandem/kernels/fp16.h"
#include "tandem/kernels/kv_quant.h"

namespace tandem::engine {

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheOptions& o) {
  if (o.num_layers <= 0 || o.num_kv_heads <= 0 || o.head_dim <= 0 || o.block_size <= 0 ||
      o.num_blocks <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV cache shape must be positive: layers=", o.num_layers, " kv_heads=", o.num_kv_heads,
        " head_dim=", o.head_dim, " block_size=", o.block_size, " blocks=", o.num_blocks));
  }
  if (o.type != kernels::DType::kF32 && o.type != kernels::DType::kF16 &&
      !kernels::IsQuantizedKvType(o.type)) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache type must be f32, f16, int8 or fp8, got ",
                     std::string(kernels::Traits(o.type).name)));
  }
  const size_t size = RequiredBytes(o);
  if (o.device_memory && o.external_memory == nullptr) {
    return absl::InvalidArgumentError("a KV cache in device memory needs that memory provided");
  }
  if (o.external_memory != nullptr) {
    if (o.external_bytes < size) {
      return absl::InvalidArgumentError(absl::StrCat("external KV memory has ", o.external_bytes,
                                                     " bytes; the cache needs ", size));
    }
    return std::unique_ptr<KvCache>(
        new KvCache(o, static_cast<uint8_t*>(o.external_memory), size, /*owned=*/false));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return util::FromErrno(errno, absl::StrCat("mmap KV cache of ", size, " bytes"));
  }
  return std::unique_ptr<KvCache>(new KvCache(o, static_cast<uint8_t*>(p), size, /*owned=*/true));
}

uint64_t KvCache::RequiredBytes(const KvCacheOptions& o) {
  if (o.num_layers <= 0 || o.num_kv_heads <= 0 || o.head_dim <= 0 || o.block_size <= 0 ||
      o.num_blocks <= 0) {
    return 0;
  }
  return uint64_t(o.num_layers) * 2 * o.num_blocks * o.block_size * SlotBytes(o);
}

size_t KvCache::ElemBytes(kernels::DType t) {
  switch (t) {
    case kernels::DType::kF16: return 2;
    case kernels::DType::kI8:
    case kernels::DType::kFp8E4M3: return 1;
    default: return 4;
  }
}

size_t KvCache::SlotBytes(const KvCacheOptions& o) {
  if (kernels::IsQuantizedKvType(o.type)) {
    return static_cast<size_t>(kernels::KvQuantSlotBytes(o.num_kv_heads, o.head_dim));
  }
  return size_t(o.num_kv_heads) * o.head_dim * ElemBytes(o.type);
}

KvCache::KvCache(const KvCacheOptions& o, uint8_t* base, size_t size, bool owned)
    : o_(o), base_(base), size_(size), owned_(owned), pool_(o.num_blocks) {}

KvCache::~KvCache() {
  if (owned_) munmap(base_, size_);
}

void KvCache::Write(int32_t layer, std::span<const int32_t> blocks, int64_t pos, const float* k,
                    const float* v) {
  const int32_t block = blocks[pos / o_.block_size];
  const int64_t slot = pos % o_.block_size;
  const size_t off = (size_t(block) * o_.block_size + slot) * slot_bytes();
  uint8_t* kd = k_layer(layer) + off;
  uint8_t* vd = v_layer(layer) + off;
  if (kernels::IsQuantizedKvType(o_.type)) {
    kernels::QuantizeKvSlot(o_.type, k, o_.num_kv_heads, o_.head_dim, kd);
    kernels::QuantizeKvSlot(o_.type, v, o_.num_kv_heads, o_.head_dim, vd);
  } else if (o_.type == kernels::DType::kF32) {
    std::memcpy(kd, k, slot_elems() * 4);
    std::memcpy(vd, v, slot_elems() * 4);
  } else {
    kernels::F32ToFp16Row(k, reinterpret_cast<uint16_t*>(kd), slot_elems());
    kernels::F32ToFp16Row(v, reinterpret_cast<uint16_t*>(vd), slot_elems());
  }
}

}  // namespace tandem::engine
