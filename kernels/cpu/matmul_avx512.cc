// AVX-512 matmul tiles (this file is compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq
// -mavx512vnni and only called when the CPU has them). The quantised types reuse the 256-bit
// tiles with VNNI dot products; the float types get 512-bit tiles, and BF16 uses VDPBF16PS
// (behind a function target attribute, since AVX512_BF16 is a separate feature).
#define TANDEM_TILES_VNNI 1
#include "matmul_x86_tiles.h"

#include <array>
#include <utility>

namespace tandem::kernels::internal {
namespace {

inline __m512 Load512F32(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load512F16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 Load512Bf16(const uint16_t* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512 Load512F32Masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 Load512F16Masked(const uint16_t* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 Load512Bf16Masked(const uint16_t* p, __mmask16 m) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

template <int NB, typename WT, typename AT, __m512 (*LW)(const WT*), __m512 (*LA)(const AT*),
          __m512 (*LWM)(const WT*, __mmask16), __m512 (*LAM)(const AT*, __mmask16)>
void TileFloat512(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                  float* out, int64_t os) {
  for (int64_t r = 0; r < nrows; ++r) {
    const WT* x = reinterpret_cast<const WT*>(w + r * ws);
    __m512 acc0[NB], acc1[NB];
    for (int b = 0; b < NB; ++b) acc0[b] = acc1[b] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= cols; i += 32) {
      const __m512 w0 = LW(x + i), w1 = LW(x + i + 16);
      for (int b = 0; b < NB; ++b) {
        const AT* a = static_cast<const AT*>(act[b].values);
        acc0[b] = _mm512_fmadd_ps(w0, LA(a + i), acc0[b]);
        acc1[b] = _mm512_fmadd_ps(w1, LA(a + i + 16), acc1[b]);
      }
    }
    for (; i < cols; i += 16) {
      const int64_t left = cols - i;
      const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      const __m512 w0 = LWM(x + i, m);
      for (int b = 0; b < NB; ++b) {
        acc0[b] = _mm512_fmadd_ps(w0, LAM(static_cast<const AT*>(act[b].values) + i, m), acc0[b]);
      }
    }
    for (int b = 0; b < NB; ++b)
      out[b * os + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[b], acc1[b]));
  }
}

template <int NB>
void TileF32Impl512(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                    float* out, int64_t os) {
  TileFloat512<NB, float, float, Load512F32, Load512F32, Load512F32Masked, Load512F32Masked>(
      w, ws, nrows, act, cols, out, os);
}
template <int NB>
void TileF16Impl512(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                    float* out, int64_t os) {
  TileFloat512<NB, uint16_t, float, Load512F16, Load512F32, Load512F16Masked, Load512F32Masked>(
      w, ws, nrows, act, cols, out, os);
}
template <int NB>
void TileBf16Impl512(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                     float* out, int64_t os) {
  TileFloat512<NB, uint16_t, uint16_t, Load512Bf16, Load512Bf16, Load512Bf16Masked,
               Load512Bf16Masked>(w, ws, nrows, act, cols, out, os);
}

// BF16 pairs multiplied and summed by VDPBF16PS: 32 products per instruction.
template <int NB>
__attribute__((target("avx512bf16"))) void TileBf16Dp(const uint8_t* w, size_t ws, int64_t nrows,
                                                      const ActRow* act, int64_t cols, float* out,
                                                      int64_t os) {
  for (int64_t r = 0; r < nrows; ++r) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(w + r * ws);
    __m512 acc0[NB], acc1[NB];
    for (int b = 0; b < NB; ++b) acc0[b] = acc1[b] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= cols; i += 64) {
      const __m512i w0 = _mm512_loadu_si512(x + i), w1 = _mm512_loadu_si512(x + i + 32);
      for (int b = 0; b < NB; ++b) {
        const uint16_t* a = static_cast<const uint16_t*>(act[b].values);
        acc0[b] = _mm512_dpbf16_ps(acc0[b], (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)w0);
        acc1[b] = _mm512_dpbf16_ps(acc1[b], (__m512bh)_mm512_loadu_si512(a + i + 32), (__m512bh)w1);
      }
    }
    for (; i < cols; i += 32) {
      const int64_t left = cols - i;
      const __mmask32 m = left >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << left) - 1);
      const __m512i w0 = _mm512_maskz_loadu_epi16(m, x + i);
      for (int b = 0; b < NB; ++b) {
        const uint16_t* a = static_cast<const uint16_t*>(act[b].values);
        acc0[b] =
            _mm512_dpbf16_ps(acc0[b], (__m512bh)_mm512_maskz_loadu_epi16(m, a + i), (__m512bh)w0);
      }
    }
    for (int b = 0; b < NB; ++b)
      out[b * os + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[b], acc1[b]));
  }
}

