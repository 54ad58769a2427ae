// Quantised KV-cache storage: INT8 and FP8-e4m3 codes with f32 scales that live inside the
// cache's own bytes, so whatever moves a block (the prefill->decode transfer, the KV store,
// the per-block checksums) moves its scales with it and needs no format of its own.
//
// Slot layout (one token of one layer's K, or V; kv_head-major like the f32/f16 cache):
//
//   offset 0                      codes[kv_head][head_dim]   1 byte each
//   offset CodeBytes (4-aligned)  scales[kv_head]            f32, little-endian
//   total  KvQuantSlotBytes(n_kv_head, head_dim) = RoundUp(n_kv_head*head_dim, 4) + 4*n_kv_head
//
// A block is block_size such slots back to back ([block][slot] exactly as for f32/f16, only
// with this slot size), so positions [a, b) of one block are still one contiguous byte range
// and a partly filled block's first n slots carry their own scales. The "per-block scales" of
// the design are therefore stored per (slot, kv_head) inside the block rather than one per
// (block, kv_head). Why: a single scale per block would have to grow when a later token's
// |max| exceeds it, re-quantising the block's earlier slots. That (a) compounds rounding error
// on every re-quantisation, (b) makes a block's bytes depend on how tokens were grouped into
// steps unless every write is serialised per block (the engine writes a prefill's rows in
// parallel), and (c) breaks partial-block transfers and checksums, which cover only the first
// n slots. Per-slot scales cost 4 bytes per head_dim codes (6% at head_dim 64, 3% at 128) and
// make a slot a pure function of that token's K (or V) vector: prefill and decode, CPU and
// CUDA, any batching, produce the same bytes.
//
// Encoding of one (slot, kv_head) vector x[0..head_dim):
//   amax  = max |x[i]| over the finite x[i] (0 when there are none)
//   INT8: scale = amax / 127 (f32 division); code = clamp(rne(x[i] / scale), -127, 127) as a
//         two's-complement int8 (-128 is never written). value = code * scale.
//   FP8:  scale = amax / 448; code = E4M3(x[i] / scale) with the OCP "e4m3fn" format: sign,
//         4 exponent bits (bias 7), 3 mantissa bits, subnormals, no infinities, NaN = 0x7f and
//         0xff, largest finite 448 (0x7e). Conversion rounds to nearest, ties to even, and
//         saturates: |v| > 448 and +-inf give +-448 (as CUDA's __NV_SATFINITE does); NaN gives
//         0x7f with the input's sign bit. value = E4M3ToF32(code) * scale.
//   x[i] / scale is one IEEE f32 division (round to nearest even), never a multiply by 1/scale,
//   so other backends can reproduce the codes bit for bit (CUDA: __fdiv_rn, rintf).
//   amax == 0 (or amax / N underflowing to 0): scale = 0 and every finite code is 0.
//   Non-finite inputs: +-inf encode as +-127 (INT8) or +-448 (FP8) times the finite scale; NaN
//   encodes as the FP8 NaN code, and for INT8 (which has no NaN code) sets that vector's scale
//   to NaN, so the NaN reaches attention as it would with an f32 cache.
//
// Pure functions on caller-owned memory; thread-safe; no allocation. Callers check shapes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "tandem/kernels/dtype.h"

namespace tandem::kernels {

inline constexpr float kInt8KvMax = 127.0f;
inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr uint8_t kFp8E4M3NaN = 0x7f;

// True for the KV types stored as codes plus scales (kI8, kFp8E4M3).
inline bool IsQuantizedKvType(DType t) { return t == DType::kI8 || t == DType::kFp8E4M3; }

// Bytes of the codes of one slot, padded so the scales that follow are 4-byte aligned.
inline int64_t KvQuantCodeBytes(int64_t n_kv_head, int64_t head_dim) {
  return (n_kv_head * head_dim + 3) / 4 * 4;
}
// Bytes of one quantised slot: codes then one f32 scale per kv head.
inline int64_t KvQuantSlotBytes(int64_t n_kv_head, int64_t head_dim) {
  return KvQuantCodeBytes(n_kv_head, head_dim) + 4 * n_kv_head;
}

// KV cache type from its CLI spelling: "f32", "f16", "int8" (or "i8"), "fp8" (or "fp8_e4m3",
// "e4m3"); nullopt otherwise. KvTypeName is the inverse ("f32", "f16", "int8", "fp8").
std::optional<DType> KvTypeFromName(std::string_view name);
std::string_view KvTypeName(DType t);

// FP8-e4m3fn scalar conversions (round to nearest even, saturating; see above).
uint8_t F32ToFp8E4M3(float f);
float Fp8E4M3ToF32(uint8_t code);

// Quantise n floats with one scale; returns the scale (see the encoding above).
float QuantizeRowInt8(const float* x, int64_t n, int8_t* codes);
float QuantizeRowFp8E4M3(const float* x, int64_t n, uint8_t* codes);
void DequantizeRowInt8(const int8_t* codes, float scale, int64_t n, float* out);
void DequantizeRowFp8E4M3(const uint8_t* codes, float scale, int64_t n, float* out);

// Encodes one token's K (or V), n_kv_head * head_dim floats in [kv_head][head_dim] order, into
// the KvQuantSlotBytes bytes at `slot` (layout above). type is kI8 or kFp8E4M3.
void QuantizeKvSlot(DType type, const float* x, int64_t n_kv_head, int64_t head_dim,
                    uint8_t* slot);
// The inverse: n_kv_head * head_dim floats (codes times their head's scale).
void DequantizeKvSlot(DType type, const uint8_t* slot, int64_t n_kv_head, int64_t head_dim,
                      float* out);

}  // namespace tandem::kernels
