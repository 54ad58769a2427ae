#include "services/common/registration.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "services/common/grpc_status.h"
#include "services/common/tls.h"

namespace tandem::services {
namespace {

std::shared_ptr<grpc::Channel> MakeChannel(const RegistrationOptions& o) {
  // gRPC's default reconnect backoff grows to minutes; a worker must rejoin a restarted router
  // within our own retry bound.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(o.retry_min)));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(o.retry_min)));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(o.retry_max)));
  // --tls-server-name wins: gRPC takes the first override set, and CreateClientChannel adds
  // the process's after ours.
  if (!o.tls_name.empty() && ProcessTls().server_name.empty()) {
    args.SetSslTargetNameOverride(o.tls_name);
  }
  return CreateClientChannel(o.registry_address, args);
}

}  // namespace

absl::StatusOr<std::unique_ptr<RegistrationClient>> RegistrationClient::Start(
    const RegistrationOptions& o) {
  if (o.registry_address.empty()) return absl::InvalidArgumentError("registry address is empty");
  if (o.registration.worker_id().empty()) return absl::InvalidArgumentError("worker id is empty");
  if (o.registration.address().empty()) {
    return absl::InvalidArgumentError("the worker's advertised address is empty");
  }
  std::unique_ptr<RegistrationClient> c(new RegistrationClient(o));
  c->thread_ = std::thread([p = c.get()] { p->Loop(); });
  return c;
}

RegistrationClient::RegistrationClient(const RegistrationOptions& o)
    : o_(o), stub_(v1::Registry::NewStub(MakeChannel(o))) {}

RegistrationClient::~RegistrationClient() { Stop(); }

void RegistrationClient::SetDraining(bool draining) {
  absl::MutexLock l(&mu_);
  draining_ = draining;
  kick_ = true;
}

bool RegistrationClient::registered() const {
  absl::MutexLock l(&mu_);
  return registered_;
}

int RegistrationClient::registrations() const {
  absl::MutexLock l(&mu_);
  return registrations_;
}

int RegistrationClient::heartbeats() const {
  absl::MutexLock l(&mu_);
  return heartbeats_;
}

bool RegistrationClient::Register() {
  grpc::ClientContext ctx;
  ctx.set_deadline(ToChronoDeadline(absl::Now() + o_.rpc_timeout));
  v1::RegisterResponse resp;
  if (!stub_->Register(&ctx, o_.registration, &resp).ok()) return false;
  absl::MutexLock l(&mu_);
  registered_ = true;
  ++registrations_;
  if (resp.lease_ms() > 0) o_.default_lease = absl::Milliseconds(resp.lease_ms());
  return true;
}

absl::StatusOr<bool> RegistrationClient::Heartbeat() {
  v1::HeartbeatRequest req;
  req.set_worker_id(o_.registration.worker_id());
  if (o_.stats) *req.mutable_stats() = o_.stats();
  {
    absl::MutexLock l(&mu_);
    req.set_draining(draining_);
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(ToChronoDeadline(absl::Now() + std::min(o_.rpc_timeout, o_.default_lease / 3)));
  v1::HeartbeatResponse resp;
  grpc::Status st = stub_->Heartbeat(&ctx, req, &resp);
  if (!st.ok()) return FromGrpcStatus(st);
  absl::MutexLock l(&mu_);
  ++heartbeats_;
  if (!resp.known()) registered_ = false;
  return resp.known();
}

void RegistrationClient::Loop() {
  absl::Duration backoff = o_.retry_min;
  for (;;) {
    bool registered;
    {
      absl::MutexLock l(&mu_);
      if (stop_) return;
      registered = registered_;
    }
    absl::Duration wait;
    if (!registered) {
      if (Register()) {
        backoff = o_.retry_min;
        wait = o_.default_lease / 3;
      } else {
        wait = backoff;
        backoff = std::min(backoff * 2, o_.retry_max);
      }
    } else {
      absl::StatusOr<bool> known = Heartbeat();
      if (known.ok() && !*known) continue;  // forgotten: register again at once
      // A failed heartbeat is retried sooner, but never later than the regular interval.
      wait = known.ok() ? o_.default_lease / 3 : std::min(o_.retry_min * 4, o_.default_lease / 3);
    }
    absl::MutexLock l(&mu_);
    const absl::Time until = absl::Now() + wait;
    auto wake = [this] {
      mu_.AssertHeld();  // Await calls it under mu_
      return stop_ || kick_;
    };
    mu_.AwaitWithDeadline(absl::Condition(&wake), until);
    kick_ = false;
  }
}

void RegistrationClient::Stop() {
  {
    absl::MutexLock l(&mu_);
    if (stopped_) return;
    stopped_ = true;
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  bool was_registered;
  {
    absl::MutexLock l(&mu_);
    was_registered = registered_;
    registered_ = false;
  }
  if (!was_registered) return;
  grpc::ClientContext ctx;
  ctx.set_deadline(ToChronoDeadline(absl::Now() + o_.rpc_timeout));
  v1::DeregisterRequest req;
  req.set_worker_id(o_.registration.worker_id());
  v1::DeregisterResponse resp;
  (void)stub_->Deregister(&ctx, req, &resp);  // best effort: the lease expires anyway
}

}  // namespace tandem::services
