// Causal attention of a sequence's new queries over its paged KV cache.
//
// Query i sits at position q_pos[i] and attends to cache positions [0, q_pos[i]] of the same
// sequence (its own K/V must already be written). Keys and values are found through the
// sequence's block table: position t lives in block block_table[t / block_size], slot
// t % block_size. GQA: query head h reads kv head h / (n_head / n_kv_head).
// Numerics follow llama.cpp's non-flash path: f32 dot products, scale, softmax with the max
// subtracted and the exponential sum accumulated in double, then the weighted sum of values.
// The AVX-512 path (head_dim a multiple of 16, up to 128) reads each K/V row once per GQA group
// and takes exponentials from a polynomial; results agree with the reference to about 1e-6.
// Quantised caches (kI8, kFp8E4M3; layout in tandem/kernels/kv_quant.h: a slot is
// KvQuantSlotBytes bytes, codes then one f32 scale per kv head) are dequantised row by row as
// they are read (codes times their scale, in f32, the same values on every path) and then
// follow the same numerics, on the AVX-512 path as well.
// gpt-oss's extras: with `window` > 0 query i attends only to the last `window` positions
// (q_pos[i] - window, q_pos[i]]; with `sinks` each head's softmax has one more logit,
// sinks[h], that takes probability but carries no value (llama.cpp's soft_max_ext sinks).
// Threading: (query row, KV head) items are shared out over the pool dynamically (nullptr:
// inline). Caller owns buffers.
#pragma once

#include <cstdint>
#include <span>

#include "tandem/kernels/dtype.h"

namespace tandem::util {
class ThreadPool;
}

namespace tandem::kernels {

struct PagedAttentionParams {
  const float* q = nullptr;  // [n_q][n_head * head_dim], rows q_stride floats apart
  int64_t q_stride = 0;
  int64_t n_q = 0;
  const int32_t* q_pos = nullptr;  // n_q positions
  int64_t n_head = 0;
  int64_t n_kv_head = 0;
  int64_t head_dim = 0;
  float scale = 1.0f;
  DType kv_type = DType::kF32;  // kF32, kF16, kI8 or kFp8E4M3
  const void* k_cache = nullptr;  // this layer's K region: [block][slot][kv_head][head_dim]
  const void* v_cache = nullptr;
  int64_t block_size = 16;
  const int32_t* block_table = nullptr;
  float* out = nullptr;  // [n_q][n_head * head_dim], rows out_stride floats apart
  int64_t out_stride = 0;
  int32_t window = 0;             // sliding window in positions; 0: the whole causal prefix
  const float* sinks = nullptr;   // n_head logits, or null
};

void PagedAttention(const PagedAttentionParams& p, util::ThreadPool* pool);
// Several sequences' attention in one pass over the pool (one hand-off instead of one per
// sequence: a batched decode step has one query row per sequence).
void PagedAttentionBatch(std::span<const PagedAttentionParams> seqs, util::ThreadPool* pool);
void PagedAttentionReference(const PagedAttentionParams& p);

}  // namespace tandem::kernels
