// Paged attention on the GPU over the KV cache layout of engine/kv/kv_cache.h: one layer's K
// (or V) region is [block][slot][kv_head][head_dim] of f32 or f16, and position t of a sequence
// lives in block block_table[t / block_size], slot t % block_size. GQA: query head h reads kv
// head h / (n_head / n_kv_head). Each kernel matches kernels::PagedAttentionReference
// (tandem/kernels/attention.h) on the same inputs up to float rounding.
//
// Decode: one query row per sequence, attending to all seq_lens[s] cached positions (its own
// K/V already written). Bandwidth-bound by design: one CTA per (sequence, KV head[, group of up
// to 8 query heads][, split]) reads each K/V row once with 16-byte loads for every query head of
// the group; long contexts are split over several CTAs whose partial softmax states a second
// kernel combines (the workspace holds them).
// Prefill: several query rows of one sequence at positions q_pos[i] (causal: row i attends to
// cache positions [0, q_pos[i]], so a cached prefix is attended to as well), flash-style: tiles
// of query rows against tiles of keys with an online softmax, no score matrix in memory.
// Ownership: all pointers are device memory owned by the caller, except the int32 sizes.
// Threading and errors: see cuda_common.h. Decode supports f16 (head_dim 8..256), f32 (4..128)
// and the quantised caches of tandem/kernels/kv_quant.h, INT8 and FP8-e4m3 with per-(slot, kv
// head) scales (head_dim 4..128), head_dim a power of two in each case; prefill supports the
// same four cache types with head_dim a multiple of 8 up to 256. Cache pointers must be 16-byte aligned.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tandem/cuda/cuda_common.h"
#include "tandem/kernels/dtype.h"

namespace tandem::kernels::cuda {

struct DecodeAttentionParams {
  const float* q = nullptr;  // [n_seqs][n_head * head_dim], rows q_stride floats apart
  int64_t q_stride = 0;
  int32_t n_seqs = 0;
  const int32_t* seq_lens = nullptr;  // device: n_seqs key counts, each in [1, max_seq_len]
  int32_t max_seq_len = 0;            // host-side bound used to size the grid
  int32_t n_head = 0;
  int32_t n_kv_head = 0;
  int32_t head_dim = 0;
  float scale = 1.0f;
  DType kv_type = DType::kF16;  // kF16, kF32, kI8 or kFp8E4M3
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  int32_t block_size = 16;
  const int32_t* block_tables = nullptr;  // device: [n_seqs][max_blocks_per_seq]
  int32_t max_blocks_per_seq = 0;
  float* out = nullptr;  // [n_seqs][n_head * head_dim], rows out_stride floats apart
  int64_t out_stride = 0;
  // Keys per split; 0 picks one so the grid has about two CTAs per SM. A sequence shorter than
  // one split uses one CTA per (sequence, KV head) and needs no second kernel.
  int32_t keys_per_split = 0;
  void* workspace = nullptr;  // DecodeAttentionWorkspaceBytes bytes (may be null when that is 0)
  size_t workspace_bytes = 0;
};

// Bytes of workspace the call will need (0 when no sequence is split). Depends on the device's
// SM count when keys_per_split is 0.
absl::StatusOr<size_t> DecodeAttentionWorkspaceBytes(const DecodeAttentionParams& p);
absl::Status PagedDecodeAttention(const DecodeAttentionParams& p, Stream stream);

struct PrefillAttentionParams {
  const float* q = nullptr;  // [n_q][n_head * head_dim], rows q_stride floats apart
  int64_t q_stride = 0;
  int32_t n_q = 0;
  const int32_t* q_pos = nullptr;  // device: n_q positions (the usual case: prefix_len + i)
  int32_t max_pos = 0;             // host-side bound: max of q_pos
  int32_t n_head = 0;
  int32_t n_kv_head = 0;
  int32_t head_dim = 0;
  float scale = 1.0f;
  DType kv_type = DType::kF16;  // kF16, kF32, kI8 or kFp8E4M3
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  int32_t block_size = 16;
  const int32_t* block_table = nullptr;  // device: this sequence's blocks
  float* out = nullptr;
  int64_t out_stride = 0;
};

absl::Status PagedPrefillAttention(const PrefillAttentionParams& p, Stream stream);

}  // namespace tandem::kernels::cuda
