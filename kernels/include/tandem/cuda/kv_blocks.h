// KV cache movement on the GPU: block pack/unpack for transfers (the same bytes as
// kernels::PackKvBlocks / UnpackKvBlocks, tandem/kernels/kv_pack.h) and the per-token KV write,
// optionally quantising to INT8 or FP8-e4m3 with the slot layout and encoding of
// tandem/kernels/kv_quant.h (bit-identical to kernels::QuantizeKvSlot, including padding bytes
// and non-finite inputs).
// Ownership: device pointers owned by the caller (KvPackParams::blocks and slot_mapping are
// device arrays). Threading and errors: see cuda_common.h.
#pragma once

#include <cstdint>

#include "tandem/cuda/cuda_common.h"
#include "tandem/kernels/dtype.h"
#include "tandem/kernels/kv_pack.h"

namespace tandem::kernels::cuda {

// cache: the first region's start; packed: KvPackedBytes(p) bytes. 16-byte aligned pointers
// and block_bytes take the vectorised path; anything else is copied byte by byte.
absl::Status PackKvBlocks(const KvPackParams& p, const void* cache, void* packed, Stream stream);
absl::Status UnpackKvBlocks(const KvPackParams& p, const void* packed, void* cache,
                            Stream stream);

struct KvWriteParams {
  const float* k = nullptr;  // [n_tokens][n_kv_head * head_dim], rows `stride` floats apart
  const float* v = nullptr;
  int64_t stride = 0;  // 0: n_kv_head * head_dim
  int32_t n_tokens = 0;
  // device: per token, its cache slot block * block_size + slot_in_block (negative: skip).
  const int64_t* slot_mapping = nullptr;
  int32_t n_kv_head = 0;
  int32_t head_dim = 0;
  DType type = DType::kF16;  // kF32, kF16, kI8 or kFp8E4M3
  void* k_cache = nullptr;   // this layer's K region
  void* v_cache = nullptr;
};

absl::Status WriteKv(const KvWriteParams& p, Stream stream);

}  // namespace tandem::kernels::cuda