// ---- Float GEMM tiles for big batches: four weight rows at once -------------------------------

// The four sums of four registers, as one 128-bit vector [sum(a0), sum(a1), sum(a2), sum(a3)].
inline __m128 Reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  auto half = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  };
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)),
                                  _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Four weight rows against NB float activation rows: each activation load serves four rows and
// each weight load NB activations (4 + NB loads per 4 * NB fused multiply-adds, against 1 + NB
// in the one-row tile), and the four rows' sums come out of one transposing reduction. Rows
// past a multiple of four take the one-row tile.
template <int NB, typename WT, __m512 (*LW)(const WT*), __m512 (*LWM)(const WT*, __mmask16)>
void GemmFloat4(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                float* out, int64_t os) {
  int64_t r = 0;
  for (; r + 4 <= nrows; r += 4) {
    const WT* x[4];
    for (int m = 0; m < 4; ++m) x[m] = reinterpret_cast<const WT*>(w + (r + m) * ws);
    __m512 acc[4][NB];
    for (int m = 0; m < 4; ++m)
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < cols; i += 16) {
      const int64_t left = cols - i;
      const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      __m512 wv[4];
      for (int m = 0; m < 4; ++m) wv[m] = left >= 16 ? LW(x[m] + i) : LWM(x[m] + i, mask);
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) {
        const float* a = static_cast<const float*>(act[b].values) + i;
        const __m512 av = left >= 16 ? _mm512_loadu_ps(a) : _mm512_maskz_loadu_ps(mask, a);
        for (int m = 0; m < 4; ++m) acc[m][b] = _mm512_fmadd_ps(wv[m], av, acc[m][b]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      _mm_storeu_ps(out + b * os + r, Reduce4(acc[0][b], acc[1][b], acc[2][b], acc[3][b]));
    }
  }
  if (r < nrows) {
    TileFloat512<NB, WT, float, LW, Load512F32, LWM, Load512F32Masked>(w + r * ws, ws, nrows - r,
                                                                       act, cols, out + r, os);
  }
}

template <typename WT, __m512 (*LW)(const WT*), __m512 (*LWM)(const WT*, __mmask16)>
void GemmFloatDispatch(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int nb,
                       int64_t cols, float* out, int64_t os) {
  static_assert(kFloatGemmTile == 6, "the switch below spells out NB = 1..6");
  switch (nb) {
    case 1: return GemmFloat4<1, WT, LW, LWM>(w, ws, nrows, act, cols, out, os);
    case 2: return GemmFloat4<2, WT, LW, LWM>(w, ws, nrows, act, cols, out, os);
    case 3: return GemmFloat4<3, WT, LW, LWM>(w, ws, nrows, act, cols, out, os);
    case 4: return GemmFloat4<4, WT, LW, LWM>(w, ws, nrows, act, cols, out, os);
    case 5: return GemmFloat4<5, WT, LW, LWM>(w, ws, nrows, act, cols, out, os);
    default: return GemmFloat4<6, WT, LW, LWM>(w, ws, nrows, act, cols, out, os);
  }
}

// ---- 32-element blocks, two per 512-bit register ---------------------------------------------

// The fp16 scales of four consecutive blocks as floats.
template <typename Block>
inline __m128 PackedHalves4(const Block* x) {
  const uint64_t packed = x[0].d | (static_cast<uint64_t>(x[1].d) << 16) |
                          (static_cast<uint64_t>(x[2].d) << 32) |
                          (static_cast<uint64_t>(x[3].d) << 48);
  return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(packed)));
}

