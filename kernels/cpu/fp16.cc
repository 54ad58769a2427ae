// Scalar IEEE half conversions, written to give exactly ggml's bits (its
// ggml_compute_fp16_to_fp32 / ggml_compute_fp32_to_fp16): round to nearest even, subnormals
// kept, overflow to infinity, NaN -> quiet NaN (f16 -> f32 keeps the payload and sets the
// quiet bit; f32 -> f16 gives sign | 0x7e00). The row versions use F16C when the CPU has it
// and patch NaN lanes so they match the scalar result.
#include "tandem/kernels/fp16.h"

#include <cstring>

#include "internal.h"
#include "tandem/kernels/cpu_features.h"

namespace tandem::kernels {
namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t ToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

float Fp16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0x1f) {
    // Infinity, or NaN made quiet (what the multiply in ggml's version does on x86).
    return FromBits(sign | 0x7f800000 | (mant != 0 ? 0x400000 : 0) | (mant << 13));
  }
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in float.
    const float mag = static_cast<float>(mant) * 0x1p-24f;
    return FromBits(sign | ToBits(mag));
  }
  return FromBits(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t F32ToFp16(float f) {
  const uint32_t u = ToBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7fffffff;
  if (a > 0x7f800000) return sign | 0x7e00;  // NaN
  // 65520 = largest half + half an ulp; ties go to the even neighbour, which is infinity.
  if (a >= 0x477ff000) return sign | 0x7c00;
  if (a >= 0x38800000) {
    // Normal half: rebias the exponent and round the 13 dropped mantissa bits to even; a carry
    // out of the mantissa correctly bumps the exponent.
    const uint32_t rebased = a - (112u << 23);
    const uint32_t rounded = rebased + 0xfff + ((rebased >> 13) & 1);
    return sign | static_cast<uint16_t>(rounded >> 13);
  }
  // Subnormal half (or zero): count units of 2^-24. The scaling is exact, and adding 2^23
  // rounds the result to an integer, to nearest even, in the FPU's default mode. 1024 units
  // lands on the smallest normal's encoding, as it should.
  const float units = FromBits(a) * 0x1p24f;
  const float rounded = (units + 0x1p23f) - 0x1p23f;
  return sign | static_cast<uint16_t>(static_cast<uint32_t>(rounded));
}

void Fp16ToF32Row(const uint16_t* src, float* dst, int64_t n) {
#if TANDEM_KERNELS_X86
  if (ActiveIsa() >= Isa::kAvx2) {
    internal::avx2::Fp16ToF32Row(src, dst, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = Fp16ToF32(src[i]);
}

void F32ToFp16Row(const float* src, uint16_t* dst, int64_t n) {
#if TANDEM_KERNELS_X86
  if (ActiveIsa() >= Isa::kAvx2) {
    internal::avx2::F32ToFp16Row(src, dst, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = F32ToFp16(src[i]);
}

}  // namespace tandem::kernels
