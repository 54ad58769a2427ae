// Shared types of the CUDA kernel API (tandem/cuda/*.h): the stream handle and device queries.
//
// Role: every kernel entry point is a plain C++ function callable from .cc files. It takes
// device pointers (the caller allocates and owns every buffer) and a stream, enqueues work and
// returns without synchronising. Errors: INVALID_ARGUMENT for shapes or alignments a kernel
// does not support (checked on the host before launching), INTERNAL with the CUDA error text
// and file:line when a launch fails. Errors of the asynchronous work itself surface at the
// caller's next synchronisation. Threading: functions are thread-safe; work on one stream is
// ordered as usual.
// Built only when nvcc is found (TANDEM_HAVE_CUDA is defined for users of tandem_kernels_cuda).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// cudaStream_t is `CUstream_st*`; declaring the struct keeps cuda_runtime.h out of callers.
struct CUstream_st;

namespace tandem::kernels::cuda {

using Stream = CUstream_st*;  // nullptr: the legacy default stream

struct DeviceInfo {
  int ordinal = 0;
  int sm_major = 0;
  int sm_minor = 0;
  int num_sms = 0;
  int64_t global_memory_bytes = 0;
};

// Number of visible devices; 0 (not an error) when the driver or a device is missing, so tests
// can skip.
int VisibleDeviceCount();

// The current device's properties.
absl::StatusOr<DeviceInfo> CurrentDevice();

}  // namespace tandem::kernels::cuda
