// AVX2 + FMA + F16C matmul tiles (this file is compiled with -mavx2 -mfma -mf16c and only
// called when the CPU has them).
#define TANDEM_TILES_VNNI 0
#include "matmul_x86_tiles.h"

namespace tandem::kernels::internal::avx2 {

TileKernels GetTileKernels() {
  TileKernels k;
  k.f32 = TileF32x86;
  k.f16 = TileF16x86;
  k.bf16 = TileBf16x86;
  k.q8_0 = TileQ8_0x86;
  k.q4_0 = TileQ4_0x86;
  k.mxfp4 = TileMxfp4x86;
  k.q4_k = TileQ4Kx86;
  k.q6_k = TileQ6Kx86;
  return k;
}

}  // namespace tandem::kernels::internal::avx2
