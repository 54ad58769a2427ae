// Private to kernels/cuda: CUDA error conversion, launch checks and warp/block reductions.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tandem::kernels::cuda::internal {

// The one conversion of the CUDA runtime's error space into absl::Status.
inline absl::Status FromCudaError(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ") at ", file, ":", line));
}

// Status of the launch just made (configuration errors only; execution errors surface later).
#define TANDEM_CUDA_LAUNCH_STATUS(what) \
  ::tandem::kernels::cuda::internal::FromCudaError(cudaGetLastError(), what, __FILE__, __LINE__)
#define TANDEM_CUDA_CALL(expr) \
  ::tandem::kernels::cuda::internal::FromCudaError((expr), #expr, __FILE__, __LINE__)
#define TANDEM_RETURN_IF_CUDA(expr)                       \
  do {                                                    \
    ::absl::Status _tandem_cst = TANDEM_CUDA_CALL(expr);  \
    if (!_tandem_cst.ok()) return _tandem_cst;            \
  } while (0)

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds 32 floats; blockDim.x
// is a multiple of 32. Contains __syncthreads, so every thread must call it.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.0f;
  return WarpSum(v);
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : -INFINITY;
  return WarpMax(v);
}

// Element loads as float for the two KV cache types.
__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }

// 16 bytes of T unpacked into floats (4 for float, 8 for half).
template <typename T>
struct Vec16;
template <>
struct Vec16<float> {
  static constexpr int kN = 4;
  __device__ __forceinline__ static void Unpack(const uint4& u, float* out) {
    out[0] = __uint_as_float(u.x);
    out[1] = __uint_as_float(u.y);
    out[2] = __uint_as_float(u.z);
    out[3] = __uint_as_float(u.w);
  }
};
template <>
struct Vec16<__half> {
  static constexpr int kN = 8;
  __device__ __forceinline__ static void Unpack(const uint4& u, float* out) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &w[i], 4);
      const float2 f = __half22float2(h);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

inline int CeilDiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace tandem::kernels::cuda::internal
