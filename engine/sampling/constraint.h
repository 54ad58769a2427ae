// A request's output constraint (SamplingParams::constraint) compiled against a tokenizer,
// and the samplers that apply it.
//
// Compiled constraints are cached by (kind, text, tokenizer), a bounded LRU shared by the
// process: a schema is compiled once however many requests use it, and its mask cache (see
// grammar.h) warms for all of them.
// Threading: CompileConstraint and MakeSampler may be called from any thread.
#pragma once

#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "engine/sampling/grammar.h"
#include "engine/sampling/sampler.h"
#include "engine/tokenizer/tokenizer.h"

namespace tandem::engine {

// Null for an unconstrained request; INVALID_ARGUMENT naming what is wrong with the schema.
absl::StatusOr<std::shared_ptr<const TokenConstraint>> CompileConstraint(const Constraint& c,
                                                                         const Tokenizer& tok);

// A sampler for `p`, constrained when p.constraint says so, positioned after the last
// p.constraint.generated tokens of `prompt` (output generated earlier under the constraint, on
// another worker): INVALID_ARGUMENT when they break it or outnumber the prompt.
absl::StatusOr<std::unique_ptr<Sampler>> MakeSampler(const SamplingParams& p,
                                                     const Tokenizer& tok,
                                                     std::span<const int32_t> prompt);

}  // namespace tandem::engine
