#include "services/common/sampling_convert.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tandem::services {

engine::SamplingParams SamplingFromProto(const v1::SamplingParams& p) {
  engine::SamplingParams s;
  if (p.has_temperature()) s.temperature = p.temperature();
  if (p.has_top_k()) s.top_k = p.top_k();
  if (p.has_top_p()) s.top_p = p.top_p();
  if (p.has_min_p()) s.min_p = p.min_p();
  if (p.has_repetition_penalty()) s.repetition_penalty = p.repetition_penalty();
  if (p.has_presence_penalty()) s.presence_penalty = p.presence_penalty();
  if (p.has_frequency_penalty()) s.frequency_penalty = p.frequency_penalty();
  if (p.has_penalty_last_n()) s.penalty_last_n = p.penalty_last_n();
  if (p.has_seed()) s.seed = p.seed();
  if (p.has_max_tokens()) s.max_tokens = p.max_tokens();
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  s.stop_strings.assign(p.stop().begin(), p.stop().end());
  s.ignore_eos = p.ignore_eos();
  if (p.has_speculative()) s.speculative = p.speculative();
  if (p.has_logprobs()) s.logprobs = p.logprobs();
  const v1::ResponseFormat& f = p.response_format();
  if (f.format_case() == v1::ResponseFormat::kJsonObject && f.json_object()) {
    s.constraint.kind = engine::Constraint::Kind::kJsonObject;
  } else if (f.format_case() == v1::ResponseFormat::kJsonSchema) {
    s.constraint.kind = engine::Constraint::Kind::kJsonSchema;
    s.constraint.text = f.json_schema();
  } else if (f.format_case() == v1::ResponseFormat::kGrammar) {
    s.constraint.kind = engine::Constraint::Kind::kGrammar;
    s.constraint.text = f.grammar();
  } else if (f.format_case() == v1::ResponseFormat::kRegex) {
    s.constraint.kind = engine::Constraint::Kind::kRegex;
    s.constraint.text = f.regex();
  }
  if (s.constraint.kind != engine::Constraint::Kind::kNone) {
    s.constraint.generated = f.generated();
  }
  return s;
}

v1::SamplingParams SamplingToProto(const engine::SamplingParams& s) {
  v1::SamplingParams p;
  p.set_temperature(s.temperature);
  p.set_top_k(s.top_k);
  p.set_top_p(s.top_p);
  p.set_min_p(s.min_p);
  p.set_repetition_penalty(s.repetition_penalty);
  p.set_presence_penalty(s.presence_penalty);
  p.set_frequency_penalty(s.frequency_penalty);
  p.set_penalty_last_n(s.penalty_last_n);
  p.set_seed(s.seed);
  p.set_max_tokens(s.max_tokens);
  for (int32_t id : s.stop_token_ids) p.add_stop_token_ids(id);
  for (const std::string& str : s.stop_strings) p.add_stop(str);
  p.set_ignore_eos(s.ignore_eos);
  p.set_speculative(s.speculative);
  if (s.logprobs >= 0) p.set_logprobs(s.logprobs);
  switch (s.constraint.kind) {
    case engine::Constraint::Kind::kNone:
      break;
    case engine::Constraint::Kind::kJsonObject:
      p.mutable_response_format()->set_json_object(true);
      break;
    case engine::Constraint::Kind::kJsonSchema:
      p.mutable_response_format()->set_json_schema(s.constraint.text);
      break;
    case engine::Constraint::Kind::kGrammar:
      p.mutable_response_format()->set_grammar(s.constraint.text);
      break;
    case engine::Constraint::Kind::kRegex:
      p.mutable_response_format()->set_regex(s.constraint.text);
      break;
  }
  if (s.constraint.kind != engine::Constraint::Kind::kNone) {
    p.mutable_response_format()->set_generated(s.constraint.generated);
  }
  return p;
}

v1::TokenLogprobs LogprobsToProto(const engine::TokenLogprobs& l) {
  v1::TokenLogprobs p;
  p.set_logprob(l.logprob);
  for (const engine::TokenLogprobs::Entry& e : l.top) {
    p.add_top_ids(e.id);
    p.add_top_logprobs(e.logprob);
  }
  return p;
}

engine::TokenLogprobs LogprobsFromProto(const v1::TokenLogprobs& p) {
  engine::TokenLogprobs l;
  l.logprob = p.logprob();
  const int n = std::min(p.top_ids_size(), p.top_logprobs_size());
  for (int i = 0; i < n; ++i) l.top.push_back({p.top_ids(i), p.top_logprobs(i)});
  return l;
}

absl::StatusOr<v1::Priority> PriorityFromName(const std::string& name) {
  if (name == "interactive") return v1::PRIORITY_INTERACTIVE;
  if (name == "standard") return v1::PRIORITY_STANDARD;
  if (name == "batch") return v1::PRIORITY_BATCH;
  return absl::InvalidArgumentError(absl::StrCat(
      "priority must be \"interactive\", \"standard\" or \"batch\", got \"", name, "\""));
}

}  // namespace tandem::services
