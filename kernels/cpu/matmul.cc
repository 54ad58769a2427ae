// Matmul driver: converts activations once per call into the weight type's vec-dot format
// (internal::ActRow planes), then walks the weight rows in blocks, threads taking chunks of
// rows from a shared counter. Within a row block every batch tile of kMaxTile activation rows is
// applied in turn, so a block of weight rows is fetched from memory once and re-read from cache
// for the other tiles, and each tile kernel reads a weight row once for all its activation rows.
// The tile kernels come from the best ISA level present (internal::*::GetTileKernels), with the
// scalar ones below as the portable fallback and as the definition of the numerics.
#include "tandem/kernels/matmul.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "common/util/thread_pool.h"
#include "internal.h"
#include "tandem/kernels/cpu_features.h"
#include "tandem/kernels/fp16.h"
#include "tandem/kernels/quant.h"

namespace tandem::kernels {
namespace {

using internal::ActRow;
using internal::BlockMxfp4;
using internal::BlockQ4_0;
using internal::BlockQ4K;
using internal::BlockQ6K;
using internal::BlockQ8_0;
using internal::BlockQ8K;
using internal::kMaxTile;
using internal::kMxfp4Values;
using internal::kPackQ4_0ValueBytes;
using internal::kPackQ8_0ValueBytes;
using internal::kPackRows;
using internal::kPackTile;
using internal::kQKK;
using internal::PackedFn;
using internal::TileFn;
using internal::TileKernels;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "tandem::kernels::Matmul: %s\n", what);
  std::abort();
}

float E8m0Half(uint8_t e) {
  const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- Activation conversion -------------------------------------------------------------------

// llama.cpp's x86 quantize_row_q8_0: scale amax/127 stored as fp16, values x * (127/amax)
// rounded to nearest even.
void QuantizeQ8_0Block(const float* x, int8_t* q, uint16_t* d16) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  *d16 = F32ToFp16(amax / 127.0f);
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  for (int j = 0; j < 32; ++j) {
    // Adding 1.5 * 2^23 rounds to an integer, ties to even, for |v| < 2^22.
    const float biased = x[j] * id + 12582912.0f;
    int32_t bits;
    std::memcpy(&bits, &biased, 4);
    const int v = (bits & 0x007fffff) - 0x00400000;
    q[j] = static_cast<int8_t>(std::clamp(v, -128, 127));
  }
}

struct ActLayout {
  size_t values = 0;  // bytes of each plane for one row, each rounded up to 64
  size_t scales = 0;
  size_t bsums = 0;
  size_t Total() const { return values + scales + bsums; }
};

size_t RoundUp64(size_t n) { return (n + 63) & ~size_t{63}; }

ActLayout LayoutFor(DType vt, int64_t n) {
  ActLayout l;
  switch (vt) {
    case DType::kF32:
    case DType::kF16:
      l.values = RoundUp64(n * sizeof(float));
      break;
    case DType::kBF16:
      l.values = RoundUp64(n * sizeof(uint16_t));
      break;
    case DType::kQ8_0:
      l.values = RoundUp64(n);
      l.scales = RoundUp64(n / 32 * sizeof(float));
      break;
    case DType::kQ8_K:
      l.values = RoundUp64(n);
      l.scales = RoundUp64(n / kQKK * sizeof(float));
      l.bsums = RoundUp64(n / 16 * sizeof(int16_t));
      break;
    default:
      Fail("no activation layout for this type");
  }
  return l;
}

// internal::kGemmTile's layout of Q8_0 activations: per two blocks, a+128 as uint8 and every
// block scale once per int32 lane (8 per block).
ActLayout GemmLayout(int64_t n) {
  ActLayout l;
  l.values = RoundUp64((n / 32 + 1) / 2 * 128);
  return l;
}

void ConvertActivationGemm(const float* x, int64_t n, uint8_t* dst, ActRow* row) {
  row->values = dst;
  row->scales = nullptr;
  row->bsums = nullptr;
  int8_t q[32];
  const int64_t nblk = n / 32;
  for (int64_t b = 0; b < nblk; ++b) {
    uint8_t* group = dst + 128 * (b / 2);
    uint8_t* v = group + 32 * (b % 2);
    auto* s = reinterpret_cast<float*>(group + 64) + 8 * (b % 2);
    uint16_t d16;
    QuantizeQ8_0Block(x + 32 * b, q, &d16);
    for (int j = 0; j < 32; ++j) v[j] = static_cast<uint8_t>(q[j] + 128);
    const float d = Fp16ToF32(d16);
    for (int j = 0; j < 8; ++j) s[j] = d;
  }
  if (nblk % 2 == 1) {
    // The last group's second half has no block: zero weights meet it in the kernel, and its
    // scales must be finite (zero), not stale bytes.
    uint8_t* group = dst + 128 * (nblk / 2);
    std::memset(group + 32, 128, 32);
    std::fill_n(reinterpret_cast<float*>(group + 64) + 8, 8, 0.0f);
  }
}

