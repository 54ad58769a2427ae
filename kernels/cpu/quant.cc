// Row quantisers and dequantisers for the ggml block formats (layouts in internal.h).
//
// Q8_0, Q4_0, Q8_K and MXFP4 follow ggml's reference quantisers byte for byte, since model files
// and llama.cpp's outputs are built with them. Q4_K and Q6_K use a least-squares search for each
// sub-block's scale (and min) over a small set of candidate grids, then quantise the sub-block
// scales themselves and requantise the values against the stored scales.
#include "tandem/kernels/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "internal.h"
#include "tandem/kernels/fp16.h"

namespace tandem::kernels {
namespace {

using internal::BlockMxfp4;
using internal::BlockQ4_0;
using internal::BlockQ4K;
using internal::BlockQ6K;
using internal::BlockQ8_0;
using internal::BlockQ8K;
using internal::kMxfp4Values;
using internal::kQKK;

// Round to nearest, ties to even, for |v| < 2^22: adding 1.5 * 2^23 leaves the integer in the
// low mantissa bits (ggml's nearest_int does the same).
int NearestInt(float v) {
  const float biased = v + 12582912.f;
  int32_t bits;
  std::memcpy(&bits, &biased, 4);
  return (bits & 0x007fffff) - 0x00400000;
}

int Clamp(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// ---- Q8_0 / Q4_0 ---------------------------------------------------------------------------

void QuantizeQ8_0(const float* x, BlockQ8_0* y, int64_t nblocks) {
  for (int64_t b = 0; b < nblocks; ++b, x += 32) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = F32ToFp16(d);
    for (int j = 0; j < 32; ++j) y[b].qs[j] = static_cast<int8_t>(std::roundf(x[j] * id));
  }
}

void QuantizeQ4_0(const float* x, BlockQ4_0* y, int64_t nblocks) {
  for (int64_t b = 0; b < nblocks; ++b, x += 32) {
    // The signed value of largest magnitude maps to -8, the level with no positive twin.
    float amax = 0.0f;
    float max = 0.0f;
    for (int j = 0; j < 32; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = F32ToFp16(d);
    for (int j = 0; j < 16; ++j) {
      // x*id lies in [-8, 8]; +8.5 then truncation rounds half up onto 0..16, capped at 15.
      const int lo = std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * id + 8.5f)));
      const int hi = std::min(15, static_cast<int>(static_cast<int8_t>(x[j + 16] * id + 8.5f)));
      y[b].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

// ---- MXFP4 ---------------------------------------------------------------------------------

float E8m0Half(uint8_t e) {
  // 2^(e - 128): the E8M0 scale halved, because the value table is doubled.
  const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void QuantizeMxfp4(const float* x, BlockMxfp4* y, int64_t nblocks) {
  for (int64_t b = 0; b < nblocks; ++b, x += 32) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    // Shared exponent: the largest table value (12 * 2^(e-128) = 1.5 * 2^floor(log2 amax))
    // just covers amax.
    int e = 0;
    if (amax > 0.0f) e = Clamp(static_cast<int>(std::floor(std::log2(amax))) - 2 + 127, 0, 254);
    y[b].e = static_cast<uint8_t>(e);
    const float d = E8m0Half(y[b].e);
    auto nearest = [d](float v) {
      int best = 0;
      float best_err = std::fabs(kMxfp4Values[0] * d - v);
      for (int i = 1; i < 16; ++i) {
        const float err = std::fabs(kMxfp4Values[i] * d - v);
        if (err < best_err) {
          best = i;
          best_err = err;
        }
      }
      return best;
    };
    for (int j = 0; j < 16; ++j) {
      y[b].qs[j] = static_cast<uint8_t>(nearest(x[j]) | (nearest(x[j + 16]) << 4));
    }
  }
}

// ---- Q8_K ----------------------------------------------------------------------------------

void QuantizeQ8K(const float* x, BlockQ8K* y, int64_t nblocks) {
  for (int64_t b = 0; b < nblocks; ++b, x += kQKK) {
    float amax = 0.0f;
    float max = 0.0f;
    for (int j = 0; j < kQKK; ++j) {
      if (std::fabs(x[j]) > amax) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    if (amax == 0.0f) {
      std::memset(&y[b], 0, sizeof(BlockQ8K));
      continue;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < kQKK; ++j)
      y[b].qs[j] = static_cast<int8_t>(std::min(127, NearestInt(iscale * x[j])));
    for (int g = 0; g < kQKK / 16; ++g) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += y[b].qs[g * 16 + j];
      y[b].bsums[g] = static_cast<int16_t>(sum);
    }
    y[b].d = 1.0f / iscale;
  }
}

// ---- Q4_K ----------------------------------------------------------------------------------

struct AffineFit {
  float scale;  // x ~ scale * L - min
  float min;    // >= 0
};

// Fits x ~ scale * L - min with L in [0, nmax] minimising sum w (x - fit)^2. Tries the grids
// whose step is (max - lo) / (nmax + t) for t in [-1, 1]; for each grid the rounding fixes L
// and the best (scale, min) for that L is solved in closed form.
AffineFit FitAffine(const float* x, const float* w, int n, int nmax, uint8_t* levels) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  lo = std::min(lo, 0.0f);  // the offset only ever subtracts, so 0 must be representable
  if (hi == lo) {
    for (int i = 0; i < n; ++i) levels[i] = 0;
    return {0.0f, -lo};
  }
  float sw = 0, swx = 0;
  for (int i = 0; i < n; ++i) {
    sw += w[i];
    swx += w[i] * x[i];
  }
  auto error_of = [&](float scale, float offset, const uint8_t* l) {
    float err = 0;
    for (int i = 0; i < n; ++i) {
      const float diff = scale * l[i] + offset - x[i];
      err += w[i] * diff * diff;
    }
    return err;
  };
  AffineFit best{(hi - lo) / nmax, -lo};
  for (int i = 0; i < n; ++i) {
    levels[i] = static_cast<uint8_t>(Clamp(NearestInt((x[i] - lo) * nmax / (hi - lo)), 0, nmax));
  }
  float best_err = error_of(best.scale, lo, levels);
  uint8_t trial[32];
  for (int step = 0; step <= 20; ++step) {
    const float inv = (nmax - 1.0f + 0.1f * step) / (hi - lo);
    float sl = 0, sl2 = 0, sxl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = Clamp(NearestInt(inv * (x[i] - lo)), 0, nmax);
      trial[i] = static_cast<uint8_t>(l);
      sl += w[i] * l;
      sl2 += w[i] * l * l;
      sxl += w[i] * l * x[i];
    }
    const float det = sw * sl2 - sl * sl;
    if (det <= 0) continue;
    float scale = (sw * sxl - swx * sl) / det;
    float offset = (sl2 * swx - sl * sxl) / det;
    if (offset > 0) {  // a positive offset is not representable: refit through the origin
      offset = 0;
      scale = sxl / sl2;
    }
    const float err = error_of(scale, offset, trial);
    if (err < best_err) {
      best_err = err;
      best = {scale, -offset};
      std::memcpy(levels, trial, n);
    }
  }
  return best;
}

void PackQ4KScales(const uint8_t* sc, const uint8_t* mn, uint8_t* out) {
  // Sub-blocks 0-3 keep scale and min in the low 6 bits of bytes 0-3 / 4-7; sub-blocks 4-7 put
  // their low 4 bits in bytes 8-11 and their top 2 bits in the spare top bits of bytes 0-7.
  for (int j = 0; j < 4; ++j) {
    out[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    out[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    out[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xf) | ((mn[j + 4] & 0xf) << 4));
  }
}

void UnpackQ4KScale(int j, const uint8_t* s, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void QuantizeQ4K(const float* x, BlockQ4K* y, int64_t nblocks) {
  for (int64_t b = 0; b < nblocks; ++b, x += kQKK) {
    uint8_t levels[kQKK];
    float scales[8], mins[8];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
      const float* xs = x + 32 * j;
      // Weight each value by its size plus the sub-block's rms, so large values are kept
      // accurately without ignoring the small ones.
      float sum2 = 0;
      for (int i = 0; i < 32; ++i) sum2 += xs[i] * xs[i];
      const float rms = std::sqrt(sum2 / 32);
      float w[32];
      for (int i = 0; i < 32; ++i) w[i] = rms + std::fabs(xs[i]);
      const AffineFit fit = FitAffine(xs, w, 32, 15, levels + 32 * j);
      scales[j] = fit.scale;
      mins[j] = fit.min;
      max_scale = std::max(max_scale, fit.scale);
      max_min = std::max(max_min, fit.min);
    }
    const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 8; ++j) {
      sc[j] = static_cast<uint8_t>(std::min(63, NearestInt(inv_scale * scales[j])));
      mn[j] = static_cast<uint8_t>(std::min(63, NearestInt(inv_min * mins[j])));
    }
    PackQ4KScales(sc, mn, y[b].scales);
    y[b].d = F32ToFp16(max_scale / 63.0f);
    y[b].dmin = F32ToFp16(max_min / 63.0f);
    // Requantise against the scales as stored, so rounding of the scales is compensated.
    const float d = Fp16ToF32(y[b].d);
    const float dmin = Fp16ToF32(y[b].dmin);
    for (int j = 0; j < 8; ++j) {
      const float ds = d * sc[j];
      const float dm = dmin * mn[j];
      for (int i = 0; i < 32; ++i) {
        levels[32 * j + i] =
            ds == 0.0f ? 0
                       : static_cast<uint8_t>(Clamp(NearestInt((x[32 * j + i] + dm) / ds), 0, 15));
      }
    }
    // Each 32-byte group holds two sub-blocks: the first in the low nibbles.
    for (int g = 0; g < 4; ++g) {
      for (int i = 0; i < 32; ++i) {
        y[b].qs[32 * g + i] =
            static_cast<uint8_t>(levels[64 * g + i] | (levels[64 * g + 32 + i] << 4));
      }
    }
  }
}

void DequantizeQ4K(const BlockQ4K* x, float* y, int64_t nblocks) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const float d = Fp16ToF32(x[b].d);
    const float dmin = Fp16ToF32(x[b].dmin);
    for (int g = 0; g < 4; ++g) {
      int sc0, m0, sc1, m1;
      UnpackQ4KScale(2 * g, x[b].scales, &sc0, &m0);
      UnpackQ4KScale(2 * g + 1, x[b].scales, &sc1, &m1);
      const float d0 = d * sc0, mm0 = dmin * m0, d1 = d * sc1, mm1 = dmin * m1;
      const uint8_t* q = x[b].qs + 32 * g;
      for (int i = 0; i < 32; ++i) *y++ = d0 * (q[i] & 0xf) - mm0;
      for (int i = 0; i < 32; ++i) *y++ = d1 * (q[i] >> 4) - mm1;
    }
  }
}

