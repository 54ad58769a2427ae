// 256-bit integer and float tile kernels, included by matmul_avx2.cc (TANDEM_TILES_VNNI 0) and
// matmul_avx512.cc (TANDEM_TILES_VNNI 1, where the 8-bit dot products become VPDPBUSD and the
// 16-bit scale multiply-adds VPDPWSSD). Everything is in an anonymous namespace so each
// including translation unit gets its own copy built for its own ISA: never include this from
// baseline code. The numerics match the scalar kernels in matmul.cc: exact integer dot products
// per block, scaled and accumulated in float (only the order of float additions differs).
#pragma once

#include <immintrin.h>

#include <cstring>

#include "internal.h"

#ifndef TANDEM_TILES_VNNI
#error "define TANDEM_TILES_VNNI before including matmul_x86_tiles.h"
#endif

namespace tandem::kernels::internal {
namespace {

inline float Hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float HalfToFloat(uint16_t h) { return _cvtsh_ss(h); }

inline float E8m0HalfScale(uint8_t e) {
  const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// 8 int32 lanes, each the sum of 4 products u8 * s8 (u <= 128, |s| <= 127: no saturation).
inline __m256i DotU8S8(__m256i u, __m256i s) {
#if TANDEM_TILES_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc + pairwise int16 products summed into int32 lanes.
inline __m256i AddMaddI16(__m256i acc, __m256i a, __m256i b) {
#if TANDEM_TILES_VNNI
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

inline const int8_t* I8(const ActRow& a) { return static_cast<const int8_t*>(a.values); }

// ---- 32-element blocks against Q8_0 activations: Q8_0, Q4_0, MXFP4 ----------------------------

struct DecodeQ8_0 {
  using Block = BlockQ8_0;
  static __m256i Values(const Block& b) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
  }
  static float Scale(const Block& b) { return HalfToFloat(b.d); }
};

struct DecodeQ4_0 {
  using Block = BlockQ4_0;
  static __m256i Values(const Block& b) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
    const __m256i nib =
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
    return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
  }
  static float Scale(const Block& b) { return HalfToFloat(b.d); }
};

struct DecodeMxfp4 {
  using Block = BlockMxfp4;
  static __m256i Values(const Block& b) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
    const __m256i nib =
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
    return _mm256_shuffle_epi8(table, nib);
  }
  static float Scale(const Block& b) { return E8m0HalfScale(b.e); }
};

// Signed weights w against signed activations a: |w| . sign(a, w) keeps the first operand
// unsigned, as the u8 x s8 instructions need.
template <typename D, int NB>
void TileBlock32(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                 float* out, int64_t os) {
  using Block = typename D::Block;
  const int64_t nblk = cols / 32;
  // With one or two activation rows, two accumulator sets break the FMA dependency chain.
  constexpr int kU = NB <= 2 ? 2 : 1;
  for (int64_t r = 0; r < nrows; ++r) {
    const Block* x = reinterpret_cast<const Block*>(w + r * ws);
    __m256 acc[kU][NB];
    for (int u = 0; u < kU; ++u)
      for (int b = 0; b < NB; ++b) acc[u][b] = _mm256_setzero_ps();
    int64_t i = 0;
    auto step = [&](int64_t blk, int u) {
      const __m256i q = D::Values(x[blk]);
      const __m256i uq = _mm256_sign_epi8(q, q);
      const float dw = D::Scale(x[blk]);
      for (int b = 0; b < NB; ++b) {
        const __m256i a =
            _mm256_load_si256(reinterpret_cast<const __m256i*>(I8(act[b]) + 32 * blk));
        const __m256 p = _mm256_cvtepi32_ps(DotU8S8(uq, _mm256_sign_epi8(a, q)));
        acc[u][b] = _mm256_fmadd_ps(_mm256_set1_ps(dw * act[b].scales[blk]), p, acc[u][b]);
      }
    };
    for (; i + kU <= nblk; i += kU) {
      for (int u = 0; u < kU; ++u) step(i + u, u);
    }
    for (; i < nblk; ++i) step(i, 0);
    for (int b = 0; b < NB; ++b) {
      __m256 s = acc[0][b];
      if constexpr (kU == 2) s = _mm256_add_ps(s, acc[kU - 1][b]);
      out[b * os + r] = Hsum(s);
    }
  }
}

// ---- Q4_K against Q8_K ---------------------------------------------------------------------

// The 8 six-bit scales (bytes 0-7) and 8 six-bit mins (bytes 8-15) of a Q4_K block, unpacked four
// at a time in 32-bit words: sub-blocks 0-3 sit in the low 6 bits of bytes 0-3 (scales) and
// 4-7 (mins); sub-blocks 4-7 take their low 4 bits from bytes 8-11 and their top 2 bits from the
// spare top bits of bytes 0-3 (scales) and 4-7 (mins).
inline __m128i UnpackQ4KScalesMins(const uint8_t* scales) {
  uint32_t s[3];
  std::memcpy(s, scales, 12);
  const uint32_t sc_lo = s[0] & 0x3f3f3f3f;
  const uint32_t sc_hi = (s[2] & 0x0f0f0f0f) | (((s[0] >> 6) & 0x03030303) << 4);
  const uint32_t mn_lo = s[1] & 0x3f3f3f3f;
  const uint32_t mn_hi = ((s[2] >> 4) & 0x0f0f0f0f) | (((s[1] >> 6) & 0x03030303) << 4);
  return _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), static_cast<int>(mn_lo),
                        static_cast<int>(mn_hi));
}

