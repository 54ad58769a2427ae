// tandem.v1.SamplingParams <-> engine::SamplingParams.
//
// An unset optional field keeps engine::SamplingParams' default (temperature 1, no top-k/top-p/
// min-p, no penalties, max_tokens 16, seed 0). No range checks happen here: the engine's
// ValidateSamplingParams names the offending field, and the services call it.
// Pure functions, thread-safe.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "engine/sampling/sampler.h"
#include "tandem/v1/inference.pb.h"

namespace tandem::services {

engine::SamplingParams SamplingFromProto(const v1::SamplingParams& p);
// Sets every field explicitly, so the round trip is exact.
v1::SamplingParams SamplingToProto(const engine::SamplingParams& s);

v1::TokenLogprobs LogprobsToProto(const engine::TokenLogprobs& l);
engine::TokenLogprobs LogprobsFromProto(const v1::TokenLogprobs& p);

// "interactive", "standard" or "batch" (the CLI's and the HTTP API's names of the request
// classes); INVALID_ARGUMENT naming the three otherwise.
absl::StatusOr<v1::Priority> PriorityFromName(const std::string& name);

}  // namespace tandem::services