// ---- Q6_K ----------------------------------------------------------------------------------

// Fits x ~ scale * L with L in [-nmax, nmax - 1], weights x^2. The value of largest magnitude
// is aimed at -nmax (the level without a positive twin), so the scale's sign follows it. Tries
// grids with nmax + t levels to that value, t in [-0.9, 0.9], keeping the least-squares best.
float FitSymmetric(const float* x, int n, int nmax) {
  float amax = 0, max = 0;
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  if (amax < 1e-15f) return 0.0f;
  float best_scale = -max / nmax;
  float best_score = -1;  // (sum w x l)^2 / (sum w l^2): larger means smaller error
  for (int t = -9; t <= 9; ++t) {
    const float inv = -(nmax + 0.1f * t) / max;
    float sxl = 0, sl2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = Clamp(NearestInt(inv * x[i]), -nmax, nmax - 1);
      const float w = x[i] * x[i];
      sxl += w * x[i] * l;
      sl2 += w * l * l;
    }
    if (sl2 > 0 && sxl * sxl > best_score * sl2) {
      best_score = sxl * sxl / sl2;
      best_scale = sxl / sl2;
    }
  }
  return best_scale;
}

void QuantizeQ6K(const float* x, BlockQ6K* y, int64_t nblocks) {
  for (int64_t b = 0; b < nblocks; ++b, x += kQKK) {
    float scales[16];
    float max_scale = 0, max_abs = 0;
    for (int g = 0; g < 16; ++g) {
      scales[g] = FitSymmetric(x + 16 * g, 16, 32);
      if (std::fabs(scales[g]) > max_abs) {
        max_abs = std::fabs(scales[g]);
        max_scale = scales[g];
      }
    }
    std::memset(&y[b], 0, sizeof(BlockQ6K));
    if (max_abs < 1e-15f) continue;
    // Same trick one level up: the largest sub-scale maps to -128.
    const float iscale = -128.0f / max_scale;
    y[b].d = F32ToFp16(1.0f / iscale);
    for (int g = 0; g < 16; ++g) {
      y[b].scales[g] = static_cast<int8_t>(Clamp(NearestInt(iscale * scales[g]), -128, 127));
    }
    uint8_t levels[kQKK];
    const float d = Fp16ToF32(y[b].d);
    for (int g = 0; g < 16; ++g) {
      const float ds = d * y[b].scales[g];
      for (int i = 0; i < 16; ++i) {
        const int l = ds == 0.0f ? 0 : Clamp(NearestInt(x[16 * g + i] / ds), -32, 31);
        levels[16 * g + i] = static_cast<uint8_t>(l + 32);
      }
    }
    // Per 128 values: ql[l] holds values l (low nibble) and l+64 (high); ql[l+32] holds l+32
    // and l+96; qh[l] holds the top 2 bits of l, l+32, l+64, l+96 in bit pairs 0..3.
    for (int h = 0; h < 2; ++h) {
      const uint8_t* lv = levels + 128 * h;
      uint8_t* ql = y[b].ql + 64 * h;
      uint8_t* qh = y[b].qh + 32 * h;
      for (int l = 0; l < 32; ++l) {
        ql[l] = static_cast<uint8_t>((lv[l] & 0xf) | ((lv[l + 64] & 0xf) << 4));
        ql[l + 32] = static_cast<uint8_t>((lv[l + 32] & 0xf) | ((lv[l + 96] & 0xf) << 4));
        qh[l] = static_cast<uint8_t>((lv[l] >> 4) | ((lv[l + 32] >> 4) << 2) |
                                     ((lv[l + 64] >> 4) << 4) | ((lv[l + 96] >> 4) << 6));
      }
    }
  }
}

