// Which x86 SIMD level the CPU kernels use. Detected once from CPUID (through the compiler's
// __builtin_cpu_supports, which also checks that the OS saves the wide registers); every
// dispatching kernel (Matmul, the fp16 row conversions, SwiGlu) asks ActiveIsa() per call.
// Thread-safe: the cap is an atomic, meant to be set by tests between kernel calls.
#pragma once

namespace tandem::kernels {

// Ordered: each level implies the ones below it.
enum class Isa : int {
  kScalar = 0,
  kAvx2 = 1,        // AVX2 + FMA + F16C
  kAvx512 = 2,      // AVX-512 F/BW/VL/DQ + VNNI
  kAvx512Bf16 = 3,  // kAvx512 + AVX512_BF16
};

// The best level this CPU supports.
Isa DetectedIsa();

// min(DetectedIsa(), cap): what the kernels run.
Isa ActiveIsa();

// Caps the level kernels use, so tests can run every code path present on the machine.
// Pass Isa::kAvx512Bf16 to lift the cap.
void SetIsaCapForTesting(Isa cap);

const char* IsaName(Isa isa);

}  // namespace tandem::kernels
