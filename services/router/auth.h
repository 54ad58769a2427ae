// API-key authentication, tenants and per-tenant rate limits at the router.
//
// The keys file (--api-keys FILE) maps each key to a tenant and, optionally, the tenant's rate
// limit: a token bucket refilled at `rps` requests per second holding at most `burst` (default
// max(1, rps)). Two formats, told apart by the first non-blank character:
//
//   # plain text: one key per line, blank lines and '#' comments ignored
//   KEY TENANT [RPS [BURST]]
//
//   {"keys": [{"key": "...", "tenant": "...", "rps": 5, "burst": 10}, ...]}   (JSON)
//
// A key appears once; keys of one tenant share one bucket, so its limits must agree (or be
// given on one line only). rps 0 or absent: no limit.
//
// A JSON entry may also give the tenant's request defaults (TenantDefaults), used where a
// request leaves the field unset: "priority" ("interactive", "standard" or "batch"),
// "ttft_target_ms" and "tpot_target_ms" (whole milliseconds, 0 to 3600000). Like limits, they
// must agree across a tenant's keys.
//
// Requests carry the key as `Authorization: Bearer KEY`: the HTTP header, or the gRPC metadata
// `authorization`. Without a valid key: UNAUTHENTICATED (HTTP 401, OpenAI-shaped); over the
// tenant's rate: RESOURCE_EXHAUSTED (HTTP 429) with `retry-after` seconds in the trailing
// metadata (HTTP Retry-After). The tenant found for the key is the request's KV salt identity:
// TenantSalt(secret, tenant) salts the chained block hashes, so tenants never share cached KV
// (whose hit timing would leak one tenant's prompts to another).
//
// Threading: an Authenticator is immutable after Load except for the buckets, which a mutex
// guards; every method is thread-safe. Errors: Load/Parse return INVALID_ARGUMENT naming the
// line (or JSON entry) at fault, NOT_FOUND for a missing file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace grpc {
class ServerContextBase;
}

namespace tandem::router {

struct TenantLimit {
  double rps = 0;    // 0: unlimited
  double burst = 0;  // bucket size
};

struct TenantDefaults {
  std::string priority;  // empty: none
  uint32_t ttft_target_ms = 0;  // 0: none
  uint32_t tpot_target_ms = 0;
  bool operator==(const TenantDefaults&) const = default;
};

class Authenticator {
 public:
  // `secret` salts the tenants' KV hashes (TenantSalt); empty is allowed (tenants still differ).
  static absl::StatusOr<std::unique_ptr<Authenticator>> Parse(std::string_view text,
                                                              std::string secret = "");
  static absl::StatusOr<std::unique_ptr<Authenticator>> Load(const std::string& path,
                                                             std::string secret = "");

  // The tenant of `authorization` ("Bearer KEY", scheme case-insensitive); UNAUTHENTICATED
  // when it is missing, malformed or unknown. Does not count against the rate.
  absl::StatusOr<std::string> Authenticate(std::string_view authorization) const;
  // Takes one request from the tenant's bucket at `now`. RESOURCE_EXHAUSTED when empty, with
  // *retry_after the wait until a request fits.
  absl::Status Admit(const std::string& tenant, absl::Time now, absl::Duration* retry_after);
  // Both, for a gRPC call: reads the `authorization` metadata; on RESOURCE_EXHAUSTED adds the
  // `retry-after` trailing metadata (whole seconds, at least 1). Returns the tenant.
  absl::StatusOr<std::string> AuthorizeCall(grpc::ServerContextBase* ctx, bool count_rate = true);

  uint64_t SaltFor(const std::string& tenant) const;
  // The tenant's request defaults; all empty for a tenant without any.
  TenantDefaults DefaultsFor(const std::string& tenant) const;
  size_t num_keys() const { return tenant_of_key_.size(); }

 private:
  struct Bucket {
    TenantLimit limit;
    double tokens = 0;
    absl::Time last = absl::InfinitePast();
  };
  Authenticator() = default;

  std::string secret_;
  absl::flat_hash_map<std::string, std::string> tenant_of_key_;
  absl::flat_hash_map<std::string, TenantDefaults> defaults_;  // per tenant, immutable
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Bucket> buckets_ ABSL_GUARDED_BY(mu_);  // per tenant
};

// The KV salt of a tenant: xxh3-64 of secret, a NUL, and tenant. The empty tenant (no
// authentication) gets 0, the unsalted hashes every request shares.
uint64_t TenantSalt(std::string_view secret, std::string_view tenant);

// The tenant a Generate call runs as: "" without an authenticator, else the tenant of the
// call's `authorization` metadata ("" when it has none valid: such calls were refused earlier).
std::string TenantForRequest(const grpc::ServerContextBase& ctx, const Authenticator* auth);

}  // namespace tandem::router
