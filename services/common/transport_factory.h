// Picks a KvTransport backend by name, for the worker binaries' --transport flag.
//
// "ucx": UCX (shared memory, TCP, RDMA); `ucx_tls` selects UCX transports ("shm", "tcp", "all"
// or an explicit list). "inproc": peers in the same process only, useful for tests and a
// single-process smoke run, useless between separate worker processes. "cuda_ipc": device
// memory to device memory between the processes of one node (common/transfer/cuda_ipc), for
// workers with --device cuda; FAILED_PRECONDITION without a GPU or in a build without CUDA.
// "nccl": device memory to device memory across nodes, one two-rank NCCL communicator per
// (prefill, decode) pair joined over the control plane (services/common/nccl_join.h);
// UNAVAILABLE ("no CUDA device") without a GPU, UNIMPLEMENTED in a build without NCCL.
// Which backends exist depends on the build; an absent one is UNIMPLEMENTED, an unknown name
// INVALID_ARGUMENT. Thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transfer/transfer.h"
#include "services/common/nccl_join.h"

namespace tandem::services {

struct TransportChoice {
  std::string kind = "ucx";  // "ucx", "cuda_ipc", "nccl" or "inproc"
  std::string name;          // instance name (inproc address); defaults to "worker"
  std::string ucx_tls = "shm";
  // nccl: the worker's advertised gRPC host:port, named in its region descriptors (empty: the
  // transport can send but not register regions), and how a sender joins a receiver.
  std::string control_address;
  transfer::NcclJoinFn nccl_join;
};

// `join_handler`, when given, receives what the worker's JoinKvGroup RPC must call (nccl; left
// empty for the other backends).
absl::StatusOr<std::unique_ptr<transfer::KvTransport>> CreateTransport(
    const TransportChoice& c, KvJoinHandler* join_handler = nullptr);

// The backends compiled into this build, in preference order.
std::vector<std::string> AvailableTransports();

}  // namespace tandem::services
