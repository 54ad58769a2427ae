// AVX-512 paged attention (compiled with -mavx512f/-mavx512bw/-mavx512dq/-mavx512vl and F16C;
// entered only when ActiveIsa() reports AVX-512). One call handles one query position and one
// KV head: every query head of that KV head's GQA group, up to four at a time, so each K and V
// row is loaded (and, for an f16 cache, converted) once for the whole group. Head dims up to 128
// are handled, in 16-float chunks; a head dim that is not a multiple of 16 (8 in small models)
// loads its last chunk masked, its other lanes zero, so they add nothing to dot products or
// outputs. attention.cc falls back to the scalar path past 128.
//
// Quantised caches (int8, fp8-e4m3; tandem/kernels/kv_quant.h) are dequantised on load to the
// same f32 values the scalar path uses (int8: code * scale; fp8: the code widened exactly to
// f16, times 256 * scale, one rounding like the scalar table * scale).
// Numerics match the scalar path's two-pass softmax: f32 dot products (the scale is folded into
// the query, which rounds once differently), the max subtracted, exponentials from a degree-7
// polynomial (relative error about 1e-7 over the reduced range), their sum in f32 lanes, then the
// weighted sum of V. A sliding window starts each row's keys later; a sink adds one logit
// per head to the max and the sum (gpt-oss).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "internal.h"
#include "tandem/kernels/attention.h"

namespace tandem::kernels::internal::avx512 {
namespace {

// Cache element kinds.
constexpr int kKindF32 = 0, kKindF16 = 1, kKindI8 = 2, kKindFp8 = 3;

// 16 fp8-e4m3 codes to f32, times `scale256` (= 256 * the row's scale). The low 7 bits shifted
// left by 7 are the same exponent and mantissa as an f16 with bias 15 instead of 7, subnormals
// included, so the f16 is the code's value times 2^-8, exactly; NaN codes are patched.
inline __m512 Fp8x16(const uint8_t* codes, __m512 scale256, __mmask16 lanes) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(lanes, codes));
  const __m256i em = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  __m512 f = _mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16(em, 7), sign));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(em, _mm256_set1_epi16(0x7f));
  f = _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(NAN));
  return _mm512_mul_ps(f, scale256);
}

// Lanes of chunk c (of D) that hold elements of a head of `d` floats: all 16 but in a last,
// partial chunk.
template <int D>
inline __mmask16 ChunkMask(int c, int64_t d) {
  return c < D - 1 || d % 16 == 0 ? __mmask16(0xffff) : __mmask16((1u << (d % 16)) - 1);
}

// The D 16-float chunks of kv head `kvh` at slot j of `block` (the last one masked when the head
// dim is not a multiple of 16: its other lanes are zero).
template <int D, int kKind>
inline void LoadRow(const PagedAttentionParams& p, const void* cache, int64_t block, int64_t j,
                    int64_t kvh, __m512* out) {
  const int64_t d = p.head_dim;
  if constexpr (kKind == kKindF32 || kKind == kKindF16) {
    const int64_t index = ((block * p.block_size + j) * p.n_kv_head + kvh) * d;
    for (int c = 0; c < D; ++c) {
      const __mmask16 m = ChunkMask<D>(c, d);
      if constexpr (kKind == kKindF16) {
        out[c] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
            m, static_cast<const uint16_t*>(cache) + index + 16 * c));
      } else {
        out[c] = _mm512_maskz_loadu_ps(m, static_cast<const float*>(cache) + index + 16 * c);
      }
    }
  } else {
    // Slot: codes [n_kv_head][d] padded to 4 bytes, then one f32 scale per head (kv_quant.h;
    // its inline helpers are not used here, this file being compiled with wider -m flags).
    const int64_t code_bytes = (p.n_kv_head * d + 3) / 4 * 4;
    const int64_t slot_bytes = code_bytes + 4 * p.n_kv_head;
    const uint8_t* slot =
        static_cast<const uint8_t*>(cache) + (block * p.block_size + j) * slot_bytes;
    float scale;
    std::memcpy(&scale, slot + code_bytes + 4 * kvh, 4);
    const uint8_t* codes = slot + kvh * d;
    if constexpr (kKind == kKindI8) {
      const __m512 vs = _mm512_set1_ps(scale);
      for (int c = 0; c < D; ++c) {
        const __m512i q =
            _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(ChunkMask<D>(c, d), codes + 16 * c));
        out[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), vs);
      }
    } else {
      const __m512 vs = _mm512_set1_ps(scale * 256.0f);
      for (int c = 0; c < D; ++c) {
        const __mmask16 m = ChunkMask<D>(c, d);
        out[c] = _mm512_maskz_mov_ps(m, Fp8x16(codes + 16 * c, vs, m));
      }
    }
  }
}

