// Element types of weights and activations, numbered as GGUF numbers them (ggml_type), so a
// tensor's type field converts directly. Pure data: no allocation, thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace tandem::kernels {

enum class DType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ6_K = 14,
  kQ8_K = 15,  // activation-only type used by the K-quant dot products
  kBF16 = 30,
  kMXFP4 = 39,
  // KV-cache-only types (tandem/kernels/kv_quant.h: codes plus per-slot scales), numbered
  // outside ggml's range; GetDTypeTraits (the GGUF path) never returns them.
  kI8 = 1024,
  kFp8E4M3 = 1025,
};

struct DTypeTraits {
  DType type;
  std::string_view name;  // the GGUF/ggml spelling, e.g. "q4_K"
  int64_t block_elems;    // elements per block (1 for plain floats)
  int64_t block_bytes;    // bytes per block
};

// Elements per K-quant super-block.
inline constexpr int64_t kQK_K = 256;

// Traits of a known type; nullopt for a type id tandem does not support.
std::optional<DTypeTraits> GetDTypeTraits(uint32_t type_id);
const DTypeTraits& Traits(DType type);

// Type from its name ("f32", "q4_0", "Q4_K", case-insensitive); nullopt when unknown.
std::optional<DType> DTypeFromName(std::string_view name);

// Bytes of a row of n elements; n must be a multiple of the block size (checked by callers:
// RowBytesChecked returns nullopt otherwise, and on overflow).
std::optional<uint64_t> RowBytesChecked(DType type, uint64_t n);
inline uint64_t RowBytes(DType type, uint64_t n) {
  const DTypeTraits& t = Traits(type);
  return n / t.block_elems * t.block_bytes;
}

}  // namespace tandem::kernels