struct Decode2Q8_0 {
  using Block = BlockQ8_0;
  static __m512i Values(const Block* x) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[0].qs));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[1].qs));
    return _mm512_inserti64x4(_mm512_zextsi256_si512(a), b, 1);
  }
  static __m512i Value1(const Block* x) {
    return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[0].qs)));
  }
  static __m128 Scales(const Block* x) {
    return _mm_cvtph_ps(
        _mm_cvtsi32_si128(static_cast<int>(x[0].d | (static_cast<uint32_t>(x[1].d) << 16))));
  }
  static float Scale1(const Block* x) { return HalfToFloat(x[0].d); }
  static __m128 Scales4(const Block* x) { return PackedHalves4(x); }
};

// Two blocks of 16 nibble bytes -> [lo(b0) | hi(b0) | lo(b1) | hi(b1)], 16 bytes each.
inline __m512i ExpandNibbles2(const uint8_t* q0, const uint8_t* q1) {
  const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q0));
  const __m512i r = q1 ? _mm512_zextsi256_si512(_mm256_inserti128_si256(
                             _mm256_castsi128_si256(r0),
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1)), 1))
                       : _mm512_zextsi128_si512(r0);
  __m512i w = _mm512_shuffle_i64x2(r, r, _MM_SHUFFLE(1, 1, 0, 0));
  w = _mm512_mask_srli_epi16(w, 0xff00ff00u, w, 4);  // second copy of each block: high nibbles
  w = _mm512_and_si512(w, _mm512_set1_epi8(0x0f));
  return q1 ? w : _mm512_zextsi256_si512(_mm512_castsi512_si256(w));
}

struct Decode2Q4_0 {
  using Block = BlockQ4_0;
  static __m512i Values(const Block* x) {
    return _mm512_sub_epi8(ExpandNibbles2(x[0].qs, x[1].qs), _mm512_set1_epi8(8));
  }
  static __m512i Value1(const Block* x) {
    return _mm512_zextsi256_si512(_mm512_castsi512_si256(
        _mm512_sub_epi8(ExpandNibbles2(x[0].qs, nullptr), _mm512_set1_epi8(8))));
  }
  static __m128 Scales(const Block* x) {
    return _mm_cvtph_ps(
        _mm_cvtsi32_si128(static_cast<int>(x[0].d | (static_cast<uint32_t>(x[1].d) << 16))));
  }
  static float Scale1(const Block* x) { return HalfToFloat(x[0].d); }
  static __m128 Scales4(const Block* x) { return PackedHalves4(x); }
};

struct Decode2Mxfp4 {
  using Block = BlockMxfp4;
  static __m512i Table() {
    return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
  }
  static __m512i Values(const Block* x) {
    return _mm512_shuffle_epi8(Table(), ExpandNibbles2(x[0].qs, x[1].qs));
  }
  static __m512i Value1(const Block* x) {
    return _mm512_zextsi256_si512(
        _mm512_castsi512_si256(_mm512_shuffle_epi8(Table(), ExpandNibbles2(x[0].qs, nullptr))));
  }
  static __m128 Scales(const Block* x) {
    return _mm_setr_ps(E8m0HalfScale(x[0].e), E8m0HalfScale(x[1].e), 0, 0);
  }
  static float Scale1(const Block* x) { return E8m0HalfScale(x[0].e); }
  static __m128 Scales4(const Block* x) {
    // 2^(e-128) per lane: exponent field e-1 when that is normal, else the subnormal 2^21 << e.
    const __m128i e = _mm_setr_epi32(x[0].e, x[1].e, x[2].e, x[3].e);
    const __m128i normal = _mm_slli_epi32(_mm_sub_epi32(e, _mm_set1_epi32(1)), 23);
    const __m128i subnormal = _mm_sllv_epi32(_mm_set1_epi32(0x00200000), e);
    return _mm_castsi128_ps(
        _mm_blendv_epi8(normal, subnormal, _mm_cmplt_epi32(e, _mm_set1_epi32(2))));
  }
};