// Each min twice, as 16 words, to pair with the 16 activation sums of 16 values.
inline __m256i Q4KMinsPerSixteen(__m128i scales_mins) {
  const __m128i dup = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(scales_mins, dup));
}

template <int NB>
void TileQ4KImpl(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                 float* out, int64_t os) {
  const int64_t nblk = cols / kQKK;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  for (int64_t r = 0; r < nrows; ++r) {
    const BlockQ4K* x = reinterpret_cast<const BlockQ4K*>(w + r * ws);
    __m256 acc[NB], acc_min[NB];
    for (int b = 0; b < NB; ++b) acc[b] = acc_min[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nblk; ++i) {
      const __m128i sm = UnpackQ4KScalesMins(x[i].scales);
      const __m256i mins = Q4KMinsPerSixteen(sm);
      const __m256i sc_words = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
      __m256i isum[NB];
      for (int b = 0; b < NB; ++b) isum[b] = _mm256_setzero_si256();
      for (int g = 0; g < 4; ++g) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs + 32 * g));
        const __m256i lo = _mm256_and_si256(raw, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        // Broadcast word 2g (resp. 2g+1) of the scales over the whole register.
        const __m256i s0 = _mm256_shuffle_epi8(
            sc_words, _mm256_set1_epi16(static_cast<int16_t>(0x0100 * (4 * g + 1) + 4 * g)));
        const __m256i s1 = _mm256_shuffle_epi8(
            sc_words, _mm256_set1_epi16(static_cast<int16_t>(0x0100 * (4 * g + 3) + 4 * g + 2)));
        for (int b = 0; b < NB; ++b) {
          const int8_t* a = I8(act[b]) + kQKK * i + 64 * g;
          const __m256i a0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(a));
          const __m256i a1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(a + 32));
          isum[b] = AddMaddI16(isum[b], _mm256_maddubs_epi16(lo, a0), s0);
          isum[b] = AddMaddI16(isum[b], _mm256_maddubs_epi16(hi, a1), s1);
        }
      }
      const float d = HalfToFloat(x[i].d);
      const float dmin = HalfToFloat(x[i].dmin);
      for (int b = 0; b < NB; ++b) {
        const float da = act[b].scales[i];
        acc[b] = _mm256_fmadd_ps(_mm256_set1_ps(d * da), _mm256_cvtepi32_ps(isum[b]), acc[b]);
        const __m256i bs =
            _mm256_load_si256(reinterpret_cast<const __m256i*>(act[b].bsums + 16 * i));
        acc_min[b] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * da),
                                     _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins)), acc_min[b]);
      }
    }
    for (int b = 0; b < NB; ++b) out[b * os + r] = Hsum(acc[b]) - Hsum(acc_min[b]);
  }
}

