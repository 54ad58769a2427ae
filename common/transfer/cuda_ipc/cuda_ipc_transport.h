// CudaIpcTransport: KvTransport between processes on the GPUs of one node, device memory to
// device memory, for the prefill -> decode handoff of a GPU pool.
//
// Receiver: RegisterRegion(base, length) takes device memory (cudaMalloc'd, or anything inside
// one allocation) and exports the allocation with cudaIpcGetMemHandle; the descriptor carries
// the 64-byte handle, the region's offset in its allocation, and an address naming this node
// (its boot id), process and transport instance. Exporting costs nothing per request: the whole
// KV pool is one region, registered once.
// Sender: the first WriteAsync to a region maps it (cudaIpcOpenMemHandle, peer access enabled
// lazily) and caches the mapping per (peer, region); ForgetPeer unmaps a peer's regions. Each
// write is a cudaMemcpyAsync per op on the transport's own non-blocking stream, so copies of
// one layer overlap the next layer's compute on the engine's stream; an event recorded after
// the ops completes the write. Within one process (tests, a colocated pair) the exporter's
// pointer is used directly (a process cannot open its own IPC handle).
//
// Capabilities: name "cuda_ipc", one_sided (the receiver's CPU does nothing), device_memory,
// not cross_host (a descriptor from another node is FAILED_PRECONDITION). Source pointers may
// be device or pinned host memory (cudaMemcpyDefault).
// Threading: every method is thread-safe. Callbacks run on the transport's progress thread,
// which sleeps on a condition variable when no write is pending and polls the events of pending
// writes (20 us, backing off to 1 ms) otherwise. Callbacks must not block.
// Errors: no usable device at Create is FAILED_PRECONDITION "no CUDA device ..."; a host
// pointer at RegisterRegion is INVALID_ARGUMENT; a malformed descriptor or an op outside the
// region is INVALID_ARGUMENT, an unknown region NOT_FOUND, a peer that is gone (its handle no
// longer opens) UNAVAILABLE, all through the callback. A GPU copy cannot be cancelled: at the
// deadline the callback gets DEADLINE_EXCEEDED while the copy may still land later, which the
// decode worker's block quarantine covers (as for every one-sided backend).
// Ownership: the caller owns registered memory and sources (see transfer.h); the transport owns
// its stream, events and mappings and releases them in its destructor, after waiting for its
// copies.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/transfer/transfer.h"

namespace tandem::transfer {

struct CudaIpcTransportOptions {
  int device = -1;  // CUDA device of this process's pool and copies; -1: the current device
};

absl::StatusOr<std::unique_ptr<KvTransport>> CreateCudaIpcTransport(
    const CudaIpcTransportOptions& o);

}  // namespace tandem::transfer