void DequantizeQ6K(const BlockQ6K* x, float* y, int64_t nblocks) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const float d = Fp16ToF32(x[b].d);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = x[b].ql + 64 * h;
      const uint8_t* qh = x[b].qh + 32 * h;
      const int8_t* sc = x[b].scales + 8 * h;
      float* out = y + 128 * h;
      for (int l = 0; l < 32; ++l) {
        const int q0 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q1 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        const int g = l / 16;
        out[l] = d * sc[g] * q0;
        out[l + 32] = d * sc[g + 2] * q1;
        out[l + 64] = d * sc[g + 4] * q2;
        out[l + 96] = d * sc[g + 6] * q3;
      }
    }
    y += kQKK;
  }
}

}  // namespace

absl::Status QuantizeRow(DType type, const float* src, void* dst, int64_t n) {
  const DTypeTraits& t = Traits(type);
  if (n < 0 || n % t.block_elems != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuantizeRow: ", n, " elements is not a multiple of the ", std::string(t.name),
                     " block size ", t.block_elems));
  }
  const int64_t nb = n / t.block_elems;
  switch (type) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return absl::OkStatus();
    case DType::kF16:
      F32ToFp16Row(src, static_cast<uint16_t*>(dst), n);
      return absl::OkStatus();
    case DType::kBF16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) out[i] = F32ToBf16(src[i]);
      return absl::OkStatus();
    }
    case DType::kQ8_0:
      QuantizeQ8_0(src, static_cast<BlockQ8_0*>(dst), nb);
      return absl::OkStatus();
    case DType::kQ4_0:
      QuantizeQ4_0(src, static_cast<BlockQ4_0*>(dst), nb);
      return absl::OkStatus();
    case DType::kMXFP4:
      QuantizeMxfp4(src, static_cast<BlockMxfp4*>(dst), nb);
      return absl::OkStatus();
    case DType::kQ4_K:
      QuantizeQ4K(src, static_cast<BlockQ4K*>(dst), nb);
      return absl::OkStatus();
    case DType::kQ6_K:
      QuantizeQ6K(src, static_cast<BlockQ6K*>(dst), nb);
      return absl::OkStatus();
    case DType::kQ8_K:
      QuantizeQ8K(src, static_cast<BlockQ8K*>(dst), nb);
      return absl::OkStatus();
    case DType::kI8:
    case DType::kFp8E4M3:
      break;  // KV-cache-only types: tandem/kernels/kv_quant.h
  }
  return absl::InvalidArgumentError(
      absl::StrCat("QuantizeRow: unsupported type ", static_cast<uint32_t>(type)));
}

