// Matrix multiplication of a weight matrix (any weight DType) by float activations:
//   output[b][r] = sum_c W[r][c] * input[b][c]   for b < batch, r < rows
// W is row-major with `cols` elements per row (GGUF tensor dims {cols, rows}).
//
// Matmul is the optimised path. Like llama.cpp's CPU backend it first converts the activations
// into the weight type's partner ("vec dot") type: Q8_0 for Q8_0/Q4_0/MXFP4 weights, Q8_K for
// Q4_K/Q6_K, F16 for F16, BF16 for BF16, F32 for F32, and accumulates in that format's way.
// That keeps tandem's numerics close to llama.cpp's. MatmulReference dequantises the weights and
// accumulates in double with the float activations: the ground truth for tests.
// Threading: Matmul shares chunks of rows out over the pool (nullptr: run inline). Caller owns
// all buffers.
// Matmul's SIMD path is picked at run time (see cpu_features.h); it keeps a per-calling-thread
// scratch buffer for the converted activations. Bad shapes (cols not a multiple of the block
// size, null buffers, strides below the row length) are programmer errors and abort.
#pragma once

#include <cstdint>
#include <span>

#include "tandem/kernels/dtype.h"

namespace tandem::util {
class ThreadPool;
}

namespace tandem::kernels {

struct MatmulParams {
  DType weight_type = DType::kF32;
  const void* weight = nullptr;
  int64_t rows = 0;  // output features
  int64_t cols = 0;  // input features
  const float* input = nullptr;
  int64_t input_stride = 0;  // floats between consecutive input rows (0: cols)
  int64_t batch = 1;
  float* output = nullptr;
  int64_t output_stride = 0;  // floats between consecutive output rows (0: rows)
  bool packed = false;        // weight is PackWeights' layout, not row-major GGUF rows
};

void Matmul(const MatmulParams& p, util::ThreadPool* pool);

// One output of MatmulMulti: `rows` rows of weights (of the call's type and column count)
// written to output[b * output_stride + r] (output_stride 0: rows).
struct MatmulTarget {
  const void* weight = nullptr;
  int64_t rows = 0;
  float* output = nullptr;
  int64_t output_stride = 0;
};

// Several matrices of one type and column count applied to the same input, as the fused
// Q/K/V and gate/up projections: the activations are converted once and the rows of all
// targets are split over the pool in one hand-off. Each output equals Matmul's bit for bit.
// `packed`: every target's weight is in PackWeights' layout.
void MatmulMulti(DType weight_type, int64_t cols, const float* input, int64_t input_stride,
                 int64_t batch, std::span<const MatmulTarget> targets, util::ThreadPool* pool,
                 bool packed = false);

// Weights rearranged once, at model load, for this CPU's fastest Matmul kernel: rows in groups
// of 16 with their blocks interleaved (the layout is private to the kernels), the same bytes per
// row plus padding of the last group. Today Q8_0, Q4_0 and MXFP4 on AVX-512 VNNI CPUs; elsewhere
// PackedWeightBytes is 0 and the GGUF rows are used as they are. A Matmul over packed weights
// computes each output as sum over blocks of (weight scale * activation scale) * integer dot,
// accumulated in block order: the scalar numerics of the row-major kernels.
// PackedWeightBytes: the size of the packed copy of a rows x cols matrix, or 0 when this CPU
// has no packed kernel for the type. PackWeights writes it to dst (64-byte aligned).
size_t PackedWeightBytes(DType weight_type, int64_t rows, int64_t cols);
void PackWeights(DType weight_type, const void* src, int64_t rows, int64_t cols, void* dst);
// Row r of packed weights dequantised to floats (equal to GetRow on the unpacked matrix).
void GetPackedRow(DType weight_type, const void* packed, int64_t cols, int64_t r, float* out);
void MatmulReference(const MatmulParams& p);

// Dot product of one weight row (n elements of type t) with a float vector, in the same
// activation-quantised numerics as Matmul. Used for embeddings lookups tests and small cases.
float DotRow(DType t, const void* row, const float* x, int64_t n);

// Row r of a weight matrix dequantised to floats (embedding lookup).
void GetRow(DType t, const void* weight, int64_t cols, int64_t r, float* out);

// The activation format Matmul converts inputs into for weights of type t (see above).
DType VecDotType(DType weight_type);

// Converts n activations into the ggml row layout of vec_dot_type (one of VecDotType's
// results) exactly as Matmul does, so callers and tests can reproduce Matmul's rounding.
// Q8_0 here follows llama.cpp's x86 CPU backend (scale 127/amax, ties to even), which can differ
// in the last bit from QuantizeRow's reference quantiser; the others equal QuantizeRow.
void QuantizeActivationRow(DType vec_dot_type, const float* x, void* dst, int64_t n);

}  // namespace tandem::kernels