// e^x for x <= 0: x = n ln2 + r with |r| <= ln2/2, e^r from its Taylor polynomial of degree 7
// (truncation below 6e-9 relative), then scaled by 2^n. Inputs below -104 give 0.
inline __m512 ExpNonPositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Query heads h0 .. h0+NG-1 (all of KV head kvh) at query rows qi0 .. qi0+nr-1 (nr <= R) of
// one sequence; D = ceil(head_dim / 16). Every K and V row is loaded once for all of them, so a
// chunk of several rows (a verify chunk, a prefill) reads the cache once per R rows. Each row
// sees its own keys 0 .. q_pos: scores past them are computed but never read, and V rows past
// them are not added.
// scores: R * NG rows of `stride` floats.
template <int D, int NG, int R, int kKind>
void AttendRows(const PagedAttentionParams& p, int64_t qi0, int nr, int64_t kvh, int64_t h0,
                float* scores, int64_t stride) {
  const int64_t d = p.head_dim;
  const int64_t bs = p.block_size;
  const __m512 scale = _mm512_set1_ps(p.scale);
  // Row r sees keys [first[r], keys[r]): all of its prefix, or its last `window` positions.
  int64_t keys[R], first[R];
  int64_t n_keys = 0, min_keys = INT64_MAX, lo = INT64_MAX;
  for (int r = 0; r < nr; ++r) {
    keys[r] = p.q_pos[qi0 + r] + 1;
    first[r] = p.window > 0 ? std::max<int64_t>(0, keys[r] - p.window) : 0;
    n_keys = std::max(n_keys, keys[r]);
    min_keys = std::min(min_keys, keys[r]);
    lo = std::min(lo, first[r]);
  }
  // Row r, head g at [r * NG + g].
  __m512 q[R * NG][D];
  for (int r = 0; r < nr; ++r) {
    for (int g = 0; g < NG; ++g) {
      const float* qg = p.q + (qi0 + r) * p.q_stride + (h0 + g) * d;
      for (int c = 0; c < D; ++c) {
        q[r * NG + g][c] =
            _mm512_mul_ps(_mm512_maskz_loadu_ps(ChunkMask<D>(c, d), qg + 16 * c), scale);
      }
    }
  }
  const int rows = nr * NG;

  // Pass 1: scores, block by block of the table, from the first key any row sees.
  for (int64_t t0 = lo / bs * bs; t0 < n_keys; t0 += bs) {
    const int64_t block = p.block_table[t0 / bs];
    const int64_t n = std::min(bs, n_keys - t0);
    int64_t j = std::max<int64_t>(0, lo - t0);
    if constexpr (D == 1 && kKind == kKindF32) {
      // A head shorter than 16 floats (8 in small models): a reduction per key would cost more
      // than its dot product, so 16 keys at a time, one element of all 16 per gather, and the
      // 16 scores come out in one register.
      if (d < 16) {
        const float* base = static_cast<const float*>(p.k_cache) +
                            ((block * bs) * p.n_kv_head + kvh) * d;
        const __m512i lanes = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(static_cast<int32_t>(p.n_kv_head * d)));
        alignas(64) float qs[R * NG][16];
        for (int x = 0; x < rows; ++x) _mm512_store_ps(qs[x], q[x][0]);
        for (; j + 16 <= n; j += 16) {
          const __m512i idx = _mm512_add_epi32(
              lanes, _mm512_set1_epi32(static_cast<int32_t>(j * p.n_kv_head * d)));
          __m512 acc[R * NG];
          for (int x = 0; x < rows; ++x) acc[x] = _mm512_setzero_ps();
          for (int64_t i = 0; i < d; ++i) {
            const __m512 k = _mm512_i32gather_ps(idx, base + i, 4);
            for (int x = 0; x < rows; ++x) {
              acc[x] = _mm512_fmadd_ps(_mm512_set1_ps(qs[x][i]), k, acc[x]);
            }
          }
          for (int x = 0; x < rows; ++x) _mm512_storeu_ps(scores + x * stride + t0 + j, acc[x]);
        }
      }
    }
    for (; j < n; ++j) {
      __m512 k[D];
      LoadRow<D, kKind>(p, p.k_cache, block, j, kvh, k);
      for (int x = 0; x < rows; ++x) {
        __m512 acc = _mm512_mul_ps(q[x][0], k[0]);
        for (int c = 1; c < D; ++c) acc = _mm512_fmadd_ps(q[x][c], k[c], acc);
        scores[x * stride + t0 + j] = _mm512_reduce_add_ps(acc);
      }
    }
  }

  // Softmax weights over each row's own keys, unnormalised; 1/sum is applied to the output.
  float inv[R * NG];
  // A sink (gpt-oss) is one more logit per head: it raises the max and the sum, adds no value.
  for (int x = 0; x < rows; ++x) {
    float* s = scores + x * stride;
    const int64_t nk = keys[x / NG], t_first = first[x / NG];
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t t = t_first;
    for (; t + 16 <= nk; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
    const __mmask16 tail = static_cast<__mmask16>((1u << (nk - t)) - 1);
    if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + t));
    float max_s = _mm512_reduce_max_ps(mx);
    const float* sink = p.sinks != nullptr ? p.sinks + h0 + x % NG : nullptr;
    if (sink != nullptr) max_s = std::max(max_s, *sink);
    const __m512 m = _mm512_set1_ps(max_s);
    __m512 sum = _mm512_setzero_ps();
    for (t = t_first; t + 16 <= nk; t += 16) {
      const __m512 e = ExpNonPositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
      _mm512_storeu_ps(s + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
      const __m512 e = ExpNonPositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), m));
      _mm512_mask_storeu_ps(s + t, tail, e);
      sum = _mm512_mask_add_ps(sum, tail, sum, e);
    }
    float total = _mm512_reduce_add_ps(sum);
    if (sink != nullptr) total += std::exp(*sink - max_s);
    inv[x] = 1.0f / total;
  }

  // Pass 2: weighted sum of V; keys every row sees first, then each row's remaining ones.
  __m512 acc[R * NG][D];
  for (int x = 0; x < rows; ++x)
    for (int c = 0; c < D; ++c) acc[x][c] = _mm512_setzero_ps();
  for (int64_t t0 = lo / bs * bs; t0 < n_keys; t0 += bs) {
    const int64_t block = p.block_table[t0 / bs];
    const int64_t n = std::min(bs, n_keys - t0);
    for (int64_t j = std::max<int64_t>(0, lo - t0); j < n; ++j) {
      const int64_t t = t0 + j;
      __m512 v[D];
      LoadRow<D, kKind>(p, p.v_cache, block, j, kvh, v);
      for (int x = 0; x < rows; ++x) {
        if (t >= min_keys && t >= keys[x / NG]) continue;
        if (t < first[x / NG]) continue;
        const __m512 w = _mm512_set1_ps(scores[x * stride + t]);
        for (int c = 0; c < D; ++c) acc[x][c] = _mm512_fmadd_ps(w, v[c], acc[x][c]);
      }
    }
  }
  for (int x = 0; x < rows; ++x) {
    float* out = p.out + (qi0 + x / NG) * p.out_stride + (h0 + x % NG) * d;
    const __m512 sc = _mm512_set1_ps(inv[x]);
    for (int c = 0; c < D; ++c) {
      _mm512_mask_storeu_ps(out + 16 * c, ChunkMask<D>(c, d), _mm512_mul_ps(acc[x][c], sc));
    }
  }
}