// Signed weights against signed activations: |w| . (a negated where w < 0), since VPDPBUSD
// wants its first operand unsigned (AVX-512 has no byte sign instruction). The main loop takes
// four blocks (two registers) so the scales of all four are built together.
template <typename D, int NB>
void TileBlock32x512(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                     float* out, int64_t os) {
  using Block = typename D::Block;
  const int64_t nblk = cols / 32;
  const __m512i spread01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i spread23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i zero = _mm512_setzero_si512();
  auto dot = [&](__m512i uq, __mmask64 neg, __m512i a) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, uq, _mm512_mask_sub_epi8(a, neg, zero, a)));
  };
  for (int64_t r = 0; r < nrows; ++r) {
    const Block* x = reinterpret_cast<const Block*>(w + r * ws);
    __m512 acc0[NB], acc1[NB];
    for (int b = 0; b < NB; ++b) acc0[b] = acc1[b] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 4 <= nblk; i += 4) {
      const __m512i q0 = D::Values(x + i), q1 = D::Values(x + i + 2);
      const __m512i u0 = _mm512_abs_epi8(q0), u1 = _mm512_abs_epi8(q1);
      const __mmask64 n0 = _mm512_movepi8_mask(q0), n1 = _mm512_movepi8_mask(q1);
      const __m128 dw = D::Scales4(x + i);
      for (int b = 0; b < NB; ++b) {
        const int8_t* a = I8(act[b]) + 32 * i;
        const __m512 s = _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_load_ps(act[b].scales + i)));
        acc0[b] = _mm512_fmadd_ps(_mm512_permutexvar_ps(spread01, s),
                                  dot(u0, n0, _mm512_load_si512(a)), acc0[b]);
        acc1[b] = _mm512_fmadd_ps(_mm512_permutexvar_ps(spread23, s),
                                  dot(u1, n1, _mm512_load_si512(a + 64)), acc1[b]);
      }
    }
    if (i + 2 <= nblk) {
      const __m512i q = D::Values(x + i);
      const __m512i u = _mm512_abs_epi8(q);
      const __mmask64 n = _mm512_movepi8_mask(q);
      const __m128 dw = D::Scales(x + i);
      for (int b = 0; b < NB; ++b) {
        const __m128 da =
            _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(act[b].scales + i)));
        const __m512 s = _mm512_castps128_ps512(_mm_mul_ps(dw, da));
        acc0[b] = _mm512_fmadd_ps(_mm512_permutexvar_ps(spread01, s),
                                  dot(u, n, _mm512_load_si512(I8(act[b]) + 32 * i)), acc0[b]);
      }
      i += 2;
    }
    float tail[NB] = {};
    if (i < nblk) {  // odd block count: the last block alone, upper half zero
      const __m512i q = D::Value1(x + i);
      const __m512i u = _mm512_abs_epi8(q);
      const __mmask64 n = _mm512_movepi8_mask(q);
      for (int b = 0; b < NB; ++b) {
        const __m512i a = _mm512_zextsi256_si512(
            _mm256_load_si256(reinterpret_cast<const __m256i*>(I8(act[b]) + 32 * i)));
        tail[b] = D::Scale1(x + i) * act[b].scales[i] * _mm512_reduce_add_ps(dot(u, n, a));
      }
    }
    for (int b = 0; b < NB; ++b)
      out[b * os + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[b], acc1[b])) + tail[b];
  }
}

template <typename D, int NB>
void TileBlock32x512Impl(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act,
                         int64_t cols, float* out, int64_t os) {
  TileBlock32x512<D, NB>(w, ws, nrows, act, cols, out, os);
}

// ---- Q4_K, a 64-value group pair per 512-bit register ------------------------------------------

