#include "tools/tandem/generate.h"

#include <chrono>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"
#include "engine/model/model.h"
#include "engine/runtime/draft_proposer.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/scheduler.h"
#include "nlohmann/json.hpp"

namespace tandem::tools {
namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

const char* ReasonName(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kStop:
      return "stop";
    case engine::FinishReason::kLength:
      return "length";
    default:
      return "none";
  }
}

}  // namespace

absl::Status RunGenerate(const GenerateOptions& o) {
  const auto t_start = Clock::now();
  // The CUDA engine uploads GGUF rows, so repacking them for the CPU would be wasted work.
  engine::ModelLoadOptions lo;
  lo.pack_weights = o.device == engine::Device::kCpu;
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<engine::Model> model,
                          engine::Model::Load(o.model_path, lo));
  engine::EngineOptions eo;
  eo.device = o.device;
  eo.threads = o.threads;
  eo.ctx_size = o.ctx_size;
  eo.max_seqs = 1;
  eo.kv_type = o.kv_type;
  eo.max_batch_tokens = o.batch_tokens;
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<engine::Engine> eng, engine::Engine::Create(model, eo));
  const auto t_loaded = Clock::now();

  const engine::Tokenizer& tok = model->tokenizer();
  engine::GenerationRequest req;
  req.id = "generate";
  req.prompt = tok.Encode(o.prompt, /*add_special=*/true, /*parse_special=*/true);
  req.sampling = o.sampling;

  std::vector<int32_t> generated;
  std::string text;
  engine::FinishReason reason = engine::FinishReason::kNone;
  absl::Status failure;
  Clock::time_point t_first{};
  req.on_event = [&](const engine::TokenEvent& ev) {
    if (ev.token >= 0) {
      if (generated.empty()) t_first = Clock::now();
      generated.push_back(ev.token);
    }
    text += ev.text;
    if (!o.json && !ev.text.empty()) {
      std::fwrite(ev.text.data(), 1, ev.text.size(), stdout);
      std::fflush(stdout);
    }
    if (ev.finished) {
      reason = ev.reason;
      failure = ev.status;
    }
  };
  const std::vector<int32_t> prompt_tokens = req.prompt;
  engine::SchedulerOptions so;
  so.speculative = o.speculative;
  TANDEM_ASSIGN_OR_RETURN(so.proposer, engine::MakeSpecProposer(o.speculative, *eng));
  engine::Scheduler sched(eng.get(), so);
  TANDEM_RETURN_IF_ERROR(sched.Submit(std::move(req)));
  if (!o.json) {
    std::fwrite(o.prompt.data(), 1, o.prompt.size(), stdout);
    std::fflush(stdout);
  }
  const auto t_gen = Clock::now();
  TANDEM_RETURN_IF_ERROR(sched.RunUntilIdle());
  const auto t_end = Clock::now();
  TANDEM_RETURN_IF_ERROR(failure);

  const double prompt_ms = generated.empty() ? 0 : MsSince(t_gen, t_first);
  const double decode_ms = generated.empty() ? 0 : MsSince(t_first, t_end);
  const double decode_tps =
      generated.size() > 1 && decode_ms > 0 ? (generated.size() - 1) * 1000.0 / decode_ms : 0;
  if (o.json) {
    nlohmann::json j;
    j["model"] = o.model_path;
    j["prompt"] = o.prompt;
    j["prompt_tokens"] = prompt_tokens;
    j["tokens"] = generated;
    j["text"] = text;
    j["finish_reason"] = ReasonName(reason);
    j["device"] = engine::DeviceName(o.device);
    j["timings"] = {
        {"load_ms", MsSince(t_start, t_loaded)},
        {"ttft_ms", prompt_ms},
        {"prompt_tokens_per_s", prompt_ms > 0 ? prompt_tokens.size() * 1000.0 / prompt_ms : 0},
        {"decode_ms", decode_ms},
        {"decode_tokens_per_s", decode_tps},
        {"total_ms", MsSince(t_start, t_end)},
    };
    const engine::SchedulerStats& st = sched.stats();
    j["speculative"] = {
        {"method", engine::SpecMethodName(o.speculative.method)},
        {"steps", st.steps},
        {"verify_steps", st.spec_steps},
        {"draft_tokens", st.spec_draft_tokens},
        {"accepted_tokens", st.spec_accepted_tokens},
        // Tokens kept per verify step, drafts plus the target's own: 1 + accepted / steps.
        {"mean_accept_length",
         st.spec_steps > 0 ? 1.0 + double(st.spec_accepted_tokens) / st.spec_steps : 0.0},
        {"accepted_hist", st.accepted_hist},
    };
    // Invalid UTF-8 cannot occur (the streaming decoder repairs it), but stay safe.
    std::string out = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    std::printf("%s\n", out.c_str());
  } else {
    std::printf("\n");
    std::fflush(stdout);  // the summary on stderr belongs after the text
    std::fprintf(stderr,
                 "[tandem] prompt %zu tokens, generated %zu tokens, ttft %.1f ms, "
                 "decode %.2f tok/s, finish %s\n",
                 prompt_tokens.size(), generated.size(), prompt_ms, decode_tps,
                 ReasonName(reason));
    const engine::SchedulerStats& st = sched.stats();
    if (o.speculative.method != engine::SpecMethod::kOff) {
      std::fprintf(stderr, "[tandem] speculative %s: %lld of %lld draft tokens accepted\n",
                   std::string(engine::SpecMethodName(o.speculative.method)).c_str(),
                   static_cast<long long>(st.spec_accepted_tokens),
                   static_cast<long long>(st.spec_draft_tokens));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::tools
