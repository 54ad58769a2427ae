// Weight x activation products on the GPU: quantised GEMV for decode and cuBLASLt GEMM for
// prefill. Both compute out[b][r] = sum_c W[r][c] * x[b][c] with W row-major (GGUF rows).
//
// QuantGemv reads GGUF block rows as they are stored (Q8_0, Q4_0, Q4_K, MXFP4) and float
// activations, dequantising in registers and accumulating in float: one warp per weight row,
// each lane taking 32-element units, so the weights are streamed once per call for up to 8
// activation rows. It is checked against kernels::MatmulReference (dequantise, sum in double).
// CublasLtGemm runs BF16 x BF16 -> F32 on any sm_80+ GPU and FP8 e4m3 x e4m3 -> F32 with
// per-tensor scales where the GPU has FP8 tensor cores (sm_89+).
// Ownership: device pointers owned by the caller; CublasLtGemm owns its cuBLASLt handle and
// workspace. Threading: QuantGemv and the converters are thread-safe; one CublasLtGemm must not
// be used from two threads at once (its workspace is shared by its calls). Errors: see
// cuda_common.h; cuBLASLt failures are INTERNAL with the cuBLAS status name.
// cuBLASLt is loaded with dlopen at the first CublasLtGemm::Create (gemm.cu says why), so no
// binary depends on it at link time; a missing library is FAILED_PRECONDITION from Create.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "tandem/cuda/cuda_common.h"
#include "tandem/kernels/dtype.h"

struct cublasLtContext;

namespace tandem::kernels::cuda {

inline constexpr int kMaxGemvBatch = 8;

struct GemvParams {
  DType weight_type = DType::kQ8_0;  // kQ8_0, kQ4_0, kQ4_K or kMXFP4
  const void* weight = nullptr;      // rows x RowBytes(weight_type, cols) bytes
  int64_t rows = 0;
  int64_t cols = 0;  // a multiple of the type's block size
  const float* input = nullptr;
  int64_t input_stride = 0;  // floats between activation rows (0: cols)
  int32_t batch = 1;         // 1..kMaxGemvBatch
  float* output = nullptr;
  int64_t output_stride = 0;  // floats between output rows (0: rows)
};

absl::Status QuantGemv(const GemvParams& p, Stream stream);

// Round-to-nearest-even conversions of float activations for the GEMM inputs.
absl::Status ConvertF32ToBf16(const float* x, uint16_t* out, int64_t n, Stream stream);
// out = e4m3(x * inv_scale), saturating to +-448 (the format's largest finite value).
absl::Status ConvertF32ToFp8E4m3(const float* x, uint8_t* out, int64_t n, float inv_scale,
                                 Stream stream);

// OK when cuBLASLt loads and has every entry point the GEMM calls (loads it on first call).
absl::Status CublasLtAvailable();

class CublasLtGemm {
 public:
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;
  static absl::StatusOr<std::unique_ptr<CublasLtGemm>> Create(
      size_t workspace_bytes = kDefaultWorkspaceBytes);
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // True when the current device runs the FP8 path (compute capability 8.9 or newer).
  static bool DeviceHasFp8(const DeviceInfo& d) {
    return d.sm_major > 8 || (d.sm_major == 8 && d.sm_minor >= 9);
  }

  // W bf16 [rows][cols], x bf16 [batch][cols], out f32 [batch][rows] (packed rows).
  absl::Status Bf16(const uint16_t* w, const uint16_t* x, float* out, int64_t rows, int64_t cols,
                    int64_t batch, Stream stream);
  // W and x e4m3 (same layouts), out = (*w_scale) * (*x_scale) * W x, scales device floats.
  // cols must be a multiple of 16 and the pointers 16-byte aligned (cuBLASLt's FP8 rules).
  absl::Status Fp8(const uint8_t* w, const float* w_scale, const uint8_t* x, const float* x_scale,
                   float* out, int64_t rows, int64_t cols, int64_t batch, Stream stream);

 private:
  CublasLtGemm(cublasLtContext* handle, void* workspace, size_t workspace_bytes)
      : handle_(handle), workspace_(workspace), workspace_bytes_(workspace_bytes) {}
  absl::Status Run(bool fp8, const void* w, const float* w_scale, const void* x,
                   const float* x_scale, float* out, int64_t rows, int64_t cols, int64_t batch,
                   Stream stream);

  cublasLtContext* handle_;
  void* workspace_;
  size_t workspace_bytes_;
};

}  // namespace tandem::kernels::cuda
