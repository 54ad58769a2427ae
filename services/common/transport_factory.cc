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

namespace tandem::services {

std::vector<std::string> AvailableTransports() {
  std::vector<std::string> out;
#if TANDEM_HAVE_UCX_TRANSPORT
  out.push_back("ucx");
#endif
#if TANDEM_HAVE_CUDA_IPC_TRANSPORT
  out.push_back("cuda_ipc");
#endif
#if TANDEM_HAVE_INPROC_TRANSPORT
  out.push_back("inproc");
#endif
  return out;
}

absl::StatusOr<std::unique_ptr<transfer::KvTransport>> CreateTransport(const TransportChoice& c) {
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
  return absl::InvalidArgumentError(
      absl::StrCat("unknown transport \"", c.kind, "\"; use ucx, cuda_ipc or inproc"));
}

}  // namespace tandem::services