// ---- Q6_K against Q8_K ---------------------------------------------------------------------

template <int NB>
void TileQ6KImpl(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                 float* out, int64_t os) {
  const int64_t nblk = cols / kQKK;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const __m256i m2 = _mm256_set1_epi8(0x30);
  // Shuffles that spread int16 scales 2k (low lane) and 2k+1 (high lane) over 8 words each.
  __m256i spread[4];
  for (int k = 0; k < 4; ++k) {
    const char lo = static_cast<char>(4 * k), hi = static_cast<char>(4 * k + 2);
    spread[k] = _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo,
                                 lo + 1, lo, lo + 1, lo, lo + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1,
                                 hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1);
  }
  for (int64_t r = 0; r < nrows; ++r) {
    const BlockQ6K* x = reinterpret_cast<const BlockQ6K*>(w + r * ws);
    __m256 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nblk; ++i) {
      __m256i isum[NB];
      for (int b = 0; b < NB; ++b) isum[b] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].ql + 64 * h));
        const __m256i ql1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].ql + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh + 32 * h));
        // Unsigned 6-bit values 0..63; the -32 offset is applied through the bsums below.
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4),
                               _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2));
        q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                               _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                               _mm256_and_si256(qh, m2));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2));
        const __m256i sc8 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x[i].scales + 8 * h))));
        __m256i s[4];
        for (int k = 0; k < 4; ++k) s[k] = _mm256_shuffle_epi8(sc8, spread[k]);
        for (int b = 0; b < NB; ++b) {
          const int8_t* a = I8(act[b]) + kQKK * i + 128 * h;
          for (int k = 0; k < 4; ++k) {
            const __m256i av = _mm256_load_si256(reinterpret_cast<const __m256i*>(a + 32 * k));
            isum[b] = AddMaddI16(isum[b], _mm256_maddubs_epi16(q[k], av), s[k]);
          }
        }
      }
      const __m256i sc16 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x[i].scales)));
      const float d = HalfToFloat(x[i].d);
      for (int b = 0; b < NB; ++b) {
        const __m256i bs =
            _mm256_load_si256(reinterpret_cast<const __m256i*>(act[b].bsums + 16 * i));
        const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5);
        const __m256i total = _mm256_sub_epi32(isum[b], corr);
        acc[b] = _mm256_fmadd_ps(_mm256_set1_ps(d * act[b].scales[i]), _mm256_cvtepi32_ps(total),
                                 acc[b]);
      }
    }
    for (int b = 0; b < NB; ++b) out[b * os + r] = Hsum(acc[b]);
  }
}

// ---- Float weights -------------------------------------------------------------------------