void ConvertActivation(DType vt, const float* x, int64_t n, uint8_t* dst, const ActLayout& l,
                       ActRow* row) {
  row->values = dst;
  row->scales = l.scales ? reinterpret_cast<const float*>(dst + l.values) : nullptr;
  row->bsums = l.bsums ? reinterpret_cast<const int16_t*>(dst + l.values + l.scales) : nullptr;
  switch (vt) {
    case DType::kF32:
      row->values = x;  // already in the vec-dot format: read in place
      return;
    case DType::kF16: {
      // Round through fp16 but keep floats: the products are then those of ggml's fp16 dot.
      auto* v = reinterpret_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) v[i] = Fp16ToF32(F32ToFp16(x[i]));
      return;
    }
    case DType::kBF16: {
      auto* v = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) v[i] = F32ToBf16(x[i]);
      return;
    }
    case DType::kQ8_0: {
      auto* q = reinterpret_cast<int8_t*>(dst);
      auto* s = reinterpret_cast<float*>(dst + l.values);
#if TANDEM_KERNELS_X86
      if (ActiveIsa() >= Isa::kAvx512) {
        internal::avx512::QuantizeQ8_0Blocks(x, n / 32, q, s, nullptr, 0);
        return;
      }
#endif
      for (int64_t b = 0; b < n / 32; ++b) {
        uint16_t d16;
        QuantizeQ8_0Block(x + 32 * b, q + 32 * b, &d16);
        s[b] = Fp16ToF32(d16);
      }
      return;
    }
    case DType::kQ8_K: {
      auto* q = reinterpret_cast<int8_t*>(dst);
      auto* s = reinterpret_cast<float*>(dst + l.values);
      auto* bs = reinterpret_cast<int16_t*>(dst + l.values + l.scales);
      for (int64_t b = 0; b < n / kQKK; ++b) {
        BlockQ8K blk;
        (void)QuantizeRow(DType::kQ8_K, x + kQKK * b, &blk, kQKK);
        std::memcpy(q + kQKK * b, blk.qs, kQKK);
        s[b] = blk.d;
        std::memcpy(bs + 16 * b, blk.bsums, sizeof(blk.bsums));
      }
      return;
    }
    default:
      Fail("no activation conversion for this type");
  }
}

// ---- Scalar dot products (the reference numerics of the SIMD kernels) ---------------------------

float DotF32(const float* w, const float* a, int64_t n) {
  float part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) part[k] += w[i + k] * a[i + k];
  }
  float sum = 0;
  for (; i < n; ++i) sum += w[i] * a[i];
  for (int k = 0; k < 8; ++k) sum += part[k];
  return sum;
}

float DotF16(const uint16_t* w, const float* a, int64_t n) {
  float part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) part[k] += Fp16ToF32(w[i + k]) * a[i + k];
  }
  float sum = 0;
  for (; i < n; ++i) sum += Fp16ToF32(w[i]) * a[i];
  for (int k = 0; k < 8; ++k) sum += part[k];
  return sum;
}

float DotBf16(const uint16_t* w, const uint16_t* a, int64_t n) {
  float part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) part[k] += Bf16ToF32(w[i + k]) * Bf16ToF32(a[i + k]);
  }
  float sum = 0;
  for (; i < n; ++i) sum += Bf16ToF32(w[i]) * Bf16ToF32(a[i]);
  for (int k = 0; k < 8; ++k) sum += part[k];
  return sum;
}

float DotQ8_0(const BlockQ8_0* x, const ActRow& a, int64_t n) {
  const auto* q = static_cast<const int8_t*>(a.values);
  float sum = 0;
  for (int64_t b = 0; b < n / 32; ++b, q += 32) {
    int isum = 0;
    for (int j = 0; j < 32; ++j) isum += x[b].qs[j] * q[j];
    sum += (Fp16ToF32(x[b].d) * a.scales[b]) * static_cast<float>(isum);
  }
  return sum;
}

float DotQ4_0(const BlockQ4_0* x, const ActRow& a, int64_t n) {
  const auto* q = static_cast<const int8_t*>(a.values);
  float sum = 0;
  for (int64_t b = 0; b < n / 32; ++b, q += 32) {
    int isum = 0;
    for (int j = 0; j < 16; ++j) {
      isum += ((x[b].qs[j] & 0xf) - 8) * q[j];
      isum += ((x[b].qs[j] >> 4) - 8) * q[j + 16];
    }
    sum += (Fp16ToF32(x[b].d) * a.scales[b]) * static_cast<float>(isum);
  }
  return sum;
}

float DotMxfp4(const BlockMxfp4* x, const ActRow& a, int64_t n) {
  const auto* q = static_cast<const int8_t*>(a.values);
  float sum = 0;
  for (int64_t b = 0; b < n / 32; ++b, q += 32) {
    int isum = 0;
    for (int j = 0; j < 16; ++j) {
      isum += kMxfp4Values[x[b].qs[j] & 0xf] * q[j];
      isum += kMxfp4Values[x[b].qs[j] >> 4] * q[j + 16];
    }
    sum += (E8m0Half(x[b].e) * a.scales[b]) * static_cast<float>(isum);
  }
  return sum;
}

