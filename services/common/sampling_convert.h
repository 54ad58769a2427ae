// tandem.v1.SamplingParams <-> engine::SamplingParams.
//
// An unset optional field keeps engine::SamplingParams' default (temperature 1, no top-k/top-p/
// min-p, no penalties, max_tokens 16, seed 0). No range checks happen here: the engine's
// ValidateSamplingParams names the offending field, and the services call it.
// Pure functions, thread-safe.
#pragma once

#include "engine/sampling/sampler.h"
#include "tandem/v1/inference.pb.h"

namespace tandem::services {

engine::SamplingParams SamplingFromProto(const v1::SamplingParams& p);
// Sets every field explicitly, so the round trip is exact.
v1::SamplingParams SamplingToProto(const engine::SamplingParams& s);

}  // namespace tandem::services
