#include "services/router/worker_channels.h"

#include "services/common/tls.h"

namespace tandem::router {

std::shared_ptr<grpc::Channel> WorkerChannels::Get(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& ch = channels_[address];
  if (ch == nullptr) {
    grpc::ChannelArguments args;
    // Workers come and go; retry connecting quickly instead of gRPC's default backoff of
    // up to two minutes, so a restarted worker is reachable as soon as it registers.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    ch = services::CreateClientChannel(address, args);  // TLS when the process has it (tls.h)
  }
  return ch;
}

}  // namespace tandem::router