void UnpackQ4KScales(const uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xf) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Q4_K: sum_j d*sc_j * (q . a)_j  -  dmin * sum_j mn_j * (sum of a over sub-block j), the
// integer parts exact per super-block, scaled once in float.
float DotQ4K(const BlockQ4K* x, const ActRow& a, int64_t n) {
  const auto* q8 = static_cast<const int8_t*>(a.values);
  float sum = 0, sum_min = 0;
  for (int64_t b = 0; b < n / kQKK; ++b, q8 += kQKK) {
    int sc[8], mn[8];
    UnpackQ4KScales(x[b].scales, sc, mn);
    int isum = 0, imin = 0;
    for (int g = 0; g < 4; ++g) {
      int lo = 0, hi = 0;
      for (int i = 0; i < 32; ++i) {
        lo += (x[b].qs[32 * g + i] & 0xf) * q8[64 * g + i];
        hi += (x[b].qs[32 * g + i] >> 4) * q8[64 * g + 32 + i];
      }
      isum += sc[2 * g] * lo + sc[2 * g + 1] * hi;
    }
    const int16_t* bs = a.bsums + 16 * b;
    for (int j = 0; j < 8; ++j) imin += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
    sum += Fp16ToF32(x[b].d) * a.scales[b] * static_cast<float>(isum);
    sum_min += Fp16ToF32(x[b].dmin) * a.scales[b] * static_cast<float>(imin);
  }
  return sum - sum_min;
}

