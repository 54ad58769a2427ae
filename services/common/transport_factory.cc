#include "services/common/transport_factory.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#if TANDEM_HAVE_INPROC_TRANSPORT
#include "common/transfer/inproc/inproc_transport.h"
#endif
#if TANDEM_HAVE_UCX_TRANSPORT
#include "common/transfer/ucx/ucx_transport.h"
#endif
#if TANDEM_HAVE_CUDA_IPC_TRANSPORT
#include "common/transfer/cuda_ipc/cuda_ipc_transport.h"
#endif
#if TANDEM_HAVE_NCCL_TRANSPORT
#include "common/transfer/nccl/nccl_pair_transport.h"
#include "common/transfer/nccl/nccl_transport.h"
#endif

namespace tandem::services {

std::vector<std::string> AvailableTransports() {
  std::vector<std::string> out;
#if TANDEM_HAVE_UCX_TRANSPORT
  out.push_back("ucx");
#endif
#if TANDEM_HAVE_CUDA_IPC_TRANSPORT
  out.push_back("cuda_ipc");
#endif
#if TANDEM_HAVE_NCCL_TRANSPORT
  out.push_back("nccl");
#endif
#if TANDEM_HAVE_INPROC_TRANSPORT
  out.push_back("inproc");
#endif
  return out;
}

absl::StatusOr<std::unique_ptr<transfer::KvTransport>> CreateTransport(
    const TransportChoice& c, KvJoinHandler* join_handler) {
  if (join_handler != nullptr) *join_handler = nullptr;
  if (c.kind == "ucx") {
#if TANDEM_HAVE_UCX_TRANSPORT
    transfer::UcxTransportOptions o;
    if (!c.ucx_tls.empty()) o.transports = c.ucx_tls;
    return transfer::CreateUcxTransport(o);
#else
    return absl::UnimplementedError(absl::StrCat("this build has no UCX transport; available: ",
                                                 absl::StrJoin(AvailableTransports(), ",")));
#endif
  }
  if (c.kind == "inproc") {
#if TANDEM_HAVE_INPROC_TRANSPORT
    return transfer::CreateInProcessTransport(c.name.empty() ? "worker" : c.name);
#else
    return absl::UnimplementedError("this build has no in-process transport");
#endif
  }
  if (c.kind == "cuda_ipc") {
#if TANDEM_HAVE_CUDA_IPC_TRANSPORT
    return transfer::CreateCudaIpcTransport(transfer::CudaIpcTransportOptions{});
#else
    return absl::FailedPreconditionError(
        "transport cuda_ipc: this tandem was built without CUDA (nvcc was not found at "
        "configure time, or TANDEM_ENABLE_CUDA is OFF)");
#endif
  }
  if (c.kind == "nccl") {
#if TANDEM_HAVE_NCCL_TRANSPORT
    // The worker's device (CUDA_VISIBLE_DEVICES picks it); probed now so that a machine
    // without a GPU fails at start, not at the first join.
    const transfer::NcclTransportOptions rank_options{.device = 0};
    absl::StatusOr<std::unique_ptr<transfer::NcclTransport>> probe =
        transfer::NcclTransport::Create(rank_options);
    if (!probe.ok()) return probe.status();
    probe->reset();
    transfer::NcclPairTransportOptions o;
    o.control_address = c.control_address;
    o.join = c.nccl_join;
    o.create_rank = [rank_options] { return transfer::NcclTransport::Create(rank_options); };
    o.create_unique_id = [] { return transfer::NcclTransport::CreateUniqueId(); };
    absl::StatusOr<std::unique_ptr<transfer::NcclPairTransport>> t =
        transfer::NcclPairTransport::Create(std::move(o));
    if (!t.ok()) return t.status();
    transfer::NcclPairTransport* raw = t->get();
    if (join_handler != nullptr) {
      *join_handler = [raw](const transfer::NcclJoinRequest& r,
                            std::chrono::steady_clock::time_point deadline) {
        return raw->HandleJoin(r, deadline);
      };
    }
    return std::unique_ptr<transfer::KvTransport>(std::move(*t));
#else
    return absl::UnimplementedError(absl::StrCat(
        "this build has no NCCL transport (CUDA off, or nccl.h/libnccl not found at configure "
        "time); available: ",
        absl::StrJoin(AvailableTransports(), ",")));
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown transport \"", c.kind, "\"; use ucx, cuda_ipc, nccl or inproc"));
}

}  // namespace tandem::services