void DequantizeRow(DType type, const void* src, float* dst, int64_t n) {
  const int64_t nb = n / Traits(type).block_elems;
  switch (type) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kF16:
      Fp16ToF32Row(static_cast<const uint16_t*>(src), dst, n);
      return;
    case DType::kBF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(in[i]);
      return;
    }
    case DType::kQ8_0: {
      const auto* x = static_cast<const BlockQ8_0*>(src);
      for (int64_t b = 0; b < nb; ++b) {
        const float d = Fp16ToF32(x[b].d);
        for (int j = 0; j < 32; ++j) dst[32 * b + j] = x[b].qs[j] * d;
      }
      return;
    }
    case DType::kQ4_0: {
      const auto* x = static_cast<const BlockQ4_0*>(src);
      for (int64_t b = 0; b < nb; ++b) {
        const float d = Fp16ToF32(x[b].d);
        for (int j = 0; j < 16; ++j) {
          dst[32 * b + j] = ((x[b].qs[j] & 0xf) - 8) * d;
          dst[32 * b + j + 16] = ((x[b].qs[j] >> 4) - 8) * d;
        }
      }
      return;
    }
    case DType::kMXFP4: {
      const auto* x = static_cast<const BlockMxfp4*>(src);
      for (int64_t b = 0; b < nb; ++b) {
        const float d = E8m0Half(x[b].e);
        for (int j = 0; j < 16; ++j) {
          dst[32 * b + j] = kMxfp4Values[x[b].qs[j] & 0xf] * d;
          dst[32 * b + j + 16] = kMxfp4Values[x[b].qs[j] >> 4] * d;
        }
      }
      return;
    }
    case DType::kQ4_K:
      DequantizeQ4K(static_cast<const BlockQ4K*>(src), dst, nb);
      return;
    case DType::kQ6_K:
      DequantizeQ6K(static_cast<const BlockQ6K*>(src), dst, nb);
      return;
    case DType::kQ8_K: {
      const auto* x = static_cast<const BlockQ8K*>(src);
      for (int64_t b = 0; b < nb; ++b) {
        for (int j = 0; j < kQKK; ++j) dst[kQKK * b + j] = x[b].d * x[b].qs[j];
      }
      return;
    }
    case DType::kI8:
    case DType::kFp8E4M3:
      return;  // KV-cache-only types (per-slot scales): tandem/kernels/kv_quant.h
  }
}

}  // namespace tandem::kernels
