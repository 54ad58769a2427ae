#include "tandem/kernels/cpu_features.h"

#include <atomic>

namespace tandem::kernels {
namespace {

Isa Detect() {
#if TANDEM_KERNELS_X86
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
#if !defined(__clang__)  // clang 14 (the fuzz build) has no "f16c"; every AVX2 CPU has F16C
        && __builtin_cpu_supports("f16c")
#endif
            )) {
    return Isa::kScalar;
  }
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni"))) {
    return Isa::kAvx2;
  }
  if (!__builtin_cpu_supports("avx512bf16")) return Isa::kAvx512;
  return Isa::kAvx512Bf16;
#else
  return Isa::kScalar;
#endif
}

std::atomic<int> g_cap{static_cast<int>(Isa::kAvx512Bf16)};

}  // namespace

Isa DetectedIsa() {
  static const Isa detected = Detect();
  return detected;
}

Isa ActiveIsa() {
  const int cap = g_cap.load(std::memory_order_relaxed);
  const int detected = static_cast<int>(DetectedIsa());
  return static_cast<Isa>(cap < detected ? cap : detected);
}

void SetIsaCapForTesting(Isa cap) { g_cap.store(static_cast<int>(cap), std::memory_order_relaxed); }

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

}  // namespace tandem::kernels
