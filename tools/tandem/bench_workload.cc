#include "tools/tandem/bench_workload.h"

#include <cmath>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

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
          history = RandomTokens(rng, o.first_turn_len, o.vocab_size);
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

absl::StatusOr<std::vector<RequestClass>> ParseMix(const std::string& spec) {
  std::vector<RequestClass> out;
  for (absl::string_view part : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    const std::vector<absl::string_view> f = absl::StrSplit(part, ':');
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--mix: '", std::string(part), "': ", std::string(why),
          " (NAME:WEIGHT[:ttft=MS][:tpot=MS], e.g. interactive:1:ttft=400,batch:3)"));
    };
    RequestClass c;
    c.name = std::string(absl::StripAsciiWhitespace(f[0]));
    if (c.name.empty()) return bad("no class name");
    if (f.size() < 2 || !absl::SimpleAtod(f[1], &c.weight) || !(c.weight > 0) ||
        !std::isfinite(c.weight)) {
      return bad("the weight must be a number > 0");
    }
    for (size_t i = 2; i < f.size(); ++i) {
      const std::vector<absl::string_view> kv = absl::StrSplit(f[i], '=');
      double v = 0;
      if (kv.size() != 2 || !absl::SimpleAtod(kv[1], &v) || !(v > 0) || !std::isfinite(v)) {
        return bad("a target must be KEY=MS with MS > 0");
      }
      if (kv[0] == "ttft") {
        c.ttft_ms = v;
      } else if (kv[0] == "tpot") {
        c.tpot_ms = v;
      } else {
        return bad(absl::StrCat("unknown target '", std::string(kv[0]), "' (ttft or tpot)"));
      }
    }
    for (const RequestClass& o : out) {
      if (o.name == c.name) return bad("the class is named twice");
    }
    out.push_back(std::move(c));
  }
  return out;
}

void AssignClasses(const std::vector<RequestClass>& classes, uint64_t seed,
                   std::vector<PlannedRequest>* requests) {
  if (classes.empty()) return;
  std::vector<double> w;
  for (const RequestClass& c : classes) w.push_back(c.weight);
  std::discrete_distribution<int> pick(w.begin(), w.end());
  std::mt19937_64 rng(seed ^ 0x5bd1e9955bd1e995ull);  // not the prompts' or arrivals' stream
  for (PlannedRequest& r : *requests) r.cls = pick(rng);
}

}  // namespace tandem::tools::bench
