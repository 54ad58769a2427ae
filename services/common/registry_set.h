// Keeps a worker registered with every router: one RegistrationClient per router address.
//
// Several routers serve at once (any one can die), and each holds its own soft worker registry,
// so a worker registers with all of them. The worker is given a list of HOST:PORT entries
// (--router a:1,b:2); each HOST is resolved to every address it has (DNS, or /etc/hosts with
// several lines of the same name: the headless-Service shape), and re-resolved every
// resolve_interval. Each resolved address gets its own RegistrationClient (register, heartbeat
// within the lease, register again when forgotten: registration.h). An address that stops
// resolving is stopped (best-effort deregister); a new one is registered with within one
// resolve_interval. A resolution that fails keeps that entry's previous addresses: a DNS blip
// must not deregister a worker from routers that are still there.
//
// Threading: one background thread resolves and starts/stops clients; the public methods are
// thread-safe. Ownership: RegistrySet owns its clients. Errors: Start returns INVALID_ARGUMENT
// for a malformed list or incomplete registration; an unresolvable name or an unreachable
// router is not an error (the worker keeps serving and keeps trying).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "services/common/registration.h"

namespace tandem::services {

struct RouterEndpoint {
  std::string host;  // a name or an IP literal (IPv6 without brackets)
  int port = 0;
};

// "a:1,b:2,[::1]:3" -> endpoints. INVALID_ARGUMENT for an empty list, an entry without a port,
// or a port outside [1, 65535].
absl::StatusOr<std::vector<RouterEndpoint>> ParseRouterList(const std::string& list);

// Every address `e.host` resolves to (getaddrinfo, IPv4 and IPv6, in the resolver's order,
// duplicates removed), each joined with e.port ("10.0.0.1:7000", "[fd00::1]:7000").
// NOT_FOUND / UNAVAILABLE when the name does not resolve.
absl::StatusOr<std::vector<std::string>> ResolveRouterEndpoint(const RouterEndpoint& e);

struct RegistrySetOptions {
  std::vector<RouterEndpoint> routers;  // at least one
  // Everything but registry_address and tls_name, which RegistrySet fills in per address.
  RegistrationOptions registration;
  absl::Duration resolve_interval = absl::Seconds(2);
  // Empty: ResolveRouterEndpoint (getaddrinfo). Tests inject their own. Called on the
  // background thread only.
  std::function<absl::StatusOr<std::vector<std::string>>(const RouterEndpoint&)> resolve;
};

class RegistrySet {
 public:
  // Returns at once; the first resolution and registrations happen on the background thread.
  static absl::StatusOr<std::unique_ptr<RegistrySet>> Start(const RegistrySetOptions& o);
  ~RegistrySet();  // Stop()
  RegistrySet(const RegistrySet&) = delete;
  RegistrySet& operator=(const RegistrySet&) = delete;

  // Every registration (and every one started later) says draining from now on.
  void SetDraining(bool draining);
  // Stops resolving, then stops every registration at once (each deregisters, bounded by the
  // registration's rpc_timeout). Idempotent.
  void Stop();

  // The router addresses registrations run for now, sorted.
  std::vector<std::string> addresses() const;
  // How many of them are registered now.
  int registered() const;
  // How many resolutions ran (each resolves every entry once).
  int resolutions() const;

 private:
  explicit RegistrySet(const RegistrySetOptions& o);
  void Loop();
  // Resolves every entry and brings the clients in line. Background thread only.
  void Reconcile();

  RegistrySetOptions o_;
  std::thread thread_;
  // Per entry (index into o_.routers): its last successful resolution. Background thread only.
  std::vector<std::vector<std::string>> last_resolved_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int resolutions_ ABSL_GUARDED_BY(mu_) = 0;
  // address -> its registration.
  std::map<std::string, std::unique_ptr<RegistrationClient>> clients_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::services
