// A Registry service that records every call, for tests of workers that register with a
// router. Thread-safe.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::testing {

class FakeRegistry final : public v1::Registry::Service {
 public:
  struct Call {
    std::string kind;
    absl::Time at;
    v1::HeartbeatRequest heartbeat;
    v1::RegisterRequest registration;
  };

  explicit FakeRegistry(uint32_t lease_ms) : lease_ms_(lease_ms) {}

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* req,
                        v1::RegisterResponse* resp) override {
    absl::MutexLock l(&mu_);
    calls_.push_back({"register", absl::Now(), {}, *req});
    known_ = true;
    resp->set_lease_ms(lease_ms_);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    absl::MutexLock l(&mu_);
    calls_.push_back({"heartbeat", absl::Now(), *req, {}});
    resp->set_known(known_);
    return grpc::Status::OK;
  }
  grpc::Status Deregister(grpc::ServerContext*, const v1::DeregisterRequest* req,
                          v1::DeregisterResponse*) override {
    absl::MutexLock l(&mu_);
    v1::HeartbeatRequest r;
    r.set_worker_id(req->worker_id());
    calls_.push_back({"deregister", absl::Now(), r, {}});
    known_ = false;
    return grpc::Status::OK;
  }

  void Forget() {
    absl::MutexLock l(&mu_);
    known_ = false;
  }
  std::vector<Call> calls() {
    absl::MutexLock l(&mu_);
    return calls_;
  }
  // Calls of one kind, from one worker when `worker_id` is given.
  int Count(const std::string& kind, const std::string& worker_id = "") {
    int n = 0;
    for (const Call& c : calls()) {
      const std::string& id =
          c.kind == "register" ? c.registration.worker_id() : c.heartbeat.worker_id();
      n += c.kind == kind && (worker_id.empty() || id == worker_id);
    }
    return n;
  }
  std::vector<v1::RegisterRequest> registrations() {
    std::vector<v1::RegisterRequest> out;
    for (const Call& c : calls()) {
      if (c.kind == "register") out.push_back(c.registration);
    }
    return out;
  }
  // Polls (explicit timeout) until pred holds.
  bool WaitFor(const std::function<bool()>& pred, absl::Duration timeout = absl::Seconds(5)) {
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      if (pred()) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return pred();
  }

 private:
  const uint32_t lease_ms_;
  absl::Mutex mu_;
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
  bool known_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tandem::testing
