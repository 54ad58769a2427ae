// Non-copyable owners of CUDA runtime objects for host code outside kernels/ (transports, the
// workers' device KV paths): a stream, an event, pinned host memory and device memory, plus the
// one conversion of cudaError_t into absl::Status for that code.
//
// Ownership: each wrapper owns its handle and releases it in its destructor; moving transfers
// ownership. Threading: the wrappers are as thread-safe as the CUDA runtime (every call may come
// from any thread); callers pick the device with cudaSetDevice before creating them.
// Errors: Create returns INTERNAL with the CUDA error name, text and file:line,
// RESOURCE_EXHAUSTED when memory runs out, FAILED_PRECONDITION "no CUDA device" when there is
// no usable device (no driver, no GPU, or CUDA_VISIBLE_DEVICES hides them).
// Built only with CUDA (TANDEM_CUDA, the top-level CMakeLists.txt).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::cuda {

absl::Status FromCudaError(cudaError_t e, const char* what, const char* file, int line);

#define TANDEM_CUDA_RETURN_IF(expr)                                       \
  do {                                                                    \
    ::absl::Status _tandem_cuda_st =                                      \
        ::tandem::cuda::FromCudaError((expr), #expr, __FILE__, __LINE__); \
    if (!_tandem_cuda_st.ok()) return _tandem_cuda_st;                    \
  } while (0)

// Visible devices; 0 (not an error) without a driver or device. Clears the sticky error.
int VisibleDeviceCount();
// OK, or FAILED_PRECONDITION whose message starts with "no CUDA device".
absl::Status RequireDevice();

class CudaStream {
 public:
  // A non-blocking stream (no implicit sync with the legacy default stream) on the current
  // device.
  static absl::StatusOr<CudaStream> Create();
  CudaStream() = default;
  ~CudaStream() { Reset(); }
  CudaStream(CudaStream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  CudaStream& operator=(CudaStream&& o) noexcept {
    if (this != &o) {
      Reset();
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  void Reset();
  cudaStream_t s_ = nullptr;
};

class CudaEvent {
 public:
  // Timing disabled: the cheapest event, for completion only.
  static absl::StatusOr<CudaEvent> Create();
  CudaEvent() = default;
  ~CudaEvent() { Reset(); }
  CudaEvent(CudaEvent&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& o) noexcept {
    if (this != &o) {
      Reset();
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return e_; }

 private:
  void Reset();
  cudaEvent_t e_ = nullptr;
};

// Owns size() bytes that Free (cudaFree, cudaFreeHost) releases; moves, never copies.
template <cudaError_t (*Free)(void*)>
class CudaBytes {
 public:
  CudaBytes() = default;
  ~CudaBytes() { Reset(); }
  CudaBytes(CudaBytes&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  CudaBytes& operator=(CudaBytes&& o) noexcept {
    if (this != &o) {
      Reset();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  CudaBytes(const CudaBytes&) = delete;
  CudaBytes& operator=(const CudaBytes&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(p_); }
  size_t size() const { return n_; }

 protected:
  void** out() { return &p_; }  // for the allocation call in Create
  void set_size(size_t n) { n_ = n; }

 private:
  void Reset() {
    if (p_ != nullptr) Free(p_);
    p_ = nullptr;
    n_ = 0;
  }
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Page-locked host memory (cudaHostAlloc), so copies to and from the device run at full speed
// and can be asynchronous.
class PinnedHostBuffer : public CudaBytes<cudaFreeHost> {
 public:
  static absl::StatusOr<PinnedHostBuffer> Create(size_t bytes);
};

class DeviceMemory : public CudaBytes<cudaFree> {
 public:
  static absl::StatusOr<DeviceMemory> Create(size_t bytes);
};

// Whether `p` is device memory (cudaMalloc or an IPC mapping), and on which device.
struct PointerKind {
  bool device = false;
  int ordinal = -1;
};
PointerKind ClassifyPointer(const void* p);

}  // namespace tandem::cuda
