// IEEE half and bfloat16 conversions, bit-compatible with ggml's (round to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

namespace tandem::kernels {

float Fp16ToF32(uint16_t h);
uint16_t F32ToFp16(float f);

inline float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays a quiet NaN (as ggml_compute_fp32_to_bf16 does).
inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((u >> 16) | 64);
  return static_cast<uint16_t>((u + (0x7fff + ((u >> 16) & 1))) >> 16);
}

void Fp16ToF32Row(const uint16_t* src, float* dst, int64_t n);
void F32ToFp16Row(const float* src, uint16_t* dst, int64_t n);

}  // namespace tandem::kernels
