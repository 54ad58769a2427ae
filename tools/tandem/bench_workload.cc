#include "tools/tandem/bench_workload.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"

namespace tandem::tools::bench {
namespace {

std::vector<int32_t> RandomTokens(std::mt19937_64& rng, int n, int32_t vocab) {
  std::uniform_int_distribution<int32_t> d(kFirstOrdinaryToken, vocab - 1);
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int32_t& t : out) t = d(rng);
  return out;
}

}  // namespace

absl::StatusOr<Workload> ParseWorkload(const std::string& name) {
  if (name == "random") return Workload::kRandom;
  if (name == "shared-prefix") return Workload::kSharedPrefix;
  if (name == "multi-turn") return Workload::kMultiTurn;
  return absl::InvalidArgumentError(
      absl::StrCat("--workload must be random, shared-prefix or multi-turn, got '", name, "'"));
}

absl::StatusOr<Arrival> ParseArrival(const std::string& name) {
  if (name == "poisson") return Arrival::kPoisson;
  if (name == "constant") return Arrival::kConstant;
  if (name == "burst") return Arrival::kBurst;
  return absl::InvalidArgumentError(
      absl::StrCat("--arrival must be poisson, constant or burst, got '", name, "'"));
}

absl::StatusOr<std::vector<PlannedRequest>> MakeRequests(const WorkloadOptions& o) {
  if (o.num_requests < 1) return absl::InvalidArgumentError("--num-requests must be >= 1");
  if (o.input_len < 1) return absl::InvalidArgumentError("--input-len must be >= 1");
  if (o.output_len < 1) return absl::InvalidArgumentError("--output-len must be >= 1");
  if (o.workload == Workload::kSharedPrefix && o.prefix_len < 1) {
    return absl::InvalidArgumentError("--prefix-len must be >= 1");
  }
  if (o.workload == Workload::kMultiTurn && o.turns < 1) {
    return absl::InvalidArgumentError("--turns must be >= 1");
  }
  if (o.vocab_size <= kFirstOrdinaryToken) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocabulary of ", o.vocab_size, " tokens is too small"));
  }
  std::mt19937_64 rng(o.seed);
  std::vector<PlannedRequest> out;
  out.reserve(static_cast<size_t>(o.num_requests));
  const std::vector<int32_t> prefix = o.workload == Workload::kSharedPrefix
                                          ? RandomTokens(rng, o.prefix_len, o.vocab_size)
                                          : std::vector<int32_t>{};
  std::vector<int32_t> history;
  for (int i = 0; i < o.num_requests; ++i) {
    PlannedRequest r;
    r.max_tokens = o.output_len;
    r.session = i;
    const std::vector<int32_t> fresh = RandomTokens(rng, o.input_len, o.vocab_size);
    switch (o.workload) {
      case Workload::kRandom:
        r.prompt = fresh;
        break;
      case Workload::kSharedPrefix:
        r.prompt = prefix;
        r.prompt.insert(r.prompt.end(), fresh.begin(), fresh.end());
        break;
      case Workload::kMultiTurn: {
        r.session = i / o.turns;
        r.turn = i % o.turns;
        if (r.turn == 0) {
          history.clear();
        } else {
          const std::vector<int32_t> reply = RandomTokens(rng, o.output_len, o.vocab_size);
          history.insert(history.end(), reply.begin(), reply.end());
        }
        history.insert(history.end(), fresh.begin(), fresh.end());
        r.prompt = history;
        break;
      }
    }
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<std::vector<double>> ArrivalTimes(int n, double rate, Arrival kind, uint64_t seed,
                                                 int burst_size) {
  if (!(rate > 0) || !std::isfinite(rate)) {
    return absl::InvalidArgumentError("--request-rate must be > 0");
  }
  if (burst_size < 1) return absl::InvalidArgumentError("--burst-size must be >= 1");
  std::vector<double> t(static_cast<size_t>(std::max(n, 0)));
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::exponential_distribution<double> gap(rate);
  double now = 0;
  for (int i = 0; i < n; ++i) {
    switch (kind) {
      case Arrival::kPoisson:
        if (i > 0) now += gap(rng);
        t[i] = now;
        break;
      case Arrival::kConstant:
        t[i] = i / rate;
        break;
      case Arrival::kBurst:
        t[i] = (i / burst_size) * (burst_size / rate);
        break;
    }
  }
  return t;
}

}  // namespace tandem::tools::bench
