#include "tools/tandem/client.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "services/common/sampling_convert.h"
#include "services/common/tls.h"
#include "tandem/v1/inference.grpc.pb.h"

namespace tandem::tools {
namespace {

using Clock = std::chrono::steady_clock;

double MsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The same names `tandem generate --json` prints.
const char* ReasonName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    case v1::FINISH_REASON_ERROR:
      return "error";
    default:
      return "none";
  }
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return v[i];
}

}  // namespace

absl::Status RunClient(const ClientOptions& o) {
  if (o.router.empty()) return absl::InvalidArgumentError("--router is required");
  const auto t_start = Clock::now();
  // TLS when `tandem` was given --tls-* (services/common/tls.h).
  // round_robin: a name listing several routers spreads clients over them (tls.h).
  auto channel = services::CreateClientChannel(o.router, services::RouterChannelArgs());
  auto stub = v1::Inference::NewStub(channel);

  v1::GenerateRequest req;
  req.set_text(o.prompt);
  req.set_model(o.model);
  req.set_request_id(o.request_id);
  if (!o.priority.empty()) {
    absl::StatusOr<v1::Priority> p = services::PriorityFromName(o.priority);
    if (!p.ok()) return absl::InvalidArgumentError(absl::StrCat("--", p.status().message()));
    req.set_priority(*p);
  }
  req.set_ttft_target_ms(o.ttft_target_ms);
  req.set_tpot_target_ms(o.tpot_target_ms);
  req.set_session_id(o.session);
  *req.mutable_sampling() = services::SamplingToProto(o.sampling);
  grpc::ClientContext cc;
  if (!o.api_key.empty()) cc.AddMetadata("authorization", "Bearer " + o.api_key);
  if (o.timeout_ms > 0) {
    cc.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(o.timeout_ms));
  }
  if (!o.json) {
    std::fwrite(o.prompt.data(), 1, o.prompt.size(), stdout);
    std::fflush(stdout);
  }
  const auto t_sent = Clock::now();
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub->Generate(&cc, req);
  v1::GenerateResponse m;
  std::vector<int32_t> tokens, prompt_tokens;
  std::vector<double> gaps_ms;  // between consecutive token arrivals
  std::string text, request_id, prefill_worker, decode_worker;
  v1::FinishReason reason = v1::FINISH_REASON_UNSPECIFIED;
  v1::TtftBreakdown server_ttft;
  v1::Usage usage;
  Clock::time_point t_first{}, t_last{};
  while (reader->Read(&m)) {
    const auto now = Clock::now();
    if (m.token_ids_size() > 0) {
      if (tokens.empty()) {
        t_first = now;
      } else {
        gaps_ms.push_back(MsBetween(t_last, now));
      }
      t_last = now;
      tokens.insert(tokens.end(), m.token_ids().begin(), m.token_ids().end());
    }
    if (m.prompt_token_ids_size() > 0) {
      prompt_tokens.assign(m.prompt_token_ids().begin(), m.prompt_token_ids().end());
    }
    if (m.has_ttft()) server_ttft = m.ttft();
    if (!m.request_id().empty()) request_id = m.request_id();
    if (!m.prefill_worker().empty()) prefill_worker = m.prefill_worker();
    if (!m.decode_worker().empty()) decode_worker = m.decode_worker();
    text += m.text();
    if (!o.json && !m.text().empty()) {
      std::fwrite(m.text().data(), 1, m.text().size(), stdout);
      std::fflush(stdout);
    }
    if (m.finished()) {
      reason = m.finish_reason();
      usage = m.usage();
    }
  }
  const grpc::Status gs = reader->Finish();
  const auto t_end = Clock::now();
  if (!o.json) std::printf("\n");
  std::fflush(stdout);  // the summary on stderr belongs after the text
  if (!gs.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(gs.error_code()),
                        absl::StrCat("router ", o.router, ": ", gs.error_message()));
  }
  const double ttft_ms = tokens.empty() ? 0 : MsBetween(t_sent, t_first);
  const double decode_ms = tokens.empty() ? 0 : MsBetween(t_first, t_end);
  double itl_mean = 0;
  for (double g : gaps_ms) itl_mean += g;
  if (!gaps_ms.empty()) itl_mean /= gaps_ms.size();
  const double decode_tps =
      tokens.size() > 1 && decode_ms > 0 ? (tokens.size() - 1) * 1000.0 / decode_ms : 0;
  if (o.json) {
    nlohmann::json j;
    j["router"] = o.router;
    j["request_id"] = request_id;
    j["prompt"] = o.prompt;
    j["prompt_tokens"] = prompt_tokens;
    j["tokens"] = tokens;
    j["text"] = text;
    j["finish_reason"] = ReasonName(reason);
    j["prefill_worker"] = prefill_worker;
    j["decode_worker"] = decode_worker;
    j["usage"] = {{"prompt_tokens", usage.prompt_tokens()},
                  {"completion_tokens", usage.completion_tokens()},
                  {"cached_prompt_tokens", usage.cached_prompt_tokens()},
                  {"kv_transfer_bytes", usage.kv_transfer_bytes()},
                  {"decode_held_tokens", usage.decode_held_tokens()}};
    if (usage.spec_verify_steps() > 0) {
      j["usage"]["spec_verify_steps"] = usage.spec_verify_steps();
      j["usage"]["spec_draft_tokens"] = usage.spec_draft_tokens();
      j["usage"]["spec_accepted_tokens"] = usage.spec_accepted_tokens();
    }
    j["timings"] = {
        {"load_ms", MsBetween(t_start, t_sent)},
        {"ttft_ms", ttft_ms},
        {"prompt_tokens_per_s", ttft_ms > 0 ? prompt_tokens.size() * 1000.0 / ttft_ms : 0},
        {"decode_ms", decode_ms},
        {"decode_tokens_per_s", decode_tps},
        {"inter_token_ms", itl_mean},
        {"inter_token_p50_ms", Percentile(gaps_ms, 0.5)},
        {"inter_token_p99_ms", Percentile(gaps_ms, 0.99)},
        {"total_ms", MsBetween(t_start, t_end)},
        {"server_ttft_ms",
         {{"queue", server_ttft.queue() * 1000},
          {"prefill_compute", server_ttft.prefill_compute() * 1000},
          {"kv_transfer", server_ttft.kv_transfer() * 1000},
          {"prefix_onboarding", server_ttft.prefix_onboarding() * 1000},
          {"first_decode_step", server_ttft.first_decode_step() * 1000},
          {"total", server_ttft.total() * 1000}}},
    };
    std::string out = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    std::printf("%s\n", out.c_str());
  } else {
    std::fprintf(stderr,
                 "[tandem] prompt %zu tokens, generated %zu tokens, ttft %.1f ms, "
                 "inter-token %.2f ms (p50 %.2f, p99 %.2f), decode %.2f tok/s, finish %s "
                 "(prefill %s, decode %s)\n",
                 prompt_tokens.size(), tokens.size(), ttft_ms, itl_mean, Percentile(gaps_ms, 0.5),
                 Percentile(gaps_ms, 0.99), decode_tps, ReasonName(reason), prefill_worker.c_str(),
                 decode_worker.c_str());
  }
  return absl::OkStatus();
}

}  // namespace tandem::tools
