#include "services/router/auth.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "grpcpp/server_context.h"
#include "nlohmann/json.hpp"
#include "services/common/sampling_convert.h"
#include "xxhash.h"

namespace tandem::router {
namespace {

struct Entry {
  std::string key, tenant;
  TenantLimit limit;
  bool has_limit = false;
  TenantDefaults defaults;
  bool has_defaults = false;
  std::string where;  // "line 3", "keys[2]": for errors
};

absl::Status BadEntry(const Entry& e, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("api keys, ", e.where, ": ", why));
}

absl::StatusOr<std::vector<Entry>> ParseText(std::string_view text) {
  std::vector<Entry> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    Entry e;
    e.where = absl::StrCat("line ", line_no);
    if (f.size() < 2 || f.size() > 4) {
      return BadEntry(e, "expected KEY TENANT [RPS [BURST]]");
    }
    e.key = std::string(f[0]);
    e.tenant = std::string(f[1]);
    if (f.size() >= 3) {
      e.has_limit = true;
      if (!absl::SimpleAtod(f[2], &e.limit.rps)) return BadEntry(e, "RPS is not a number");
      if (f.size() == 4 && !absl::SimpleAtod(f[3], &e.limit.burst)) {
        return BadEntry(e, "BURST is not a number");
      }
    }
    out.push_back(std::move(e));
  }
  return out;
}