template <int NB>
void TileQ4Kx512Impl(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                     float* out, int64_t os) {
  const int64_t nblk = cols / kQKK;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  // Word indices spreading scale 2g over the first 16 words and 2g+1 over the last 16.
  __m512i spread[4];
  for (int g = 0; g < 4; ++g) {
    spread[g] =
        _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_set1_epi16(static_cast<int16_t>(2 * g))),
                           _mm256_set1_epi16(static_cast<int16_t>(2 * g + 1)), 1);
  }
  for (int64_t r = 0; r < nrows; ++r) {
    const BlockQ4K* x = reinterpret_cast<const BlockQ4K*>(w + r * ws);
    __m512 acc[NB];
    __m256 acc_min[NB];
    for (int b = 0; b < NB; ++b) {
      acc[b] = _mm512_setzero_ps();
      acc_min[b] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < nblk; ++i) {
      const __m128i sm = UnpackQ4KScalesMins(x[i].scales);
      const __m512i sc16 = _mm512_zextsi128_si512(_mm_cvtepu8_epi16(sm));
      const __m256i mins = Q4KMinsPerSixteen(sm);
      __m512i sv[4];
      for (int g = 0; g < 4; ++g) sv[g] = _mm512_permutexvar_epi16(spread[g], sc16);
      __m512i isum[NB];
      for (int b = 0; b < NB; ++b) isum[b] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(x[i].qs + 64 * h);
        const __m512i lo = _mm512_and_si512(v, m4);                        // sub-blocks 4h, 4h+2
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);  // sub-blocks 4h+1, 4h+3
        const __m512i q0 = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));  // 4h | 4h+1
        const __m512i q1 = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));  // 4h+2 | 4h+3
        for (int b = 0; b < NB; ++b) {
          const int8_t* a = I8(act[b]) + kQKK * i + 128 * h;
          isum[b] = _mm512_dpwssd_epi32(isum[b], _mm512_maddubs_epi16(q0, _mm512_load_si512(a)),
                                        sv[2 * h]);
          isum[b] = _mm512_dpwssd_epi32(
              isum[b], _mm512_maddubs_epi16(q1, _mm512_load_si512(a + 64)), sv[2 * h + 1]);
        }
      }
      const float d = HalfToFloat(x[i].d);
      const float dmin = HalfToFloat(x[i].dmin);
      for (int b = 0; b < NB; ++b) {
        const float da = act[b].scales[i];
        acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(d * da), _mm512_cvtepi32_ps(isum[b]), acc[b]);
        const __m256i bs =
            _mm256_load_si256(reinterpret_cast<const __m256i*>(act[b].bsums + 16 * i));
        acc_min[b] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * da),
                                     _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins)), acc_min[b]);
      }
    }
    for (int b = 0; b < NB; ++b) out[b * os + r] = _mm512_reduce_add_ps(acc[b]) - Hsum(acc_min[b]);
  }
}

// ---- GEMM tiles for big batches (prefill): unsigned activations, lane-expanded scales -------
//
// The activations come as a+128 (u8, internal::kGemmTile's layout), so VPDPBUSD takes the signed
// weights as they are and the a+128 offset is removed by starting each dot product from
// -128 * (sum of the weights in each lane), computed once per weight register for all NB
// activation rows. The activation scales come expanded to one float per int32 lane, so the scale
// of a lane is one multiply by the weight scales. Per activation row and register of 64 weights
// that leaves four instructions: dot product, convert, scale multiply, fused add. Two weight rows
// go together, so each activation load serves both (2 x 8 measured best on this machine: 1 x 8
// was 20% slower at prefill, 3 x 6 and 4 x 4 slower still).
// RM weight rows (1 or 2) against NB activation rows: with two, each activation load serves
// both rows.
template <typename D, int NB, int RM>
void GemmRows32x512(const uint8_t* w, size_t ws, const uint8_t* const* a, int64_t nblk,
                    float* out, int64_t os) {
  using Block = typename D::Block;
  const __m512i spread01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i spread23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const Block* x[RM];
  for (int m = 0; m < RM; ++m) x[m] = reinterpret_cast<const Block*>(w + m * ws);
  __m512 acc[RM][NB];
  for (int m = 0; m < RM; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  // One register of two blocks per weight row (i = index of its first block): q, the weight
  // scales spread over the lanes (dw), against every activation row.
  auto apply = [&](int64_t i, const __m512i* q, const __m512* dw) {
    __m512i ncorr[RM];
    for (int m = 0; m < RM; ++m)
      ncorr[m] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, k128, q[m]));
    for (int b = 0; b < NB; ++b) {
      const uint8_t* group = a[b] + 64 * i;  // 128 bytes per two blocks
      const __m512i av = _mm512_load_si512(group);
      const __m512 as = _mm512_load_ps(reinterpret_cast<const float*>(group + 64));
      for (int m = 0; m < RM; ++m) {
        const __m512i p = _mm512_dpbusd_epi32(ncorr[m], av, q[m]);
        acc[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw[m], as), acc[m][b]);
      }
    }
  };
  __m512i q[RM];
  __m512 dw[RM];
  int64_t i = 0;
  for (; i + 4 <= nblk; i += 4) {
    __m512 dw4[RM];
    for (int m = 0; m < RM; ++m) {
      dw4[m] = _mm512_castps128_ps512(D::Scales4(x[m] + i));
      q[m] = D::Values(x[m] + i);
      dw[m] = _mm512_permutexvar_ps(spread01, dw4[m]);
    }
    apply(i, q, dw);
    for (int m = 0; m < RM; ++m) {
      q[m] = D::Values(x[m] + i + 2);
      dw[m] = _mm512_permutexvar_ps(spread23, dw4[m]);
    }
    apply(i + 2, q, dw);
  }
  if (i + 2 <= nblk) {
    for (int m = 0; m < RM; ++m) {
      q[m] = D::Values(x[m] + i);
      dw[m] = _mm512_permutexvar_ps(spread01, _mm512_castps128_ps512(D::Scales(x[m] + i)));
    }
    apply(i, q, dw);
    i += 2;
  }
  if (i < nblk) {  // odd block count: the upper half of the register is zero weights
    for (int m = 0; m < RM; ++m) {
      q[m] = D::Value1(x[m] + i);
      dw[m] = _mm512_set1_ps(D::Scale1(x[m] + i));
    }
    apply(i, q, dw);
  }
  for (int m = 0; m < RM; ++m)
    for (int b = 0; b < NB; ++b) out[b * os + m] = _mm512_reduce_add_ps(acc[m][b]);
}

