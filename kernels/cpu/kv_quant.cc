#include "tandem/kernels/kv_quant.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>

namespace tandem::kernels {
namespace {

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const char x = (a[i] >= 'A' && a[i] <= 'Z') ? char(a[i] - 'A' + 'a') : a[i];
    if (x != b[i]) return false;
  }
  return true;
}

float Fp8Decode(uint8_t c) {
  const bool neg = (c & 0x80) != 0;
  const int e = (c >> 3) & 0xf;
  const int m = c & 0x7;
  float v;
  if (e == 0xf && m == 0x7) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), -9);  // subnormal: m/8 * 2^-6
  } else {
    v = std::ldexp(static_cast<float>(8 + m), e - 10);  // (1 + m/8) * 2^(e-7)
  }
  return neg ? -v : v;
}

// Decoding is a 256-entry table built once (the codes are a byte).
const std::array<float, 256>& Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = Fp8Decode(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

// max |x| over the finite elements.
float FiniteAbsMax(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a <= std::numeric_limits<float>::max() && a > amax) amax = a;  // skips NaN and inf
  }
  return amax;
}

}  // namespace

std::optional<DType> KvTypeFromName(std::string_view name) {
  if (EqualsIgnoreCase(name, "f32")) return DType::kF32;
  if (EqualsIgnoreCase(name, "f16")) return DType::kF16;
  if (EqualsIgnoreCase(name, "int8") || EqualsIgnoreCase(name, "i8")) return DType::kI8;
  if (EqualsIgnoreCase(name, "fp8") || EqualsIgnoreCase(name, "fp8_e4m3") ||
      EqualsIgnoreCase(name, "e4m3")) {
    return DType::kFp8E4M3;
  }
  return std::nullopt;
}

std::string_view KvTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kI8: return "int8";
    case DType::kFp8E4M3: return "fp8";
    default: return Traits(t).name;
  }
}

uint8_t F32ToFp8E4M3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t abs = u & 0x7fffffff;
  if (abs > 0x7f800000) return sign | kFp8E4M3NaN;
  if (abs >= 0x43e00000) return sign | 0x7e;  // |f| >= 448 (and inf): saturate
  if (abs < 0x3c800000) {
    // Below the smallest normal 2^-6: multiples of 2^-9. The scaling by 2^9 is exact, and
    // nearbyint rounds ties to even in the default rounding mode; 8 is the smallest normal's
    // code (exponent 1, mantissa 0), so the carry needs no special case.
    float a;
    std::memcpy(&a, &abs, 4);
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  }
  // Normal: keep 3 of the 23 mantissa bits, rounding the 20 dropped ones to nearest even. A
  // mantissa carry moves into the exponent field, which is the right result.
  const int32_t e = static_cast<int32_t>(abs >> 23) - 127 + 7;  // 1 .. 15
  uint32_t bits = (static_cast<uint32_t>(e) << 23) | (abs & 0x7fffff);
  bits += 0x7ffff + ((bits >> 20) & 1);
  const uint32_t code = bits >> 20;
  // 448 < |f| < 464 rounds down to 448 already; 0x7f (a carry past 448) cannot occur because
  // the saturating compare above caught |f| >= 448.
  return sign | static_cast<uint8_t>(code);
}

float Fp8E4M3ToF32(uint8_t code) { return Fp8Table()[code]; }

float QuantizeRowInt8(const float* x, int64_t n, int8_t* codes) {
  const float scale = FiniteAbsMax(x, n) / kInt8KvMax;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    float q;
    if (std::isnan(v)) {
      nan = true;
      q = 0.0f;
    } else if (std::isinf(v)) {
      q = v > 0 ? kInt8KvMax : -kInt8KvMax;
    } else if (scale == 0.0f) {
      q = 0.0f;
    } else {
      q = std::nearbyint(v / scale);
      q = q > kInt8KvMax ? kInt8KvMax : (q < -kInt8KvMax ? -kInt8KvMax : q);
    }
    codes[i] = static_cast<int8_t>(q);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : scale;
}

float QuantizeRowFp8E4M3(const float* x, int64_t n, uint8_t* codes) {
  const float scale = FiniteAbsMax(x, n) / kFp8E4M3Max;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (scale == 0.0f && std::isfinite(v)) {
      codes[i] = std::signbit(v) ? 0x80 : 0x00;
    } else {
      // inf / scale stays inf and saturates; NaN stays NaN.
      codes[i] = F32ToFp8E4M3(scale == 0.0f ? v : v / scale);
    }
  }
  return scale;
}

void DequantizeRowInt8(const int8_t* codes, float scale, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(codes[i]) * scale;
}

void DequantizeRowFp8E4M3(const uint8_t* codes, float scale, int64_t n, float* out) {
  const std::array<float, 256>& t = Fp8Table();
  for (int64_t i = 0; i < n; ++i) out[i] = t[codes[i]] * scale;
}

void QuantizeKvSlot(DType type, const float* x, int64_t n_kv_head, int64_t head_dim,
                    uint8_t* slot) {
  const int64_t code_bytes = KvQuantCodeBytes(n_kv_head, head_dim);
  // Padding bytes are zeroed so a slot's bytes (and so block checksums) depend only on x.
  std::memset(slot + n_kv_head * head_dim, 0, code_bytes - n_kv_head * head_dim);
  for (int64_t h = 0; h < n_kv_head; ++h) {
    const float* xh = x + h * head_dim;
    uint8_t* ch = slot + h * head_dim;
    const float scale = type == DType::kI8
                            ? QuantizeRowInt8(xh, head_dim, reinterpret_cast<int8_t*>(ch))
                            : QuantizeRowFp8E4M3(xh, head_dim, ch);
    std::memcpy(slot + code_bytes + 4 * h, &scale, 4);
  }
}

void DequantizeKvSlot(DType type, const uint8_t* slot, int64_t n_kv_head, int64_t head_dim,
                      float* out) {
  const int64_t code_bytes = KvQuantCodeBytes(n_kv_head, head_dim);
  for (int64_t h = 0; h < n_kv_head; ++h) {
    float scale;
    std::memcpy(&scale, slot + code_bytes + 4 * h, 4);
    if (type == DType::kI8) {
      DequantizeRowInt8(reinterpret_cast<const int8_t*>(slot + h * head_dim), scale, head_dim,
                        out + h * head_dim);
    } else {
      DequantizeRowFp8E4M3(slot + h * head_dim, scale, head_dim, out + h * head_dim);
    }
  }
}

}  // namespace tandem::kernels
