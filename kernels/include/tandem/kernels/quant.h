// Block quantisation formats (GGUF/ggml layouts): quantise and dequantise rows.
//
// Layouts, per block:
//   Q8_0  32 elems: fp16 d, int8 qs[32]                       x = d * q
//   Q4_0  32 elems: fp16 d, uint8 qs[16]                      x = d * (nibble - 8); low nibbles
//                                                             hold elems 0..15, high 16..31
//   Q4_K 256 elems: fp16 d, fp16 dmin, uint8 scales[12], uint8 qs[128]   (8 sub-blocks of 32,
//                                                             6-bit scale and min each)
//   Q6_K 256 elems: uint8 ql[128], uint8 qh[64], int8 scales[16], fp16 d
//   Q8_K 256 elems: float d, int8 qs[256], int16 bsums[16]     (activations only)
//   MXFP4 32 elems: uint8 e (E8M0 shared exponent), uint8 qs[16] (FP4 E2M1 pairs)
//   F16/BF16/F32: plain.
// All functions are pure and thread-safe. n must be a multiple of the type's block size.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "tandem/kernels/dtype.h"

namespace tandem::kernels {

// Quantises n floats into dst (RowBytes(type, n) bytes). INVALID_ARGUMENT if n is not a
// multiple of the block size or the type cannot be produced (Q8_K is activation-only but
// allowed).
absl::Status QuantizeRow(DType type, const float* src, void* dst, int64_t n);

// Dequantises n elements of a row of `type` into dst.
void DequantizeRow(DType type, const void* src, float* dst, int64_t n);

}  // namespace tandem::kernels
