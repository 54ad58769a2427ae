// The host-side layout of one Step for a device forward pass (engine/runtime/device_forward.h):
// what is uploaded once per step and how attention is launched over it. Pure host code, so it
// is built and tested everywhere; the CUDA forward pass (engine/runtime/cuda/) consumes it.
//
// Rows are the batch's tokens, chunk after chunk. `ints` starts with the T rows' positions
// (the RoPE and prefill-attention q_pos array), followed by the tables of the launches.
// Attention launches: each maximal run of consecutive single-token chunks is one decode launch
// (when `decode_kernel` is true) over key counts (start_pos + 1 each) and [n][table_width]
// block tables, each sequence's row holding the blocks its keys use then zeros; every other
// chunk is one prefill launch over its rows' positions and the blocks covering them.
// Threading: plain data; Build is a pure function of its arguments.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/runtime/engine.h"

namespace tandem::engine {

struct AttentionLaunch {
  bool decode = false;
  int64_t row = 0;          // first query row of the batch
  int32_t n = 0;            // decode: sequences (one row each); prefill: query rows
  int32_t max_pos = 0;      // prefill: position of the last row (q_pos are ints[row, row + n))
  int64_t table_off = 0;    // index into ints: prefill, the chunk's blocks; decode, the tables
  int32_t table_width = 0;  // decode: blocks per table row (the longest sequence's count)
  int64_t lens_off = 0;     // decode: index into ints of the n key counts
  int32_t max_len = 0;      // decode: the largest key count
};

struct StepPlan {
  std::vector<int32_t> ints;   // T positions, then every launch's tables and key counts
  std::vector<int64_t> slots;  // per row: its KV slot, block * block_size + slot in block
  std::vector<AttentionLaunch> launches;
  std::vector<int64_t> logit_rows;  // rows whose logits are wanted (each such chunk's last n_logits)

  // Chunks must already be validated (Engine::Step does): block tables cover the positions.
  void Build(std::span<const SeqChunk> chunks, int32_t block_size, bool decode_kernel);
};

}  // namespace tandem::engine
