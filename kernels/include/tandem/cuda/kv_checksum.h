// KV block checksums on the GPU: the algorithm of tandem/kernels/kv_checksum.h, bit-identical to
// kernels::KvBlockChecksumsReference and to the CPU checksum of services/common/kv_layout.h, so
// decode can verify on the device what prefill checksummed anywhere.
// One thread block per KV block; each thread sums its share of the words and the integer sums
// are reduced in any order (addition mod 2^64 is associative, so the result is exact).
// Ownership: every pointer of KvChecksumParams (pool, blocks, num_slots, out) is device memory
// owned by the caller. Threading and errors: see cuda_common.h (INVALID_ARGUMENT for a null
// pointer or a negative count).
#pragma once

#include "tandem/cuda/cuda_common.h"
#include "tandem/kernels/kv_checksum.h"

namespace tandem::kernels::cuda {

absl::Status KvBlockChecksums(const KvChecksumParams& p, Stream stream);

}  // namespace tandem::kernels::cuda
