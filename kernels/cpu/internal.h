// Private to the CPU kernels: ggml block layouts, the converted-activation view the matmul
// tiles read, and the entry points of the per-ISA translation units (matmul_avx2.cc,
// matmul_avx512.cc, fp16_avx2.cc, activation_avx2.cc). Those files are compiled with wider
// -m flags than the rest, so nothing here may be an inline function or template shared with
// baseline code (the linker could keep the wide copy); only plain declarations and PODs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tandem/kernels/dtype.h"

namespace tandem::kernels {
struct PagedAttentionParams;
}

namespace tandem::kernels::internal {

inline constexpr int kQK8_0 = 32;
inline constexpr int kQK4_0 = 32;
inline constexpr int kQKMxfp4 = 32;
inline constexpr int kQKK = 256;

struct BlockQ8_0 {
  uint16_t d;  // fp16
  int8_t qs[kQK8_0];
};
static_assert(sizeof(BlockQ8_0) == 34);

struct BlockQ4_0 {
  uint16_t d;  // fp16
  uint8_t qs[kQK4_0 / 2];
};
static_assert(sizeof(BlockQ4_0) == 18);

struct BlockMxfp4 {
  uint8_t e;  // E8M0
  uint8_t qs[kQKMxfp4 / 2];
};
static_assert(sizeof(BlockMxfp4) == 17);

struct BlockQ4K {
  uint16_t d;     // fp16 super-scale of the 6-bit scales
  uint16_t dmin;  // fp16 super-scale of the 6-bit mins
  uint8_t scales[12];
  uint8_t qs[kQKK / 2];
};
static_assert(sizeof(BlockQ4K) == 144);

struct BlockQ6K {
  uint8_t ql[kQKK / 2];
  uint8_t qh[kQKK / 4];
  int8_t scales[kQKK / 16];
  uint16_t d;  // fp16
};
static_assert(sizeof(BlockQ6K) == 210);

struct BlockQ8K {
  float d;
  int8_t qs[kQKK];
  int16_t bsums[kQKK / 16];
};
static_assert(sizeof(BlockQ8K) == 292);

// E2M1 values doubled (ggml's kvalues_mxfp4), so that they are integers.
inline constexpr int8_t kMxfp4Values[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                            0, -1, -2, -3, -4, -6, -8, -12};

// One activation row converted to the weight type's vec-dot format, split into planes so
// SIMD loads are aligned and scales need no fp16 decoding in the inner loops:
//   F32: values = float[n]
//   F16: values = float[n], each rounded through fp16 (same products as ggml's fp16 dot)
//   BF16: values = uint16 bf16[n]
//   Q8_0: values = int8[n], scales = float[n/32] (the fp16 block scale, decoded)
//   Q8_K: values = int8[n], scales = float[n/256], bsums = int16[n/16]
struct ActRow {
  const void* values = nullptr;
  const float* scales = nullptr;
  const int16_t* bsums = nullptr;
  // Packed weights only: per block, -(weight offset) * (sum of the block's int8 values), the
  // term that cancels the unsigned offset the packed weights carry (see kPackRows).
  const int32_t* offsets = nullptr;
};

// Packed weights (PackWeights): groups of kPackRows rows with their 32-value blocks
// interleaved, so one 512-bit register holds four consecutive values of each of the 16 rows and
// one VPDPBUSD against four broadcast activations advances all 16 dot products. A group is
// (nblk + 1) / 2 pairs of blocks, each pair
//   values: two blocks of kPackQ8_0ValueBytes (Q8_0) or kPackQ4_0ValueBytes (Q4_0), then
//   scales: 2 x 16 fp16 (row m's block scale at 2m), one 64-byte line,
// so a group is a single stream for the prefetchers (an odd nblk leaves the last pair's second
// block zero).
// Q8_0 block: 8 chunks of 64 bytes; chunk k holds values 4k..4k+3 of row m at 4m, each plus
// 128 as uint8. Q4_0 block: 4 chunks of 64 bytes; chunk c holds bytes qs[4c..4c+3] of row m at
// 4m, so its low nibbles are values 4c.., its high nibbles values 4c+16.. (each value plus 8).
// MXFP4 block: the codes laid out as Q4_0's nibbles (the kernel maps each code to its doubled
// E2M1 value plus 12), and in the scales slot row m's E8M0 byte at byte m (not fp16).
// Rows past the matrix's last are zero with zero scales.
inline constexpr int kPackRows = 16;
inline constexpr int kPackQ8_0ValueBytes = 512;
inline constexpr int kPackQ4_0ValueBytes = 256;
inline constexpr int kPackTile = 8;  // activation rows one packed kernel call handles

// Byte offsets in a packed group, whose blocks have value_bytes of values, of block i's values
// and of its 16 fp16 scales.
inline constexpr int64_t PackedPairBytes(int64_t value_bytes) { return 2 * value_bytes + 64; }
inline constexpr int64_t PackedValuesAt(int64_t value_bytes, int64_t i) {
  return (i >> 1) * PackedPairBytes(value_bytes) + (i & 1) * value_bytes;
}
inline constexpr int64_t PackedScalesAt(int64_t value_bytes, int64_t i) {
  return (i >> 1) * PackedPairBytes(value_bytes) + 2 * value_bytes + (i & 1) * 32;
}
// Decode (one or two activation rows) streams the packed weights once; the kernel prefetches
// this far ahead of itself into L2, and each piece of a matmul its own first this many bytes.
inline constexpr int64_t kPackPrefetchBytes = 8192;

// Computes out[b * out_stride + m] for m < valid_rows (<= kPackRows), b < nb (<= kPackTile),
// over one packed group of nblk blocks.
using PackedFn = void (*)(const uint8_t* group, int64_t nblk, const ActRow* act, int nb,
                          float* out, int64_t out_stride, int valid_rows);

inline constexpr int kMaxTile = 4;  // activation rows one tile call handles

// The GEMM layout of Q8_0 activations (big batches on AVX-512, see GetGemmKernel), in groups
// of two 32-value blocks, 128 bytes each: the 64 Q8_0 integers plus 128 as uint8, then the two
// block scales as 16 floats, each repeated once per int32 lane of the dot product (8 per
// block). ActRow::values points at group 0; scales and bsums are unused. A missing second block
// (odd block count) has zero scales. Tiles take up to kGemmTile rows.
inline constexpr int kGemmTile = 8;
// Float weights (F32, F16) have GEMM tiles too, over the ordinary float activation rows, taking
// up to kFloatGemmTile rows.
inline constexpr int kFloatGemmTile = 6;

// Computes out[b * out_stride + r] = dot(weight row r, act[b]) for r < nrows, b < nb.
// w points at row 0 of the tile; rows are w_stride bytes apart.
using TileFn = void (*)(const uint8_t* w, size_t w_stride, int64_t nrows, const ActRow* act, int nb,
                        int64_t cols, float* out, int64_t out_stride);

// Tile functions per weight type; null where a level has no kernel of its own.
struct TileKernels {
  TileFn f32 = nullptr;
  TileFn f16 = nullptr;
  TileFn bf16 = nullptr;
  TileFn q8_0 = nullptr;
  TileFn q4_0 = nullptr;
  TileFn mxfp4 = nullptr;
  TileFn q4_k = nullptr;
  TileFn q6_k = nullptr;
};

TileKernels ScalarTileKernels();

namespace avx2 {
TileKernels GetTileKernels();
void Fp16ToF32Row(const uint16_t* src, float* dst, int64_t n);
void F32ToFp16Row(const float* src, uint16_t* dst, int64_t n);
void SwiGlu(const float* gate, const float* up, float* out, int64_t n);
}  // namespace avx2

namespace avx512 {
TileKernels GetTileKernels(bool with_bf16);

// A tile kernel for the GEMM activation layout (nb up to kGemmTile), or null for weight types
// without one.
TileFn GetGemmKernel(DType weight_type);
// The packed-weight kernel for Q8_0 or Q4_0, or null for other types.
PackedFn GetPackedKernel(DType weight_type);
// Q8_0 activation blocks exactly as matmul.cc's scalar QuantizeQ8_0Block: values q[32 * nblk],
// decoded scales[nblk], and (when sums is not null) sums[b] = weight_offset * -(sum of block
// b's values).
void QuantizeQ8_0Blocks(const float* x, int64_t nblk, int8_t* q, float* scales, int32_t* sums,
                        int32_t weight_offset);

bool AttentionSupports(const PagedAttentionParams& p);
// Query rows qi0 .. qi0+nq-1 of one sequence over one KV head (every query head of its group),
// for the shapes AttentionSupports accepts; each K and V row is loaded once for several rows.
// scores: ScoreRows() rows of `stride` >= the largest n_keys floats (rounded up to 16).
void AttendItem(const PagedAttentionParams& p, int64_t qi0, int64_t nq, int64_t kvh,
                float* scores, int64_t stride);
int ScoreRows();
}  // namespace avx512

}  // namespace tandem::kernels::internal