// Rows a call of AttendRows takes at once: as many as keep its accumulators in registers.
template <int D>
constexpr int RowsAtOnce() {
  return D == 1 ? 8 : D == 2 ? 4 : D <= 4 ? 2 : 1;
}

template <int D, int kKind>
void AttendItemD(const PagedAttentionParams& p, int64_t qi0, int64_t nq, int64_t kvh,
                 float* scores, int64_t stride) {
  constexpr int R = RowsAtOnce<D>();
  const int64_t group = p.n_head / p.n_kv_head;
  for (int64_t qi = qi0; qi < qi0 + nq; qi += R) {
    const int nr = static_cast<int>(std::min<int64_t>(R, qi0 + nq - qi));
    int64_t h = kvh * group;
    const int64_t end = h + group;
    if constexpr (R == 1) {
      for (; h + 4 <= end; h += 4) AttendRows<D, 4, 1, kKind>(p, qi, nr, kvh, h, scores, stride);
    }
    for (; h + 2 <= end; h += 2) AttendRows<D, 2, R, kKind>(p, qi, nr, kvh, h, scores, stride);
    if (h < end) AttendRows<D, 1, R, kKind>(p, qi, nr, kvh, h, scores, stride);
  }
}

template <int kKind>
void AttendItemT(const PagedAttentionParams& p, int64_t qi0, int64_t nq, int64_t kvh,
                 float* scores, int64_t stride) {
  switch ((p.head_dim + 15) / 16) {
    case 1: return AttendItemD<1, kKind>(p, qi0, nq, kvh, scores, stride);
    case 2: return AttendItemD<2, kKind>(p, qi0, nq, kvh, scores, stride);
    case 3: return AttendItemD<3, kKind>(p, qi0, nq, kvh, scores, stride);
    case 4: return AttendItemD<4, kKind>(p, qi0, nq, kvh, scores, stride);
    case 5: return AttendItemD<5, kKind>(p, qi0, nq, kvh, scores, stride);
    case 6: return AttendItemD<6, kKind>(p, qi0, nq, kvh, scores, stride);
    case 7: return AttendItemD<7, kKind>(p, qi0, nq, kvh, scores, stride);
    case 8: return AttendItemD<8, kKind>(p, qi0, nq, kvh, scores, stride);
    default: return;
  }
}

}  // namespace

bool AttentionSupports(const PagedAttentionParams& p) {
  return p.head_dim >= 1 && p.head_dim <= 128 &&
         (p.kv_type == DType::kF16 || p.kv_type == DType::kF32 || p.kv_type == DType::kI8 ||
          p.kv_type == DType::kFp8E4M3);
}

void AttendItem(const PagedAttentionParams& p, int64_t qi0, int64_t nq, int64_t kvh,
                float* scores, int64_t stride) {
  switch (p.kv_type) {
    case DType::kF16: return AttendItemT<kKindF16>(p, qi0, nq, kvh, scores, stride);
    case DType::kI8: return AttendItemT<kKindI8>(p, qi0, nq, kvh, scores, stride);
    case DType::kFp8E4M3: return AttendItemT<kKindFp8>(p, qi0, nq, kvh, scores, stride);
    default: return AttendItemT<kKindF32>(p, qi0, nq, kvh, scores, stride);
  }
}

int ScoreRows() { return 16; }  // R * NG at most: 8 rows of 2 heads, for D = 1

}  // namespace tandem::kernels::internal::avx512
