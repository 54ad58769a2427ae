#include "tandem/kernels/dtype.h"

#include <array>
#include <cctype>
#include <limits>

namespace tandem::kernels {
namespace {

constexpr std::array<DTypeTraits, 11> kTraits = {{
    {DType::kF32, "f32", 1, 4},
    {DType::kF16, "f16", 1, 2},
    {DType::kQ4_0, "q4_0", 32, 2 + 16},
    {DType::kQ8_0, "q8_0", 32, 2 + 32},
    {DType::kQ4_K, "q4_K", kQK_K, 2 + 2 + 12 + kQK_K / 2},
    {DType::kQ6_K, "q6_K", kQK_K, kQK_K / 2 + kQK_K / 4 + kQK_K / 16 + 2},
    {DType::kQ8_K, "q8_K", kQK_K, 4 + kQK_K + kQK_K / 16 * 2},
    {DType::kBF16, "bf16", 1, 2},
    {DType::kMXFP4, "mxfp4", 32, 1 + 16},
    // Codes only: a KV slot's scales are counted by KvQuantSlotBytes, not here.
    {DType::kI8, "int8", 1, 1},
    {DType::kFp8E4M3, "fp8", 1, 1},
}};

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  }
  return true;
}

}  // namespace

std::optional<DTypeTraits> GetDTypeTraits(uint32_t type_id) {
  if (type_id >= static_cast<uint32_t>(DType::kI8)) return std::nullopt;  // KV-only types
  for (const auto& t : kTraits) {
    if (static_cast<uint32_t>(t.type) == type_id) return t;
  }
  return std::nullopt;
}

const DTypeTraits& Traits(DType type) {
  for (const auto& t : kTraits) {
    if (t.type == type) return t;
  }
  return kTraits[0];  // unreachable for valid enum values
}

std::optional<DType> DTypeFromName(std::string_view name) {
  for (const auto& t : kTraits) {
    if (EqualsIgnoreCase(t.name, name)) return t.type;
  }
  return std::nullopt;
}

std::optional<uint64_t> RowBytesChecked(DType type, uint64_t n) {
  const DTypeTraits& t = Traits(type);
  if (n % t.block_elems != 0) return std::nullopt;
  const uint64_t blocks = n / t.block_elems;
  if (blocks > std::numeric_limits<uint64_t>::max() / t.block_bytes) return std::nullopt;
  return blocks * t.block_bytes;
}

}  // namespace tandem::kernels