template <typename D, int NB>
void GemmBlock32x512(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int64_t cols,
                     float* out, int64_t os) {
  const uint8_t* a[NB];
  for (int b = 0; b < NB; ++b) a[b] = static_cast<const uint8_t*>(act[b].values);
  int64_t r = 0;
  for (; r + 2 <= nrows; r += 2) GemmRows32x512<D, NB, 2>(w + r * ws, ws, a, cols / 32, out + r, os);
  if (r < nrows) GemmRows32x512<D, NB, 1>(w + r * ws, ws, a, cols / 32, out + r, os);
}

// NB = 1..kGemmTile chosen at run time.
template <typename D>
void GemmBlock32Dispatch(const uint8_t* w, size_t ws, int64_t nrows, const ActRow* act, int nb,
                         int64_t cols, float* out, int64_t os) {
  static_assert(kGemmTile == 8, "the switch below spells out NB = 1..8");
  switch (nb) {
    case 1: return GemmBlock32x512<D, 1>(w, ws, nrows, act, cols, out, os);
    case 2: return GemmBlock32x512<D, 2>(w, ws, nrows, act, cols, out, os);
    case 3: return GemmBlock32x512<D, 3>(w, ws, nrows, act, cols, out, os);
    case 4: return GemmBlock32x512<D, 4>(w, ws, nrows, act, cols, out, os);
    case 5: return GemmBlock32x512<D, 5>(w, ws, nrows, act, cols, out, os);
    case 6: return GemmBlock32x512<D, 6>(w, ws, nrows, act, cols, out, os);
    case 7: return GemmBlock32x512<D, 7>(w, ws, nrows, act, cols, out, os);
    default: return GemmBlock32x512<D, 8>(w, ws, nrows, act, cols, out, os);
  }
}

// ---- Packed weights (internal.h): 16 rows per register, no horizontal sums ---------------------
//
// Per block and activation row: eight VPDPBUSD of a weight register (4 values of each of the 16
// rows, unsigned with the type's offset) against 4 broadcast activations, started from the
// activation's offset term so the integer sums come out exact; then one convert and one fused
// multiply-add by the 16 row scales times the activation scale. The eight weight registers are
// loaded (Q4_0: split from four) once per block for all activation rows. Same bits as
// PackedScalar: the integer sums are exact and the float steps are the same, in the same order.
//
// Decode (one or two activation rows) is bound by how fast the weights stream in. Prefetching
// kPackPrefetchBytes (8 KiB) ahead into L2 rather than 2 KiB ahead into L1 keeps more lines in
// flight than the hardware prefetcher alone: the llama-1b Q4_0 matmul sweep went from 14.8 to
// 16.7 GB/s on one thread and from 25 to 27 GB/s on two (docs/perf/engine-cpu.md, "Decode,
// runs 4-8").