inline __m256 LoadF32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 LoadF16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 LoadBf16(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline float ScalarF32(const float* p, int64_t i) { return p[i]; }
inline float ScalarF16(const uint16_t* p, int64_t i) { return HalfToFloat(p[i]); }
inline float ScalarBf16(const uint16_t* p, int64_t i) {
  const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Float dot products: weights of type WT loaded through LW, activations of type AT through LA.
template <int NB, typename WT, typename AT, __m256 (*LW)(const WT*), __m256 (*LA)(const AT*),
          float (*SW)(const WT*, int64_t), float (*SA)(const AT*, int64_t)>
void TileFloat256(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                  float* out, int64_t os) {
  for (int64_t r = 0; r < nrows; ++r) {
    const WT* x = reinterpret_cast<const WT*>(w + r * ws);
    __m256 acc0[NB], acc1[NB];
    for (int b = 0; b < NB; ++b) acc0[b] = acc1[b] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= cols; i += 16) {
      const __m256 w0 = LW(x + i), w1 = LW(x + i + 8);
      for (int b = 0; b < NB; ++b) {
        const AT* a = static_cast<const AT*>(act[b].values);
        acc0[b] = _mm256_fmadd_ps(w0, LA(a + i), acc0[b]);
        acc1[b] = _mm256_fmadd_ps(w1, LA(a + i + 8), acc1[b]);
      }
    }
    for (; i + 8 <= cols; i += 8) {
      const __m256 w0 = LW(x + i);
      for (int b = 0; b < NB; ++b)
        acc0[b] = _mm256_fmadd_ps(w0, LA(static_cast<const AT*>(act[b].values) + i), acc0[b]);
    }
    for (int b = 0; b < NB; ++b) {
      const AT* a = static_cast<const AT*>(act[b].values);
      float tail = 0;
      for (int64_t j = i; j < cols; ++j) tail += SW(x, j) * SA(a, j);
      out[b * os + r] = Hsum(_mm256_add_ps(acc0[b], acc1[b])) + tail;
    }
  }
}

// Expands a template of NB = 1..kMaxTile into a TileFn taking nb at run time.
static_assert(kMaxTile == 4, "TANDEM_TILE_DISPATCH spells out NB = 1..4");
#define TANDEM_TILE_DISPATCH(NAME, TEMPLATE, ...)                                           \
  [[maybe_unused]] void NAME(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, \
                             int nb, int64_t cols, float* out, int64_t os) {                \
    switch (nb) {                                                                           \
      case 1:                                                                               \
        return TEMPLATE<__VA_ARGS__ __VA_OPT__(, ) 1>(w, ws, nrows, act, cols, out, os);    \
      case 2:                                                                               \
        return TEMPLATE<__VA_ARGS__ __VA_OPT__(, ) 2>(w, ws, nrows, act, cols, out, os);    \
      case 3:                                                                               \
        return TEMPLATE<__VA_ARGS__ __VA_OPT__(, ) 3>(w, ws, nrows, act, cols, out, os);    \
      default:                                                                              \
        return TEMPLATE<__VA_ARGS__ __VA_OPT__(, ) 4>(w, ws, nrows, act, cols, out, os);    \
    }                                                                                       \
  }

template <typename D, int NB>
void TileBlock32Impl(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                     float* out, int64_t os) {
  TileBlock32<D, NB>(w, ws, nrows, act, cols, out, os);
}

TANDEM_TILE_DISPATCH(TileQ8_0x86, TileBlock32Impl, DecodeQ8_0)
TANDEM_TILE_DISPATCH(TileQ4_0x86, TileBlock32Impl, DecodeQ4_0)
TANDEM_TILE_DISPATCH(TileMxfp4x86, TileBlock32Impl, DecodeMxfp4)
TANDEM_TILE_DISPATCH(TileQ4Kx86, TileQ4KImpl)
TANDEM_TILE_DISPATCH(TileQ6Kx86, TileQ6KImpl)

template <int NB>
void TileF32Impl(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                 float* out, int64_t os) {
  TileFloat256<NB, float, float, LoadF32, LoadF32, ScalarF32, ScalarF32>(w, ws, nrows, act, cols,
                                                                         out, os);
}
template <int NB>
void TileF16Impl(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                 float* out, int64_t os) {
  TileFloat256<NB, uint16_t, float, LoadF16, LoadF32, ScalarF16, ScalarF32>(w, ws, nrows, act, cols,
                                                                            out, os);
}
template <int NB>
void TileBf16Impl(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                  float* out, int64_t os) {
  TileFloat256<NB, uint16_t, uint16_t, LoadBf16, LoadBf16, ScalarBf16, ScalarBf16>(
      w, ws, nrows, act, cols, out, os);
}

TANDEM_TILE_DISPATCH(TileF32x86, TileF32Impl)
TANDEM_TILE_DISPATCH(TileF16x86, TileF16Impl)
TANDEM_TILE_DISPATCH(TileBf16x86, TileBf16Impl)

}  // namespace
}  // namespace tandem::kernels::internal
