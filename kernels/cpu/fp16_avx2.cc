// F16C row conversions (compiled with -mavx2 -mfma -mf16c; called only when ActiveIsa() says
// the CPU has them). F16C rounds to nearest even like the scalar code; only NaNs differ (F16C
// keeps payload bits), so lanes holding NaN are redone with the scalar function.
#include <immintrin.h>

#include "internal.h"
#include "tandem/kernels/fp16.h"

namespace tandem::kernels::internal::avx2 {

void Fp16ToF32Row(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = kernels::Fp16ToF32(src[i]);
}

void F32ToFp16Row(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) {
      for (int64_t j = i; j < i + 8; ++j) dst[j] = kernels::F32ToFp16(src[j]);
    }
  }
  for (; i < n; ++i) dst[i] = kernels::F32ToFp16(src[i]);
}

}  // namespace tandem::kernels::internal::avx2