// What a packed group holds: Q8_0 bytes, or nibbles that are Q4_0 values or MXFP4 codes.
enum class PackKind { kQ8_0, kQ4_0, kMxfp4 };

// Sixteen 2^(e-128) floats from the E8M0 bytes of the 16 rows (Decode2Mxfp4::Scales4's trick,
// sixteen lanes wide): exponent field e-1 when that is normal, else the subnormal 2^21 << e.
inline __m512 E8m0HalfScales16(const uint8_t* e8) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e8)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  const __mmask16 small = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, subnormal));
}

template <PackKind kKind, int NB>
void PackedTile512(const uint8_t* group, int64_t nblk, const ActRow* act, float* out, int64_t os,
                   int valid_rows) {
  constexpr bool kQ4 = kKind != PackKind::kQ8_0;
  constexpr int64_t kValueBytes = kQ4 ? kPackQ4_0ValueBytes : kPackQ8_0ValueBytes;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  // MXFP4 codes to their doubled E2M1 values plus 12, so VPDPBUSD sees unsigned weights.
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11,
                                                           10, 9, 8, 6, 4, 0));
  __m512 acc[NB];
  for (int b = 0; b < NB; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nblk; ++i) {
    const uint8_t* v = group + PackedValuesAt(kValueBytes, i);
    if constexpr (NB <= 2) {
      // Decode streams the weights once: ask for the lines a few dozen blocks ahead (the
      // block's values and, with its pair's, the scales line after them).
      for (int c = 0; c < kValueBytes + 32; c += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(v + kPackPrefetchBytes + c), _MM_HINT_T1);
      }
    }
    __m512i w[8];
    if constexpr (kQ4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i x = _mm512_load_si512(v + 64 * c);
        w[c] = _mm512_and_si512(x, m4);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
        if constexpr (kKind == PackKind::kMxfp4) {
          w[c] = _mm512_shuffle_epi8(lut, w[c]);
          w[c + 4] = _mm512_shuffle_epi8(lut, w[c + 4]);
        }
      }
    } else {
      for (int c = 0; c < 8; ++c) w[c] = _mm512_load_si512(v + 64 * c);
    }
    // The dot products of all activation rows advance together, chunk by chunk, so NB
    // independent VPDPBUSD chains are in flight (one row's eight in a row would wait on each
    // other's latency); below four rows each row's chain is split in two.
    constexpr int kChains = NB >= 4 ? 1 : 2;
    __m512i sum[kChains][NB];
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      sum[0][b] = _mm512_set1_epi32(act[b].offsets[i]);
      if constexpr (kChains == 2) sum[1][b] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 16
      for (int b = 0; b < NB; ++b) {
        // Broadcast straight from memory (through a GPR it costs two more uops).
        const __m512i a4 = _mm512_broadcastd_epi32(_mm_loadu_si32(I8(act[b]) + 32 * i + 4 * c));
        sum[c % kChains][b] = _mm512_dpbusd_epi32(sum[c % kChains][b], w[c], a4);
      }
    }
    __m512 dw;
    if constexpr (kKind == PackKind::kMxfp4) {
      dw = E8m0HalfScales16(group + PackedScalesAt(kValueBytes, i));
    } else {
      dw = _mm512_cvtph_ps(_mm256_load_si256(
          reinterpret_cast<const __m256i*>(group + PackedScalesAt(kValueBytes, i))));
    }
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      __m512i total = sum[0][b];
      if constexpr (kChains == 2) total = _mm512_add_epi32(total, sum[1][b]);
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total),
                               _mm512_mul_ps(dw, _mm512_set1_ps(act[b].scales[i])), acc[b]);
    }
  }
  const __mmask16 keep =
      valid_rows >= kPackRows ? __mmask16(0xffff) : __mmask16((1u << valid_rows) - 1);
  for (int b = 0; b < NB; ++b) _mm512_mask_storeu_ps(out + b * os, keep, acc[b]);
}