absl::StatusOr<std::vector<Entry>> ParseJson(std::string_view text) {
  nlohmann::json j =
      nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("api keys: not valid JSON");
  const nlohmann::json* keys = &j;
  if (j.is_object()) {
    auto it = j.find("keys");
    if (it == j.end()) return absl::InvalidArgumentError("api keys: no \"keys\" array");
    keys = &*it;
  }
  if (!keys->is_array()) return absl::InvalidArgumentError("api keys: \"keys\" is not an array");
  std::vector<Entry> out;
  for (size_t i = 0; i < keys->size(); ++i) {
    const nlohmann::json& k = (*keys)[i];
    Entry e;
    e.where = absl::StrCat("keys[", i, "]");
    if (!k.is_object()) return BadEntry(e, "not an object");
    auto key = k.find("key");
    auto tenant = k.find("tenant");
    if (key == k.end() || !key->is_string()) return BadEntry(e, "\"key\" (a string) is required");
    if (tenant == k.end() || !tenant->is_string()) {
      return BadEntry(e, "\"tenant\" (a string) is required");
    }
    e.key = key->get<std::string>();
    e.tenant = tenant->get<std::string>();
    for (const char* name : {"rps", "burst"}) {
      auto v = k.find(name);
      if (v == k.end()) continue;
      if (!v->is_number()) return BadEntry(e, absl::StrCat("\"", name, "\" is not a number"));
      e.has_limit = true;
      (std::string(name) == "rps" ? e.limit.rps : e.limit.burst) = v->get<double>();
    }
    if (auto p = k.find("priority"); p != k.end()) {
      if (!p->is_string() || !services::PriorityFromName(p->get<std::string>()).ok()) {
        return BadEntry(e, "\"priority\" must be \"interactive\", \"standard\" or \"batch\"");
      }
      e.defaults.priority = p->get<std::string>();
      e.has_defaults = true;
    }
    for (const char* name : {"ttft_target_ms", "tpot_target_ms"}) {
      auto v = k.find(name);
      if (v == k.end()) continue;
      if (!v->is_number_unsigned() || v->get<uint64_t>() > 3'600'000) {
        return BadEntry(e, absl::StrCat("\"", name, "\" must be whole milliseconds, 0 to 3600000"));
      }
      (std::string(name) == "ttft_target_ms" ? e.defaults.ttft_target_ms
                                             : e.defaults.tpot_target_ms) =
          static_cast<uint32_t>(v->get<uint64_t>());
      e.has_defaults = true;
    }
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Parse(std::string_view text,
                                                                    std::string secret) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  const bool json = first != std::string_view::npos && (text[first] == '{' || text[first] == '[');
  absl::StatusOr<std::vector<Entry>> entries = json ? ParseJson(text) : ParseText(text);
  if (!entries.ok()) return entries.status();
  if (entries->empty()) return absl::InvalidArgumentError("api keys: the file holds no key");
  auto a = std::unique_ptr<Authenticator>(new Authenticator());
  a->secret_ = std::move(secret);
  absl::flat_hash_map<std::string, const Entry*> limit_source;  // tenant -> entry giving limits
  absl::flat_hash_map<std::string, const Entry*> defaults_source;
  absl::MutexLock lock(&a->mu_);
  for (Entry& e : *entries) {
    if (e.key.empty() || e.tenant.empty()) return BadEntry(e, "key and tenant must not be empty");
    if (!(e.limit.rps >= 0) || !std::isfinite(e.limit.rps)) {
      return BadEntry(e, "rps must be a finite number >= 0");
    }
    if (!(e.limit.burst >= 0) || !std::isfinite(e.limit.burst)) {
      return BadEntry(e, "burst must be a finite number >= 0");
    }
    if (e.limit.rps > 0 && e.limit.burst == 0) e.limit.burst = std::max(1.0, e.limit.rps);
    if (!a->tenant_of_key_.emplace(e.key, e.tenant).second) {
      return BadEntry(e, "the key appears twice");
    }
    Bucket& b = a->buckets_[e.tenant];
    if (e.has_limit) {
      auto [it, fresh] = limit_source.emplace(e.tenant, &e);
      if (!fresh &&
          (it->second->limit.rps != e.limit.rps || it->second->limit.burst != e.limit.burst)) {
        return BadEntry(e, absl::StrCat("tenant '", e.tenant, "' already has other limits (",
                                        it->second->where, ")"));
      }
      b.limit = e.limit;
      b.tokens = e.limit.burst;
    }
    if (e.has_defaults) {
      auto [it, fresh] = defaults_source.emplace(e.tenant, &e);
      if (!fresh && !(it->second->defaults == e.defaults)) {
        return BadEntry(e, absl::StrCat("tenant '", e.tenant, "' already has other defaults (",
                                        it->second->where, ")"));
      }
      a->defaults_[e.tenant] = e.defaults;
    }
  }
  return a;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Load(const std::string& path,
                                                                   std::string secret) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--api-keys ", path, ": cannot read the file"));
  std::ostringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<std::unique_ptr<Authenticator>> a = Parse(ss.str(), std::move(secret));
  if (!a.ok()) {
    return absl::Status(a.status().code(),
                        absl::StrCat("--api-keys ", path, ": ", a.status().message()));
  }
  return a;
}

absl::StatusOr<std::string> Authenticator::Authenticate(std::string_view authorization) const {
  absl::string_view v =
      absl::StripAsciiWhitespace(absl::string_view(authorization.data(), authorization.size()));
  if (v.empty()) {
    return absl::UnauthenticatedError("missing API key: send it as 'Authorization: Bearer KEY'");
  }
  if (v.size() < 7 || !absl::EqualsIgnoreCase(v.substr(0, 7), "bearer ")) {
    return absl::UnauthenticatedError("the Authorization header must be 'Bearer KEY'");
  }
  const absl::string_view key = absl::StripAsciiWhitespace(v.substr(7));
  auto it = tenant_of_key_.find(key);
  if (it == tenant_of_key_.end()) return absl::UnauthenticatedError("invalid API key");
  return it->second;
}

absl::Status Authenticator::Admit(const std::string& tenant, absl::Time now,
                                  absl::Duration* retry_after) {
  absl::MutexLock lock(&mu_);
  auto it = buckets_.find(tenant);
  if (it == buckets_.end() || it->second.limit.rps <= 0) return absl::OkStatus();
  Bucket& b = it->second;
  if (b.last != absl::InfinitePast() && now > b.last) {
    b.tokens =
        std::min(b.limit.burst, b.tokens + absl::ToDoubleSeconds(now - b.last) * b.limit.rps);
  }
  if (b.last == absl::InfinitePast() || now > b.last) b.last = now;
  if (b.tokens >= 1.0) {
    b.tokens -= 1.0;
    return absl::OkStatus();
  }
  const absl::Duration wait = absl::Seconds((1.0 - b.tokens) / b.limit.rps);
  if (retry_after != nullptr) *retry_after = wait;
  return absl::ResourceExhaustedError(
      absl::StrCat("rate limit of tenant '", tenant, "' (", b.limit.rps, " requests/s, burst ",
                   b.limit.burst, ") reached; retry after ", absl::FormatDuration(wait)));
}

absl::StatusOr<std::string> Authenticator::AuthorizeCall(grpc::ServerContextBase* ctx,
                                                         bool count_rate) {
  std::string header;
  const auto& md = ctx->client_metadata();
  if (auto it = md.find("authorization"); it != md.end()) {
    header.assign(it->second.data(), it->second.size());
  }
  absl::StatusOr<std::string> tenant = Authenticate(header);
  if (!tenant.ok() || !count_rate) return tenant;
  absl::Duration wait;
  if (absl::Status st = Admit(*tenant, absl::Now(), &wait); !st.ok()) {
    const int64_t secs =
        std::max<int64_t>(1, static_cast<int64_t>(std::ceil(absl::ToDoubleSeconds(wait))));
    ctx->AddTrailingMetadata("retry-after", std::to_string(secs));
    return st;
  }
  return tenant;
}

TenantDefaults Authenticator::DefaultsFor(const std::string& tenant) const {
  auto it = defaults_.find(tenant);
  return it == defaults_.end() ? TenantDefaults{} : it->second;
}

uint64_t Authenticator::SaltFor(const std::string& tenant) const {
  return TenantSalt(secret_, tenant);
}

uint64_t TenantSalt(std::string_view secret, std::string_view tenant) {
  if (tenant.empty()) return 0;
  std::string buf;
  buf.reserve(secret.size() + 1 + tenant.size());
  buf.append(secret).push_back('\0');
  buf.append(tenant);
  return XXH3_64bits(buf.data(), buf.size());
}

std::string TenantForRequest(const grpc::ServerContextBase& ctx, const Authenticator* auth) {
  if (auth == nullptr) return "";
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return "";
  absl::StatusOr<std::string> t =
      auth->Authenticate(std::string(it->second.data(), it->second.size()));
  return t.ok() ? *t : "";
}

}  // namespace tandem::router
