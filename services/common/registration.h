// Keeps a worker registered with the router's Registry service.
//
// Lifecycle: Start registers (retrying with backoff while the registry is unreachable), then
// heartbeats with fresh WorkerStats well before the lease the registry granted runs out (every
// lease/3). When the registry answers known=false (it dropped the worker, e.g. after a network
// partition) the client registers again at once. Stop deregisters, so the router stops routing
// to the worker before it drains.
//
// Threading: one background thread makes every call; the public methods are thread-safe. The
// stats callback runs on that thread and must be thread-safe with respect to the worker.
// Errors: an unreachable registry is not an error here (the worker keeps serving and keeps
// trying); only bad options are.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::services {

struct RegistrationOptions {
  std::string registry_address;            // host:port of the router's Registry service
  // The name the registry's TLS certificate carries when registry_address is an IP resolved
  // from it (registry_set.h); empty: the dialled host. --tls-server-name still wins.
  std::string tls_name;
  v1::RegisterRequest registration;        // worker_id, role, address, model, kv_blocks_total
  std::function<v1::WorkerStats()> stats;  // may be empty: heartbeats then carry no stats
  absl::Duration rpc_timeout = absl::Seconds(2);
  absl::Duration retry_min = absl::Milliseconds(100);
  absl::Duration retry_max = absl::Seconds(2);
  // Used when the registry grants lease_ms 0.
  absl::Duration default_lease = absl::Seconds(10);
};

class RegistrationClient {
 public:
  // INVALID_ARGUMENT when the address or the worker id is empty. Returns at once; registration
  // happens on the background thread.
  static absl::StatusOr<std::unique_ptr<RegistrationClient>> Start(const RegistrationOptions& o);
  ~RegistrationClient();  // Stop()
  RegistrationClient(const RegistrationClient&) = delete;
  RegistrationClient& operator=(const RegistrationClient&) = delete;

  // Heartbeats say draining=true from now on (sent at once): no new work, in-flight continues.
  void SetDraining(bool draining);
  // Stops heartbeating and deregisters (bounded by rpc_timeout). Idempotent.
  void Stop();

  bool registered() const;
  // How many Register calls succeeded (1 normally; more after the registry forgot the worker).
  int registrations() const;
  int heartbeats() const;

 private:
  explicit RegistrationClient(const RegistrationOptions& o);
  void Loop();
  bool Register();
  // false: the registry no longer knows this worker.
  absl::StatusOr<bool> Heartbeat();

  RegistrationOptions o_;
  std::unique_ptr<v1::Registry::Stub> stub_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool kick_ ABSL_GUARDED_BY(mu_) = false;  // heartbeat now (draining changed)
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  int registrations_ ABSL_GUARDED_BY(mu_) = 0;
  int heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tandem::services
