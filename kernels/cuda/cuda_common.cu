#include "tandem/cuda/cuda_common.h"

#include "cuda_util.cuh"

namespace tandem::kernels::cuda {

int VisibleDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver/device" error for later calls
    return 0;
  }
  return n;
}

absl::StatusOr<DeviceInfo> CurrentDevice() {
  DeviceInfo info;
  TANDEM_RETURN_IF_CUDA(cudaGetDevice(&info.ordinal));
  TANDEM_RETURN_IF_CUDA(
      cudaDeviceGetAttribute(&info.sm_major, cudaDevAttrComputeCapabilityMajor, info.ordinal));
  TANDEM_RETURN_IF_CUDA(
      cudaDeviceGetAttribute(&info.sm_minor, cudaDevAttrComputeCapabilityMinor, info.ordinal));
  TANDEM_RETURN_IF_CUDA(
      cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, info.ordinal));
  size_t free_b = 0, total_b = 0;
  TANDEM_RETURN_IF_CUDA(cudaMemGetInfo(&free_b, &total_b));
  info.global_memory_bytes = static_cast<int64_t>(total_b);
  return info;
}

}  // namespace tandem::kernels::cuda
