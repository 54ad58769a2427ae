// cuBLASLt GEMM for prefill (see tandem/cuda/matmul.h).
//
// cuBLASLt is column-major. Row-major W [rows][cols] is the column-major cols x rows matrix, so
// D (rows x batch, column-major == out[batch][rows] row-major) = op(W) * X with op = transpose
// on W and none on X: the "TN" layout, which is also the one FP8 requires.
//
// cuBLASLt is loaded with dlopen at the first CublasLtGemm::Create, never linked: a process that
// has libcublasLt.so loaded at start cannot start prometheus-cpp's civetweb listener ("null
// context when constructing CivetServer"), and every service binary serves /metrics. Loading it
// RTLD_LOCAL after the listener is up, and only in a process that runs a GEMM, keeps the two
// apart; binaries thus have no link-time cuBLASLt dependency (the header is used for types only).
#include <cublasLt.h>
#include <dlfcn.h>

#include <mutex>
#include <string>

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

#define TANDEM_STR2(x) #x
#define TANDEM_STR(x) TANDEM_STR2(x)

// The cuBLASLt entry points this file calls, resolved once per process.
struct LtApi {
  decltype(&::cublasLtCreate) Create = nullptr;
  decltype(&::cublasLtDestroy) Destroy = nullptr;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic = nullptr;
  decltype(&::cublasLtMatmul) Matmul = nullptr;
};

// The soname of the cuBLASLt this file was compiled against (libcublasLt.so.13 for CUDA 13):
// its ABI is the one the declarations above describe.
constexpr char kLtSoname[] = "libcublasLt.so." TANDEM_STR(CUBLAS_VER_MAJOR);

template <typename F>
absl::Status Resolve(void* lib, const char* name, F* out) {
  dlerror();
  void* sym = dlsym(lib, name);
  if (sym == nullptr) {
    const char* err = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat(kLtSoname, " lacks ", name, ": ", err != nullptr ? err : "null symbol"));
  }
  *out = reinterpret_cast<F>(sym);
  return absl::OkStatus();
}

absl::StatusOr<const LtApi*> LoadLt() {
  static std::once_flag once;
  static LtApi api;
  static absl::Status status;
  std::call_once(once, [] {
    // Never dlclose'd: cuBLASLt keeps per-process state for as long as the process runs.
    void* lib = dlopen(kLtSoname, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* err = dlerror();
      status = absl::FailedPreconditionError(absl::StrCat(
          "cannot load ", kLtSoname, " (", err != nullptr ? err : "unknown error",
          "): the CUDA GEMM needs cuBLASLt from the CUDA toolkit; put its lib directory on "
          "LD_LIBRARY_PATH (e.g. /usr/local/cuda/lib64)"));
      return;
    }
    absl::Status st;
    auto r = [&](const char* name, auto* fn) {
      if (st.ok()) st = Resolve(lib, name, fn);
    };
    r("cublasLtCreate", &api.Create);
    r("cublasLtDestroy", &api.Destroy);
    r("cublasLtMatmulDescCreate", &api.MatmulDescCreate);
    r("cublasLtMatmulDescDestroy", &api.MatmulDescDestroy);
    r("cublasLtMatmulDescSetAttribute", &api.MatmulDescSetAttribute);
    r("cublasLtMatrixLayoutCreate", &api.MatrixLayoutCreate);
    r("cublasLtMatrixLayoutDestroy", &api.MatrixLayoutDestroy);
    r("cublasLtMatmulPreferenceCreate", &api.MatmulPreferenceCreate);
    r("cublasLtMatmulPreferenceDestroy", &api.MatmulPreferenceDestroy);
    r("cublasLtMatmulPreferenceSetAttribute", &api.MatmulPreferenceSetAttribute);
    r("cublasLtMatmulAlgoGetHeuristic", &api.MatmulAlgoGetHeuristic);
    r("cublasLtMatmul", &api.Matmul);
    status = st;
  });
  if (!status.ok()) return status;
  return &api;
}

// Only reached after a successful Create, which loaded the table.
const LtApi& Lt() { return **LoadLt(); }

// Owns the descriptors of one call.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    const LtApi& lt = Lt();
    if (pref) lt.MatmulPreferenceDestroy(pref);
    if (c) lt.MatrixLayoutDestroy(c);
    if (b) lt.MatrixLayoutDestroy(b);
    if (a) lt.MatrixLayoutDestroy(a);
    if (op) lt.MatmulDescDestroy(op);
  }
};

}  // namespace

absl::Status CublasLtAvailable() { return LoadLt().status(); }

absl::StatusOr<std::unique_ptr<CublasLtGemm>> CublasLtGemm::Create(size_t workspace_bytes) {
  absl::StatusOr<const LtApi*> api = LoadLt();
  if (!api.ok()) return api.status();
  cublasLtHandle_t handle = nullptr;
  TANDEM_RETURN_IF_CUBLAS((*api)->Create(&handle));
  void* ws = nullptr;
  if (workspace_bytes > 0) {
    const cudaError_t e = cudaMalloc(&ws, workspace_bytes);
    if (e != cudaSuccess) {
      (*api)->Destroy(handle);
      return internal::FromCudaError(e, "CublasLtGemm workspace", __FILE__, __LINE__);
    }
  }
  return std::unique_ptr<CublasLtGemm>(new CublasLtGemm(handle, ws, workspace_bytes));
}

CublasLtGemm::~CublasLtGemm() {
  if (workspace_ != nullptr) cudaFree(workspace_);
  Lt().Destroy(handle_);
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
  const LtApi& lt = Lt();
  const cudaDataType_t in_type = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  Descs d;
  TANDEM_RETURN_IF_CUBLAS(lt.MatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  TANDEM_RETURN_IF_CUBLAS(
      lt.MatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  TANDEM_RETURN_IF_CUBLAS(
      lt.MatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (fp8) {
    TANDEM_RETURN_IF_CUBLAS(lt.MatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                      &w_scale, sizeof(w_scale)));
    TANDEM_RETURN_IF_CUBLAS(lt.MatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                      &x_scale, sizeof(x_scale)));
  }
  TANDEM_RETURN_IF_CUBLAS(lt.MatrixLayoutCreate(&d.a, in_type, cols, rows, cols));
  TANDEM_RETURN_IF_CUBLAS(lt.MatrixLayoutCreate(&d.b, in_type, cols, batch, cols));
  TANDEM_RETURN_IF_CUBLAS(lt.MatrixLayoutCreate(&d.c, CUDA_R_32F, rows, batch, rows));
  TANDEM_RETURN_IF_CUBLAS(lt.MatmulPreferenceCreate(&d.pref));
  TANDEM_RETURN_IF_CUBLAS(
      lt.MatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                      &workspace_bytes_, sizeof(workspace_bytes_)));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  TANDEM_RETURN_IF_CUBLAS(
      lt.MatmulAlgoGetHeuristic(handle_, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &heur, &found));
  if (found == 0) {
    return absl::UnimplementedError(absl::StrCat("CublasLtGemm: no cuBLASLt algorithm for ",
                                                 fp8 ? "fp8" : "bf16", " ", rows, "x", cols,
                                                 " batch ", batch));
  }
  const float alpha = 1.0f, beta = 0.0f;
  TANDEM_RETURN_IF_CUBLAS(lt.Matmul(handle_, d.op, &alpha, w, d.a, x, d.b, &beta, out, d.c, out,
                                    d.c, &heur.algo, workspace_, workspace_bytes_, stream));
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