template <PackKind kKind, size_t... kNb>
constexpr auto PackedTable(std::index_sequence<kNb...>) {
  using Fn = void (*)(const uint8_t*, int64_t, const ActRow*, float*, int64_t, int);
  return std::array<Fn, sizeof...(kNb)>{PackedTile512<kKind, static_cast<int>(kNb) + 1>...};
}

// NB = 1..kPackTile chosen at run time.
template <PackKind kKind>
void PackedDispatch512(const uint8_t* group, int64_t nblk, const ActRow* act, int nb, float* out,
                       int64_t os, int valid_rows) {
  static constexpr auto kTable = PackedTable<kKind>(std::make_index_sequence<kPackTile>());
  kTable[nb - 1](group, nblk, act, out, os, valid_rows);
}

TANDEM_TILE_DISPATCH(TileQ8_0x512, TileBlock32x512Impl, Decode2Q8_0)
TANDEM_TILE_DISPATCH(TileQ4_0x512, TileBlock32x512Impl, Decode2Q4_0)
TANDEM_TILE_DISPATCH(TileMxfp4x512, TileBlock32x512Impl, Decode2Mxfp4)
TANDEM_TILE_DISPATCH(TileQ4Kx512, TileQ4Kx512Impl)

TANDEM_TILE_DISPATCH(TileF32x512, TileF32Impl512)
TANDEM_TILE_DISPATCH(TileF16x512, TileF16Impl512)
TANDEM_TILE_DISPATCH(TileBf16x512, TileBf16Impl512)
TANDEM_TILE_DISPATCH(TileBf16Dpx512, TileBf16Dp)

}  // namespace

namespace avx512 {

TileKernels GetTileKernels(bool with_bf16) {
  TileKernels k;
  k.f32 = TileF32x512;
  k.f16 = TileF16x512;
  k.bf16 = with_bf16 ? TileBf16Dpx512 : TileBf16x512;
  k.q8_0 = TileQ8_0x512;
  k.q4_0 = TileQ4_0x512;
  k.mxfp4 = TileMxfp4x512;
  k.q4_k = TileQ4Kx512;
  k.q6_k = TileQ6Kx86;
  return k;
}

TileFn GetGemmKernel(DType weight_type) {
  switch (weight_type) {
    case DType::kQ8_0:
      return GemmBlock32Dispatch<Decode2Q8_0>;
    case DType::kQ4_0:
      return GemmBlock32Dispatch<Decode2Q4_0>;
    case DType::kMXFP4:
      return GemmBlock32Dispatch<Decode2Mxfp4>;
    case DType::kF32:
      return GemmFloatDispatch<float, Load512F32, Load512F32Masked>;
    case DType::kF16:
      return GemmFloatDispatch<uint16_t, Load512F16, Load512F16Masked>;
    default:
      return nullptr;
  }
}

void QuantizeQ8_0Blocks(const float* x, int64_t nblk, int8_t* q, float* scales, int32_t* sums,
                        int32_t weight_offset) {
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < nblk; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_and_ps(x0, sign_off), _mm512_and_ps(x1, sign_off)));
    const uint16_t d16 = _cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT);
    scales[b] = _cvtsh_ss(d16);
    const __m512 id = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    // Round to nearest, ties to even (the default rounding mode), then saturate to int8.
    const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id));
    const __m512i v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), _mm512_cvtsepi32_epi8(v0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), _mm512_cvtsepi32_epi8(v1));
    if (sums != nullptr) {
      const __m512i lo = _mm512_max_epi32(_mm512_min_epi32(v0, _mm512_set1_epi32(127)),
                                          _mm512_set1_epi32(-128));
      const __m512i hi = _mm512_max_epi32(_mm512_min_epi32(v1, _mm512_set1_epi32(127)),
                                          _mm512_set1_epi32(-128));
      sums[b] = -weight_offset * _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
    }
  }
}

PackedFn GetPackedKernel(DType weight_type) {
  switch (weight_type) {
    case DType::kQ8_0:
      return PackedDispatch512<PackKind::kQ8_0>;
    case DType::kQ4_0:
      return PackedDispatch512<PackKind::kQ4_0>;
    case DType::kMXFP4:
      return PackedDispatch512<PackKind::kMxfp4>;
    default:
      return nullptr;
  }
}

}  // namespace avx512
}  // namespace tandem::kernels::internal
