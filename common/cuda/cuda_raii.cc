#include "common/cuda/cuda_raii.h"

#include "absl/strings/str_cat.h"

namespace tandem::cuda {

absl::Status FromCudaError(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
                                       ") at ", file, ":", line);
  cudaGetLastError();  // the error is reported here; later calls must not see it again
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device: ", msg));
  }
  return absl::InternalError(msg);
}

int VisibleDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

absl::Status RequireDevice() {
  if (VisibleDeviceCount() > 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "no CUDA device is visible (no NVIDIA driver, no GPU, or CUDA_VISIBLE_DEVICES hides them)");
}

absl::StatusOr<CudaStream> CudaStream::Create() {
  CudaStream s;
  TANDEM_CUDA_RETURN_IF(cudaStreamCreateWithFlags(&s.s_, cudaStreamNonBlocking));
  return s;
}
void CudaStream::Reset() {
  if (s_ != nullptr) cudaStreamDestroy(s_);
  s_ = nullptr;
}

absl::StatusOr<CudaEvent> CudaEvent::Create() {
  CudaEvent e;
  TANDEM_CUDA_RETURN_IF(cudaEventCreateWithFlags(&e.e_, cudaEventDisableTiming));
  return e;
}
void CudaEvent::Reset() {
  if (e_ != nullptr) cudaEventDestroy(e_);
  e_ = nullptr;
}

absl::StatusOr<PinnedHostBuffer> PinnedHostBuffer::Create(size_t bytes) {
  PinnedHostBuffer b;
  if (bytes == 0) return b;
  TANDEM_CUDA_RETURN_IF(cudaHostAlloc(b.out(), bytes, cudaHostAllocPortable));
  b.set_size(bytes);
  return b;
}

absl::StatusOr<DeviceMemory> DeviceMemory::Create(size_t bytes) {
  DeviceMemory m;
  if (bytes == 0) return m;
  TANDEM_CUDA_RETURN_IF(cudaMalloc(m.out(), bytes));
  m.set_size(bytes);
  return m;
}

PointerKind ClassifyPointer(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  return {a.type == cudaMemoryTypeDevice, a.device};
}

}  // namespace tandem::cuda
