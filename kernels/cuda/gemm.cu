// cuBLASLt GEMM for prefill (see tandem/cuda/matmul.h).
//
// cuBLASLt is column-major. Row-major W [rows][cols] is the column-major cols x rows matrix, so
// D (rows x batch, column-major == out[batch][rows] row-major) = op(W) * X with op = transpose
// on W and none on X: the "TN" layout, which is also the one FP8 requires.
#include <cublasLt.h>

#include "cuda_util.cuh"
#include "tandem/cuda/matmul.h"

namespace tandem::kernels::cuda {
namespace {

absl::Status FromCublas(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": cuBLAS status ", static_cast<int>(s)));
}

#define TANDEM_RETURN_IF_CUBLAS(expr)                         \
  do {                                                        \
    ::absl::Status _tandem_bst = FromCublas((expr), #expr);   \
    if (!_tandem_bst.ok()) return _tandem_bst;                \
  } while (0)

// Owns the descriptors of one call.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<CublasLtGemm>> CublasLtGemm::Create(size_t workspace_bytes) {
  cublasLtHandle_t handle = nullptr;
  TANDEM_RETURN_IF_CUBLAS(cublasLtCreate(&handle));
  void* ws = nullptr;
  if (workspace_bytes > 0) {
    const cudaError_t e = cudaMalloc(&ws, workspace_bytes);
    if (e != cudaSuccess) {
      cublasLtDestroy(handle);
      return internal::FromCudaError(e, "CublasLtGemm workspace", __FILE__, __LINE__);
    }
  }
  return std::unique_ptr<CublasLtGemm>(new CublasLtGemm(handle, ws, workspace_bytes));
}

CublasLtGemm::~CublasLtGemm() {
  if (workspace_ != nullptr) cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

absl::Status CublasLtGemm::Bf16(const uint16_t* w, const uint16_t* x, float* out, int64_t rows,
                                int64_t cols, int64_t batch, Stream stream) {
  return Run(false, w, nullptr, x, nullptr, out, rows, cols, batch, stream);
}

absl::Status CublasLtGemm::Fp8(const uint8_t* w, const float* w_scale, const uint8_t* x,
                               const float* x_scale, float* out, int64_t rows, int64_t cols,
                               int64_t batch, Stream stream) {
  if (cols % 16 != 0 || !internal::Aligned16(w) || !internal::Aligned16(x) ||
      !internal::Aligned16(out) || w_scale == nullptr || x_scale == nullptr) {
    return absl::InvalidArgumentError(
        "CublasLtGemm::Fp8: cols must be a multiple of 16, pointers 16-byte aligned, scales set");
  }
  return Run(true, w, w_scale, x, x_scale, out, rows, cols, batch, stream);
}

absl::Status CublasLtGemm::Run(bool fp8, const void* w, const float* w_scale, const void* x,
                               const float* x_scale, float* out, int64_t rows, int64_t cols,
                               int64_t batch, Stream stream) {
  if (rows <= 0 || cols <= 0 || batch <= 0) {
    return absl::InvalidArgumentError("CublasLtGemm: empty or negative shape");
  }
  const cudaDataType_t in_type = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  Descs d;
  TANDEM_RETURN_IF_CUBLAS(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  TANDEM_RETURN_IF_CUBLAS(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  TANDEM_RETURN_IF_CUBLAS(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (fp8) {
    TANDEM_RETURN_IF_CUBLAS(cublasLtMatmulDescSetAttribute(
        d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof(w_scale)));
    TANDEM_RETURN_IF_CUBLAS(cublasLtMatmulDescSetAttribute(
        d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale, sizeof(x_scale)));
  }
  TANDEM_RETURN_IF_CUBLAS(cublasLtMatrixLayoutCreate(&d.a, in_type, cols, rows, cols));
  TANDEM_RETURN_IF_CUBLAS(cublasLtMatrixLayoutCreate(&d.b, in_type, cols, batch, cols));
  TANDEM_RETURN_IF_CUBLAS(cublasLtMatrixLayoutCreate(&d.c, CUDA_R_32F, rows, batch, rows));
  TANDEM_RETURN_IF_CUBLAS(cublasLtMatmulPreferenceCreate(&d.pref));
  TANDEM_RETURN_IF_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_,
      sizeof(workspace_bytes_)));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  TANDEM_RETURN_IF_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle_, d.op, d.a, d.b, d.c, d.c,
                                                         d.pref, 1, &heur, &found));
  if (found == 0) {
    return absl::UnimplementedError(absl::StrCat("CublasLtGemm: no cuBLASLt algorithm for ",
                                                 fp8 ? "fp8" : "bf16", " ", rows, "x", cols,
                                                 " batch ", batch));
  }
  const float alpha = 1.0f, beta = 0.0f;
  TANDEM_RETURN_IF_CUBLAS(cublasLtMatmul(handle_, d.op, &alpha, w, d.a, x, d.b, &beta, out, d.c,
                                         out, d.c, &heur.algo, workspace_, workspace_bytes_,
                                         stream));
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
