#include "services/common/registry_set.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "services/common/grpc_server.h"

namespace tandem::services {
namespace {

bool IsIpLiteral(const std::string& host) {
  in6_addr a6;
  in_addr a4;
  return inet_pton(AF_INET, host.c_str(), &a4) == 1 || inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

}  // namespace

absl::StatusOr<std::vector<RouterEndpoint>> ParseRouterList(const std::string& list) {
  std::vector<RouterEndpoint> out;
  for (absl::string_view entry : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    const size_t colon = entry.rfind(':');
    if (colon == absl::string_view::npos || colon == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("router address '", entry, "' is not HOST:PORT"));
    }
    absl::string_view host = entry.substr(0, colon);
    if (absl::ConsumePrefix(&host, "[") && !absl::ConsumeSuffix(&host, "]")) {
      return absl::InvalidArgumentError(absl::StrCat("router address '", entry,
                                                     "' opens an IPv6 bracket it does not close"));
    }
    if (host.find(':') != absl::string_view::npos && entry.front() != '[') {
      return absl::InvalidArgumentError(
          absl::StrCat("router address '", entry, "': bracket an IPv6 host, e.g. [::1]:7000"));
    }
    int port = 0;
    if (!absl::SimpleAtoi(entry.substr(colon + 1), &port) || port < 1 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("router address '", entry, "' has no port in [1, 65535]"));
    }
    if (host.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("router address '", entry, "' has no host"));
    }
    out.push_back({std::string(host), port});
  }
  if (out.empty()) return absl::InvalidArgumentError("the router list is empty");
  return out;
}

absl::StatusOr<std::vector<std::string>> ResolveRouterEndpoint(const RouterEndpoint& e) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  // glibc returns one entry per matching /etc/hosts line when /etc/host.conf says "multi on"
  // (Debian's default), and every A/AAAA record from DNS.
  const int rc = getaddrinfo(e.host.c_str(), nullptr, &hints, &res);
  if (rc != 0) {
    const std::string what = absl::StrCat("resolving ", e.host, ": ", gai_strerror(rc));
    return rc == EAI_NONAME || rc == EAI_NODATA ? absl::NotFoundError(what)
                                                 : absl::UnavailableError(what);
  }
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (addrinfo* p = res; p != nullptr; p = p->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    const void* addr = p->ai_family == AF_INET
                           ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(p->ai_addr)->sin_addr)
                           : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(p->ai_addr)->sin6_addr);
    if ((p->ai_family != AF_INET && p->ai_family != AF_INET6) ||
        inet_ntop(p->ai_family, addr, buf, sizeof(buf)) == nullptr) {
      continue;
    }
    std::string a = JoinHostPort(buf, e.port);
    if (seen.insert(a).second) out.push_back(std::move(a));
  }
  freeaddrinfo(res);
  if (out.empty()) return absl::NotFoundError(absl::StrCat(e.host, " has no IPv4/IPv6 address"));
  return out;
}

absl::StatusOr<std::unique_ptr<RegistrySet>> RegistrySet::Start(const RegistrySetOptions& o) {
  if (o.routers.empty()) return absl::InvalidArgumentError("no router address to register with");
  if (o.resolve_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the router re-resolve interval must be positive");
  }
  if (o.registration.registration.worker_id().empty()) {
    return absl::InvalidArgumentError("worker id is empty");
  }
  if (o.registration.registration.address().empty()) {
    return absl::InvalidArgumentError("the worker's advertised address is empty");
  }
  std::unique_ptr<RegistrySet> s(new RegistrySet(o));
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

RegistrySet::RegistrySet(const RegistrySetOptions& o) : o_(o), last_resolved_(o.routers.size()) {
  if (!o_.resolve) o_.resolve = ResolveRouterEndpoint;
}

RegistrySet::~RegistrySet() { Stop(); }

void RegistrySet::SetDraining(bool draining) {
  absl::MutexLock l(&mu_);
  draining_ = draining;
  for (auto& [addr, c] : clients_) c->SetDraining(draining);
}

std::vector<std::string> RegistrySet::addresses() const {
  absl::MutexLock l(&mu_);
  std::vector<std::string> out;
  for (const auto& [addr, c] : clients_) out.push_back(addr);
  return out;
}

int RegistrySet::registered() const {
  absl::MutexLock l(&mu_);
  int n = 0;
  for (const auto& [addr, c] : clients_) n += c->registered();
  return n;
}

int RegistrySet::resolutions() const {
  absl::MutexLock l(&mu_);
  return resolutions_;
}

void RegistrySet::Reconcile() {
  // address -> the entry's host, which names the router's TLS certificate.
  std::map<std::string, std::string> want;
  for (size_t i = 0; i < o_.routers.size(); ++i) {
    const RouterEndpoint& e = o_.routers[i];
    absl::StatusOr<std::vector<std::string>> r = o_.resolve(e);
    if (r.ok()) last_resolved_[i] = std::move(*r);
    for (const std::string& a : last_resolved_[i]) want.emplace(a, IsIpLiteral(e.host) ? "" : e.host);
  }
  std::vector<std::unique_ptr<RegistrationClient>> gone;
  {
    absl::MutexLock l(&mu_);
    ++resolutions_;
    for (auto it = clients_.begin(); it != clients_.end();) {
      if (want.count(it->first) == 0) {
        gone.push_back(std::move(it->second));
        it = clients_.erase(it);
      } else {
        ++it;
      }
    }
    for (const auto& [addr, tls_name] : want) {
      if (clients_.count(addr) > 0) continue;
      RegistrationOptions ro = o_.registration;
      ro.registry_address = addr;
      ro.tls_name = tls_name;
      // Only bad options fail, and Start checked those.
      absl::StatusOr<std::unique_ptr<RegistrationClient>> c = RegistrationClient::Start(ro);
      if (!c.ok()) continue;
      if (draining_) (*c)->SetDraining(true);
      clients_.emplace(addr, std::move(*c));
    }
  }
  for (auto& c : gone) c->Stop();  // best-effort deregister, outside the lock
}

void RegistrySet::Loop() {
  for (;;) {
    Reconcile();
    absl::MutexLock l(&mu_);
    auto stopping = [this] {
      mu_.AssertHeld();  // Await calls it under mu_
      return stop_;
    };
    if (mu_.AwaitWithTimeout(absl::Condition(&stopping), o_.resolve_interval)) return;
  }
}

void RegistrySet::Stop() {
  {
    absl::MutexLock l(&mu_);
    if (stopped_) return;
    stopped_ = true;
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  std::map<std::string, std::unique_ptr<RegistrationClient>> clients;
  {
    absl::MutexLock l(&mu_);
    clients.swap(clients_);
  }
  // In parallel: a drain waits for the slowest router, not for the sum of them.
  std::vector<std::thread> stops;
  for (auto& [addr, c] : clients) stops.emplace_back([p = c.get()] { p->Stop(); });
  for (std::thread& t : stops) t.join();
}

}  // namespace tandem::services