float DotQ6K(const BlockQ6K* x, const ActRow& a, int64_t n) {
  const auto* q8 = static_cast<const int8_t*>(a.values);
  float sum = 0;
  for (int64_t b = 0; b < n / kQKK; ++b, q8 += kQKK) {
    int isum = 0;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = x[b].ql + 64 * h;
      const uint8_t* qh = x[b].qh + 32 * h;
      const int8_t* sc = x[b].scales + 8 * h;
      const int8_t* a8 = q8 + 128 * h;
      int part[8] = {};
      for (int l = 0; l < 32; ++l) {
        const int g = l / 16;
        part[g] += (((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32) * a8[l];
        part[g + 2] += (((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32) * a8[l + 32];
        part[g + 4] += (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * a8[l + 64];
        part[g + 6] += (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * a8[l + 96];
      }
      for (int g = 0; g < 8; ++g) isum += sc[g] * part[g];
    }
    sum += Fp16ToF32(x[b].d) * a.scales[b] * static_cast<float>(isum);
  }
  return sum;
}

template <typename DotFn>
void ScalarTile(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int nb, float* out,
                int64_t os, DotFn dot) {
  for (int64_t r = 0; r < nrows; ++r) {
    for (int b = 0; b < nb; ++b) out[b * os + r] = dot(w + r * ws, act[b]);
  }
}

#define TANDEM_SCALAR_TILE(NAME, EXPR)                                                           \
  void NAME(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int nb, int64_t cols, \
            float* out, int64_t os) {                                                            \
    ScalarTile(w, ws, nrows, act, nb, out, os,                                                   \
               [cols](const uint8_t* row, const ActRow& a) { return EXPR; });                    \
  }

TANDEM_SCALAR_TILE(TileF32, DotF32(reinterpret_cast<const float*>(row),
                                   static_cast<const float*>(a.values), cols))
TANDEM_SCALAR_TILE(TileF16, DotF16(reinterpret_cast<const uint16_t*>(row),
                                   static_cast<const float*>(a.values), cols))
TANDEM_SCALAR_TILE(TileBf16, DotBf16(reinterpret_cast<const uint16_t*>(row),
                                     static_cast<const uint16_t*>(a.values), cols))
TANDEM_SCALAR_TILE(TileQ8_0, DotQ8_0(reinterpret_cast<const BlockQ8_0*>(row), a, cols))
TANDEM_SCALAR_TILE(TileQ4_0, DotQ4_0(reinterpret_cast<const BlockQ4_0*>(row), a, cols))
TANDEM_SCALAR_TILE(TileMxfp4, DotMxfp4(reinterpret_cast<const BlockMxfp4*>(row), a, cols))
TANDEM_SCALAR_TILE(TileQ4K, DotQ4K(reinterpret_cast<const BlockQ4K*>(row), a, cols))
TANDEM_SCALAR_TILE(TileQ6K, DotQ6K(reinterpret_cast<const BlockQ6K*>(row), a, cols))
#undef TANDEM_SCALAR_TILE

// ---- Packed weights (internal.h describes the layout) -----------------------------------------

struct PackGeometry {
  int64_t nblk = 0;         // 32-value blocks per row
  int64_t value_bytes = 0;  // per block of a group
  int64_t group_bytes = 0;  // values, scales and padding of 16 rows
};

PackGeometry GeometryOf(DType t, int64_t cols) {
  PackGeometry g;
  g.nblk = cols / 32;
  g.value_bytes = t == DType::kQ8_0 ? kPackQ8_0ValueBytes : kPackQ4_0ValueBytes;  // Q4_0, MXFP4
  g.group_bytes = (g.nblk + 1) / 2 * internal::PackedPairBytes(g.value_bytes);
  return g;
}

// Value j (0..31) of row m in block b of a packed group of type t, without its offset (MXFP4:
// the doubled E2M1 value of its code).
int PackedValue(DType t, const uint8_t* block, int m, int j) {
  if (t == DType::kQ8_0) return static_cast<int>(block[64 * (j / 4) + 4 * m + j % 4]) - 128;
  const uint8_t byte = block[64 * ((j % 16) / 4) + 4 * m + j % 4];
  const int nibble = j < 16 ? byte & 0xf : byte >> 4;
  return t == DType::kMXFP4 ? internal::kMxfp4Values[nibble] : nibble - 8;
}

// Row m's scale of block i: fp16 (Q8_0, Q4_0), or E8M0 as 2^(e-128) (MXFP4, values doubled).
float PackedScale(DType t, const uint8_t* group, int64_t value_bytes, int64_t i, int m) {
  const uint8_t* scales = group + internal::PackedScalesAt(value_bytes, i);
  if (t == DType::kMXFP4) return std::ldexp(1.0f, static_cast<int>(scales[m]) - 128);
  uint16_t h;
  std::memcpy(&h, scales + 2 * m, 2);
  return Fp16ToF32(h);
}

// The definition of the packed kernels' numerics (the SIMD kernel gives the same bits): per
// row, acc = fma(integer dot, weight scale * activation scale, acc) block after block.
template <DType kType>
void PackedScalar(const uint8_t* group, int64_t nblk, const ActRow* act, int nb, float* out,
                  int64_t os, int valid_rows) {
  const int64_t vb = kType == DType::kQ8_0 ? kPackQ8_0ValueBytes : kPackQ4_0ValueBytes;
  for (int b = 0; b < nb; ++b) {
    const auto* a = static_cast<const int8_t*>(act[b].values);
    for (int m = 0; m < valid_rows; ++m) {
      float acc = 0.0f;
      for (int64_t i = 0; i < nblk; ++i) {
        int isum = 0;
        const uint8_t* block = group + internal::PackedValuesAt(vb, i);
        for (int j = 0; j < 32; ++j) isum += PackedValue(kType, block, m, j) * a[32 * i + j];
        const float scale = PackedScale(kType, group, vb, i, m) * act[b].scales[i];
        acc = std::fma(static_cast<float>(isum), scale, acc);
      }
      out[b * os + m] = acc;
    }
  }
}

// Packed activations: int8 values and float scales as for Q8_0, plus each block's offset term.
ActLayout PackedLayout(int64_t n) {
  ActLayout l;
  l.values = RoundUp64(n);
  l.scales = RoundUp64(n / 32 * sizeof(float));
  l.bsums = RoundUp64(n / 32 * sizeof(int32_t));  // the offsets plane
  return l;
}

void ConvertActivationPacked(DType weight_type, const float* x, int64_t n, uint8_t* dst,
                             const ActLayout& l, ActRow* row) {
  // The unsigned offset the packed values carry: Q8_0 +128, Q4_0 +8, MXFP4 +12 (its doubled
  // E2M1 values run from -12 to 12).
  const int32_t weight_offset =
      weight_type == DType::kQ8_0 ? 128 : weight_type == DType::kMXFP4 ? 12 : 8;
  auto* q = reinterpret_cast<int8_t*>(dst);
  auto* s = reinterpret_cast<float*>(dst + l.values);
  auto* o = reinterpret_cast<int32_t*>(dst + l.values + l.scales);
  row->values = q;
  row->scales = s;
  row->bsums = nullptr;
  row->offsets = o;
#if TANDEM_KERNELS_X86
  if (ActiveIsa() >= Isa::kAvx512) {
    internal::avx512::QuantizeQ8_0Blocks(x, n / 32, q, s, o, weight_offset);
    return;
  }
#endif
  for (int64_t b = 0; b < n / 32; ++b) {
    uint16_t d16;
    QuantizeQ8_0Block(x + 32 * b, q + 32 * b, &d16);
    s[b] = Fp16ToF32(d16);
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) sum += q[32 * b + j];
    o[b] = -weight_offset * sum;
  }
}

// ---- Dispatch ----------------------------------------------------------------------------------

TileFn Pick(const TileKernels& k, DType t) {
  switch (t) {
    case DType::kF32:
      return k.f32;
    case DType::kF16:
      return k.f16;
    case DType::kBF16:
      return k.bf16;
    case DType::kQ8_0:
      return k.q8_0;
    case DType::kQ4_0:
      return k.q4_0;
    case DType::kMXFP4:
      return k.mxfp4;
    case DType::kQ4_K:
      return k.q4_k;
    case DType::kQ6_K:
      return k.q6_k;
    default:
      return nullptr;
  }
}

TileFn SelectTile(DType t) {
  static const TileKernels scalar = internal::ScalarTileKernels();
#if TANDEM_KERNELS_X86
  static const TileKernels avx2 =
      DetectedIsa() >= Isa::kAvx2 ? internal::avx2::GetTileKernels() : TileKernels{};
  static const TileKernels avx512 =
      DetectedIsa() >= Isa::kAvx512 ? internal::avx512::GetTileKernels(false) : TileKernels{};
  static const TileKernels avx512bf16 =
      DetectedIsa() >= Isa::kAvx512Bf16 ? internal::avx512::GetTileKernels(true) : TileKernels{};
#else
  static const TileKernels avx2, avx512, avx512bf16;  // no SIMD kernels off x86
#endif
  const Isa isa = ActiveIsa();
  TileFn fn = nullptr;
  if (isa >= Isa::kAvx512Bf16) fn = Pick(avx512bf16, t);
  if (!fn && isa >= Isa::kAvx512) fn = Pick(avx512, t);
  if (!fn && isa >= Isa::kAvx2) fn = Pick(avx2, t);
  if (!fn) fn = Pick(scalar, t);
  if (!fn) Fail("weight type not supported");
  return fn;
}

// The GEMM tile for big batches, where the CPU has one for this weight type.
// Below this batch the small-batch tiles win: decode is bound by reading the weights, and the
// GEMM layout's conversion and wider tiles buy nothing there (measured at batch 1).
constexpr int64_t kGemmMinBatch = 8;

TileFn SelectGemm(DType t) {
#if TANDEM_KERNELS_X86
  if (ActiveIsa() < Isa::kAvx512) return nullptr;
  static const TileFn q8_0 = internal::avx512::GetGemmKernel(DType::kQ8_0);
  static const TileFn q4_0 = internal::avx512::GetGemmKernel(DType::kQ4_0);
  static const TileFn mxfp4 = internal::avx512::GetGemmKernel(DType::kMXFP4);
  static const TileFn f32 = internal::avx512::GetGemmKernel(DType::kF32);
  static const TileFn f16 = internal::avx512::GetGemmKernel(DType::kF16);
  switch (t) {
    case DType::kF32:
      return f32;
    case DType::kF16:
      return f16;
    case DType::kQ8_0:
      return q8_0;
    case DType::kQ4_0:
      return q4_0;
    case DType::kMXFP4:
      return mxfp4;
    default:
      return nullptr;
  }
#else
  (void)t;
  return nullptr;
#endif
}

bool HasPackedKernel(DType t) {
#if TANDEM_KERNELS_X86
  return (t == DType::kQ8_0 || t == DType::kQ4_0 || t == DType::kMXFP4) &&
         ActiveIsa() >= Isa::kAvx512;
#else
  (void)t;
  return false;
#endif
}

// The packed kernel of the active ISA; the scalar one when weights packed earlier meet a lower
// ISA cap (tests).
PackedFn SelectPacked(DType t) {
  if (t != DType::kQ8_0 && t != DType::kQ4_0 && t != DType::kMXFP4) {
    Fail("packed weights of an unpackable type");
  }
#if TANDEM_KERNELS_X86
  if (ActiveIsa() >= Isa::kAvx512) {
    static const PackedFn q8_0 = internal::avx512::GetPackedKernel(DType::kQ8_0);
    static const PackedFn q4_0 = internal::avx512::GetPackedKernel(DType::kQ4_0);
    static const PackedFn mxfp4 = internal::avx512::GetPackedKernel(DType::kMXFP4);
    return t == DType::kQ8_0 ? q8_0 : t == DType::kQ4_0 ? q4_0 : mxfp4;
  }
#endif
  return t == DType::kQ8_0   ? PackedScalar<DType::kQ8_0>
         : t == DType::kQ4_0 ? PackedScalar<DType::kQ4_0>
                             : PackedScalar<DType::kMXFP4>;
}

// Converted activations of one call. Lives on the calling thread and is reused between calls,
// so steady-state decode allocates nothing.
struct ActScratch {
  std::vector<uint8_t> bytes;
  std::vector<ActRow> rows;
};

ActScratch& Scratch() {
  thread_local ActScratch s;
  return s;
}

// Weight rows per block: with kMaxTile activation rows per tile, a block is re-read from L2 for
// each further tile of a big batch instead of from memory.
constexpr int64_t kRowBlock = 16;

void CheckParams(const MatmulParams& p) {
  if (p.weight == nullptr || p.input == nullptr || p.output == nullptr) Fail("null buffer");
  if (p.rows < 0 || p.cols <= 0 || p.batch < 0) Fail("bad shape");
  if (p.cols % Traits(p.weight_type).block_elems != 0)
    Fail("cols is not a multiple of the block size");
  if (p.input_stride != 0 && p.input_stride < p.cols) Fail("input_stride < cols");
  if (p.output_stride != 0 && p.output_stride < p.rows) Fail("output_stride < rows");
}

}  // namespace

namespace internal {

TileKernels ScalarTileKernels() {
  TileKernels k;
  k.f32 = TileF32;
  k.f16 = TileF16;
  k.bf16 = TileBf16;
  k.q8_0 = TileQ8_0;
  k.q4_0 = TileQ4_0;
  k.mxfp4 = TileMxfp4;
  k.q4_k = TileQ4K;
  k.q6_k = TileQ6K;
  return k;
}

}  // namespace internal

DType VecDotType(DType weight_type) {
  switch (weight_type) {
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kMXFP4:
      return DType::kQ8_0;
    case DType::kQ4_K:
    case DType::kQ6_K:
      return DType::kQ8_K;
    case DType::kF16:
      return DType::kF16;
    case DType::kBF16:
      return DType::kBF16;
    default:
      return DType::kF32;
  }
}

void QuantizeActivationRow(DType vec_dot_type, const float* x, void* dst, int64_t n) {
  if (vec_dot_type == DType::kQ8_0) {
    auto* blocks = static_cast<BlockQ8_0*>(dst);
#if TANDEM_KERNELS_X86
    if (ActiveIsa() >= Isa::kAvx512) {
      for (int64_t b = 0; b < n / 32; ++b) {
        float scale;
        internal::avx512::QuantizeQ8_0Blocks(x + 32 * b, 1, blocks[b].qs, &scale, nullptr, 0);
        blocks[b].d = F32ToFp16(scale);  // exact: scale is an fp16 value
      }
      return;
    }
#endif
    for (int64_t b = 0; b < n / 32; ++b) QuantizeQ8_0Block(x + 32 * b, blocks[b].qs, &blocks[b].d);
    return;
  }
  (void)QuantizeRow(vec_dot_type, x, dst, n);
}

namespace {

// Converts the batch's activation rows into the calling thread's scratch, `layout` bytes per
// row (convert(b, dst, row) fills one), and returns the row views.
template <typename ConvertFn>
const ActRow* ConvertActivations(int64_t batch, int64_t cols, const ActLayout& layout,
                                 util::ThreadPool* pool, ConvertFn convert_row) {
  // Rows a power of two apart (2048 columns make 8 KiB) would all map to the same L1 sets and
  // evict each other within one tile; one extra cache line of stride spreads them.
  const size_t row_bytes = layout.Total() + (layout.Total() % 1024 == 0 ? 64 : 0);
  ActScratch& scratch = Scratch();
  if (scratch.bytes.size() < row_bytes * batch + 64) scratch.bytes.resize(row_bytes * batch + 64);
  scratch.rows.assign(batch, ActRow{});
  uint8_t* base = scratch.bytes.data();
  base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  auto convert = [&](int64_t b0, int64_t b1, int) {
    for (int64_t b = b0; b < b1; ++b) convert_row(b, base + b * row_bytes, &scratch.rows[b]);
  };
  if (pool != nullptr && batch > 1 && batch * cols >= (1 << 16)) {
    pool->ParallelFor(batch, convert);
  } else {
    convert(0, batch, 0);
  }
  return scratch.rows.data();
}

// Shares `units` units of work out over the pool from a shared counter rather than in fixed
// halves: on a shared machine one thread is often descheduled, and the others then finish its
// part instead of waiting for it. Pieces are guided: each takes 1/(kGuide * threads) of what is
// left, in whole multiples of `chunk` and at least one, so a matmul costs a few dozen trips to
// the shared counter rather than one per chunk (thousands per decoded token, 2% of its time),
// each thread streams long runs of contiguous weights, and the small pieces at the end still
// even out the finish.
constexpr int64_t kGuide = 8;

template <typename RunFn>
void ShareOut(int64_t units, int64_t chunk, util::ThreadPool* pool, RunFn run) {
  const int64_t n_chunks = (units + chunk - 1) / chunk;
  if (pool != nullptr && pool->num_threads() > 1 && n_chunks > 1) {
    const int64_t split = kGuide * pool->num_threads();
    std::atomic<int64_t> next{0};
    pool->RunOnAll([&](int) {
      int64_t begin = next.load(std::memory_order_relaxed);
      while (begin < units) {
        const int64_t take = std::max<int64_t>(1, (units - begin) / split / chunk) * chunk;
        const int64_t end = std::min(units, begin + take);
        // On failure begin is reloaded with the current counter.
        if (next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) {
          run(begin, end);
          begin = next.load(std::memory_order_relaxed);
        }
      }
    });
  } else {
    run(0, units);
  }
}

// MatmulMulti over packed weights. Work is shared out in groups of kPackRows rows. Small
// batches take each group once for all activation tiles (it stays in L1); big batches walk a
// block of groups that fits L2 for each activation tile, so the activations are read from L1
// and each group from L2.
void RunMatmulPacked(DType weight_type, int64_t cols, const float* input, int64_t in_stride,
                     int64_t batch, std::span<const MatmulTarget> targets,
                     util::ThreadPool* pool) {
  const PackGeometry geo = GeometryOf(weight_type, cols);
  const PackedFn kernel = SelectPacked(weight_type);
  const ActLayout layout = PackedLayout(cols);
  const ActRow* act = ConvertActivations(
      batch, cols, layout, pool, [&](int64_t b, uint8_t* dst, ActRow* row) {
        ConvertActivationPacked(weight_type, input + b * in_stride, cols, dst, layout, row);
      });
  int64_t total_groups = 0;
  for (const MatmulTarget& t : targets) total_groups += (t.rows + kPackRows - 1) / kPackRows;
  const int64_t groups_per_block =
      batch > kPackTile ? std::max<int64_t>(1, (int64_t{256} << 10) / geo.group_bytes) : 1;
  auto run_groups = [&](int64_t g0, int64_t g1) {
    int64_t first = 0;
    for (const MatmulTarget& t : targets) {
      const int64_t n_groups = (t.rows + kPackRows - 1) / kPackRows;
      const int64_t lo = std::max(g0, first) - first;
      const int64_t hi = std::min(g1, first + n_groups) - first;
      first += n_groups;
      const auto* w = static_cast<const uint8_t*>(t.weight);
      const int64_t os = t.output_stride ? t.output_stride : t.rows;
      if (batch <= 2 && lo < hi) {
        // The kernel prefetches kPackPrefetchBytes ahead of itself; a piece starting cold asks
        // for its own first bytes here instead of waiting for each line in turn.
        const uint8_t* start = w + lo * geo.group_bytes;
        const int64_t n = std::min<int64_t>(internal::kPackPrefetchBytes, (hi - lo) * geo.group_bytes);
        for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(start + off, 0, 2);
      }
      for (int64_t gb = lo; gb < hi; gb += groups_per_block) {
        const int64_t ge = std::min(hi, gb + groups_per_block);
        for (int64_t b0 = 0; b0 < batch; b0 += kPackTile) {
          const int nb = static_cast<int>(std::min<int64_t>(kPackTile, batch - b0));
          for (int64_t g = gb; g < ge; ++g) {
            const int valid = static_cast<int>(std::min<int64_t>(kPackRows, t.rows - g * kPackRows));
            kernel(w + g * geo.group_bytes, geo.nblk, act + b0, nb,
                   t.output + b0 * os + g * kPackRows, os, valid);
          }
        }
      }
    }
  };
  // A chunk is 4 groups (64 rows) for small batches, a block of groups for big ones.
  ShareOut(total_groups, batch > kPackTile ? groups_per_block : 4, pool, run_groups);
}

// Matmul and MatmulMulti: the targets share weight type, column count and input.
void RunMatmul(DType weight_type, int64_t cols, const float* input, int64_t in_stride,
               int64_t batch, std::span<const MatmulTarget> targets, util::ThreadPool* pool) {
  int64_t total_rows = 0;
  for (const MatmulTarget& t : targets) total_rows += t.rows;
  if (total_rows == 0 || batch == 0) return;
  const DType vt = VecDotType(weight_type);
  const TileFn gemm = batch >= kGemmMinBatch ? SelectGemm(weight_type) : nullptr;
  const TileFn tile = gemm ? gemm : SelectTile(weight_type);
  // The quantised GEMM tiles read internal::kGemmTile's activation layout; the float ones the
  // ordinary float rows.
  const bool float_gemm = gemm && (weight_type == DType::kF32 || weight_type == DType::kF16);
  const bool block_gemm = gemm && !float_gemm;
  const int64_t max_tile =
      float_gemm ? internal::kFloatGemmTile : (gemm ? internal::kGemmTile : kMaxTile);

  const ActLayout layout = block_gemm ? GemmLayout(cols) : LayoutFor(vt, cols);
  const ActRow* act = ConvertActivations(
      batch, cols, layout, pool, [&](int64_t b, uint8_t* dst, ActRow* row) {
        if (block_gemm) {
          ConvertActivationGemm(input + b * in_stride, cols, dst, row);
        } else {
          ConvertActivation(vt, input + b * in_stride, cols, dst, layout, row);
        }
      });

  const size_t w_stride = RowBytes(weight_type, cols);
  // A GEMM row block is sized to stay in L2 (about 256 KiB) while every activation tile passes
  // over it; the small-batch tiles keep kRowBlock rows, which stay in L1.
  const int64_t row_block =
      gemm ? std::clamp<int64_t>((int64_t{256} << 10) / static_cast<int64_t>(w_stride), 16, 1024) /
                 16 * 16
           : kRowBlock;
  // Rows [r0, r1) of the targets laid end to end.
  auto run_rows = [&](int64_t r0, int64_t r1, int) {
    int64_t first = 0;
    for (const MatmulTarget& t : targets) {
      const int64_t lo = std::max(r0, first) - first;
      const int64_t hi = std::min(r1, first + t.rows) - first;
      first += t.rows;
      if (lo >= hi) continue;
      const auto* w = static_cast<const uint8_t*>(t.weight);
      const int64_t out_stride = t.output_stride ? t.output_stride : t.rows;
      for (int64_t rb = lo; rb < hi; rb += row_block) {
        const int64_t nr = std::min(row_block, hi - rb);
        for (int64_t b0 = 0; b0 < batch; b0 += max_tile) {
          const int nb = static_cast<int>(std::min<int64_t>(max_tile, batch - b0));
          tile(w + rb * w_stride, w_stride, nr, act + b0, nb, cols,
               t.output + b0 * out_stride + rb, out_stride);
        }
      }
    }
  };
  // A chunk is a GEMM row block, or 64 rows (about 128 KiB of Q8_0 weights at 2048 columns) for
  // the small-batch tiles.
  ShareOut(total_rows, gemm ? row_block : 4 * kRowBlock, pool,
           [&](int64_t r0, int64_t r1) { run_rows(r0, r1, 0); });
}

}  // namespace

void Matmul(const MatmulParams& p, util::ThreadPool* pool) {
  CheckParams(p);
  const MatmulTarget t{p.weight, p.rows, p.output, p.output_stride};
  const int64_t in_stride = p.input_stride ? p.input_stride : p.cols;
  if (p.packed) {
    if (p.rows > 0 && p.batch > 0) {
      RunMatmulPacked(p.weight_type, p.cols, p.input, in_stride, p.batch,
                      std::span<const MatmulTarget>(&t, 1), pool);
    }
    return;
  }
  RunMatmul(p.weight_type, p.cols, p.input, in_stride, p.batch,
            std::span<const MatmulTarget>(&t, 1), pool);
}

void MatmulMulti(DType weight_type, int64_t cols, const float* input, int64_t input_stride,
                 int64_t batch, std::span<const MatmulTarget> targets, util::ThreadPool* pool,
                 bool packed) {
  for (const MatmulTarget& t : targets) {
    MatmulParams p;
    p.weight_type = weight_type;
    p.weight = t.weight;
    p.rows = t.rows;
    p.cols = cols;
    p.input = input;
    p.input_stride = input_stride;
    p.batch = batch;
    p.output = t.output;
    p.output_stride = t.output_stride;
    CheckParams(p);
  }
  const int64_t in_stride = input_stride ? input_stride : cols;
  if (packed) {
    if (batch > 0 && !targets.empty()) {
      RunMatmulPacked(weight_type, cols, input, in_stride, batch, targets, pool);
    }
    return;
  }
  RunMatmul(weight_type, cols, input, in_stride, batch, targets, pool);
}

size_t PackedWeightBytes(DType weight_type, int64_t rows, int64_t cols) {
  if (!HasPackedKernel(weight_type) || rows <= 0 || cols <= 0 || cols % 32 != 0) return 0;
  const int64_t groups = (rows + kPackRows - 1) / kPackRows;
  return static_cast<size_t>(groups * GeometryOf(weight_type, cols).group_bytes);
}

void GetPackedRow(DType weight_type, const void* packed, int64_t cols, int64_t r, float* out) {
  if (weight_type != DType::kQ8_0 && weight_type != DType::kQ4_0 && weight_type != DType::kMXFP4) {
    Fail("unpackable type");
  }
  const PackGeometry geo = GeometryOf(weight_type, cols);
  const auto* group = static_cast<const uint8_t*>(packed) + (r / kPackRows) * geo.group_bytes;
  const int m = static_cast<int>(r % kPackRows);
  for (int64_t i = 0; i < geo.nblk; ++i) {
    const float d = PackedScale(weight_type, group, geo.value_bytes, i, m);
    const uint8_t* block = group + internal::PackedValuesAt(geo.value_bytes, i);
    for (int j = 0; j < 32; ++j) {
      out[32 * i + j] = d * static_cast<float>(PackedValue(weight_type, block, m, j));
    }
  }
}

void PackWeights(DType weight_type, const void* src, int64_t rows, int64_t cols, void* dst) {
  if (weight_type != DType::kQ8_0 && weight_type != DType::kQ4_0 && weight_type != DType::kMXFP4) {
    Fail("unpackable type");
  }
  if (src == nullptr || dst == nullptr || rows <= 0 || cols <= 0 || cols % 32 != 0)
    Fail("bad packing shape");
  if (reinterpret_cast<uintptr_t>(dst) % 64 != 0) Fail("packed weights must be 64-byte aligned");
  const PackGeometry geo = GeometryOf(weight_type, cols);
  const size_t row_bytes = RowBytes(weight_type, cols);
  const bool q4 = weight_type == DType::kQ4_0;
  const int64_t groups = (rows + kPackRows - 1) / kPackRows;
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* group = static_cast<uint8_t*>(dst) + g * geo.group_bytes;
    std::memset(group, 0, geo.group_bytes);
    for (int m = 0; m < kPackRows && g * kPackRows + m < rows; ++m) {
      const uint8_t* row = static_cast<const uint8_t*>(src) + (g * kPackRows + m) * row_bytes;
      // Four bytes at a time: chunk c of a block takes bytes 4c..4c+3 of each row's values.
      for (int64_t i = 0; i < geo.nblk; ++i) {
        uint8_t* block = group + internal::PackedValuesAt(geo.value_bytes, i) + 4 * m;
        auto* scales = reinterpret_cast<uint16_t*>(group + internal::PackedScalesAt(geo.value_bytes, i));
        if (weight_type == DType::kMXFP4) {
          // The codes as Q4_0's nibbles are laid out; the E8M0 byte in the first half of the
          // scales slot (row m at byte m).
          const auto& x = reinterpret_cast<const BlockMxfp4*>(row)[i];
          reinterpret_cast<uint8_t*>(scales)[m] = x.e;
          for (int c = 0; c < 4; ++c) std::memcpy(block + 64 * c, x.qs + 4 * c, 4);
        } else if (q4) {
          const auto& x = reinterpret_cast<const BlockQ4_0*>(row)[i];
          scales[m] = x.d;
          for (int c = 0; c < 4; ++c) std::memcpy(block + 64 * c, x.qs + 4 * c, 4);
        } else {
          const auto& x = reinterpret_cast<const BlockQ8_0*>(row)[i];
          scales[m] = x.d;
          for (int c = 0; c < 8; ++c) {
            uint32_t v;
            std::memcpy(&v, x.qs + 4 * c, 4);
            v ^= 0x80808080u;  // int8 + 128 as uint8, in each byte
            std::memcpy(block + 64 * c, &v, 4);
          }
        }
      }
    }
  }
}

void MatmulReference(const MatmulParams& p) {
  CheckParams(p);
  const int64_t in_stride = p.input_stride ? p.input_stride : p.cols;
  const int64_t out_stride = p.output_stride ? p.output_stride : p.rows;
  const auto* w = static_cast<const uint8_t*>(p.weight);
  const size_t w_stride = RowBytes(p.weight_type, p.cols);
  std::vector<float> row(p.cols);
  for (int64_t r = 0; r < p.rows; ++r) {
    DequantizeRow(p.weight_type, w + r * w_stride, row.data(), p.cols);
    for (int64_t b = 0; b < p.batch; ++b) {
      const float* x = p.input + b * in_stride;
      double sum = 0;
      for (int64_t c = 0; c < p.cols; ++c) sum += static_cast<double>(row[c]) * x[c];
      p.output[b * out_stride + r] = static_cast<float>(sum);
    }
  }
}

float DotRow(DType t, const void* row, const float* x, int64_t n) {
  float out;
  MatmulParams p;
  p.weight_type = t;
  p.weight = row;
  p.rows = 1;
  p.cols = n;
  p.input = x;
  p.batch = 1;
  p.output = &out;
  Matmul(p, nullptr);
  return out;
}

void GetRow(DType t, const void* weight, int64_t cols, int64_t r, float* out) {
  DequantizeRow(t, static_cast<const uint8_t*>(weight) + r * RowBytes(t, cols), out, cols);
}

}  // namespace tandem::kernels
