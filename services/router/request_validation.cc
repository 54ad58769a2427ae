#include "services/router/request_validation.h"

#include "absl/strings/str_cat.h"
#include "engine/sampling/constraint.h"
#include "services/common/sampling_convert.h"

namespace tandem::router {
namespace {

absl::Status Invalid(const std::string& msg) { return absl::InvalidArgumentError(msg); }

// The checks the engine does not make (it treats any top_k <= 0 as off, and bounds nothing by
// size); they run before the engine's so a request is judged by its first bad field in the
// table's order either way.
absl::Status ValidateRouterOnly(const v1::GenerateRequest& req, const RequestLimits& limits) {
  if (static_cast<int64_t>(req.request_id().size()) > limits.max_request_id_bytes) {
    return Invalid(absl::StrCat("request_id is ", req.request_id().size(), " bytes; at most ",
                                limits.max_request_id_bytes, " allowed"));
  }
  const v1::SamplingParams& s = req.sampling();
  if (s.has_top_k() && s.top_k() < -1) {
    return Invalid(absl::StrCat("sampling.top_k must be -1 or 0 (off) or >= 1, got ", s.top_k()));
  }
  if (s.stop_size() > limits.max_stop_strings) {
    return Invalid(absl::StrCat("sampling.stop has ", s.stop_size(), " strings; at most ",
                                limits.max_stop_strings, " allowed"));
  }
  for (int i = 0; i < s.stop_size(); ++i) {
    if (s.stop(i).empty()) return Invalid(absl::StrCat("sampling.stop[", i, "] is empty"));
    if (static_cast<int64_t>(s.stop(i).size()) > limits.max_stop_string_bytes) {
      return Invalid(absl::StrCat("sampling.stop[", i, "] is ", s.stop(i).size(),
                                  " bytes; at most ", limits.max_stop_string_bytes, " allowed"));
    }
  }
  if (s.stop_token_ids_size() > limits.max_stop_token_ids) {
    return Invalid(absl::StrCat("sampling.stop_token_ids has ", s.stop_token_ids_size(),
                                " ids; at most ", limits.max_stop_token_ids, " allowed"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateGenerateRequest(const v1::GenerateRequest& req, const RouterModel& model,
                                     const RequestLimits& limits, std::vector<int32_t>* prompt,
                                     engine::SamplingParams* sampling) {
  if (!model.Matches(req.model())) {
    return absl::NotFoundError(absl::StrCat(
        "model '", req.model(), "' is not served here; this router serves '", model.id(), "'"));
  }
  if (absl::Status st = ValidateRouterOnly(req, limits); !st.ok()) return st;
  const int32_t vocab = model.vocab_size();
  switch (req.prompt_case()) {
    case v1::GenerateRequest::kText:
      if (static_cast<int64_t>(req.text().size()) > limits.max_prompt_text_bytes) {
        return Invalid(absl::StrCat("prompt.text is ", req.text().size(), " bytes; at most ",
                                    limits.max_prompt_text_bytes, " allowed"));
      }
      *prompt = model.tokenizer().Encode(req.text(), /*add_special=*/true, /*parse_special=*/true);
      if (prompt->empty()) return Invalid("prompt.text is empty and the model adds no BOS token");
      break;
    case v1::GenerateRequest::kTokenIds: {
      const auto& ids = req.token_ids().ids();
      if (ids.empty()) return Invalid("prompt.token_ids is empty");
      for (int i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] >= vocab) {
          return Invalid(absl::StrCat("prompt.token_ids[", i, "] = ", ids[i],
                                      " is outside the vocabulary [0, ", vocab, ")"));
        }
      }
      prompt->assign(ids.begin(), ids.end());
      break;
    }
    default:
      return Invalid("prompt is required: set prompt.text or prompt.token_ids");
  }
  *sampling = services::SamplingFromProto(req.sampling());
  if (absl::Status st = engine::ValidateSamplingParams(*sampling, vocab); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("sampling.", st.message()));
  }
  // A response format compiles here first (cached, as on the workers): a bad schema is
  // refused before any worker is asked.
  if (sampling->constraint.kind != engine::Constraint::Kind::kNone) {
    absl::StatusOr<std::unique_ptr<engine::Sampler>> s =
        engine::MakeSampler(*sampling, model.tokenizer(), *prompt);
    if (!s.ok()) {
      return absl::Status(s.status().code(),
                          absl::StrCat("sampling.response_format.", s.status().message()));
    }
  }
  const int64_t n = static_cast<int64_t>(prompt->size());
  const int64_t ctx = model.ctx_size();
  if (n >= ctx) {
    return Invalid(absl::StrCat("prompt has ", n, " tokens; the context holds ", ctx));
  }
  const int64_t need = n + sampling->max_tokens;
  if (need > ctx) {
    return Invalid(absl::StrCat("sampling.max_tokens: prompt (", n, " tokens) plus max_tokens (",
                                sampling->max_tokens, ") exceeds the context size ", ctx));
  }
  return absl::OkStatus();
}

}  // namespace tandem::router
