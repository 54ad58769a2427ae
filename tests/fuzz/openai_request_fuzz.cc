// libFuzzer target: the router's OpenAI layer without a server. The first byte picks the API
// (completions, chat, tokenize, detokenize); the rest is the JSON body. A body the parser
// accepts then goes through the router's validation, as the HTTP front door's Generate call
// would. Nothing may throw (nlohmann::json throws on bad input unless asked not to) or crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "services/router/chat_template.h"
#include "services/router/http_openai.h"
#include "services/router/request_validation.h"
#include "tests/fuzz/fuzz_model.h"

namespace {

const tandem::router::ChatTemplate& Chat() {
  // A chatml template, as Qwen's and SmolLM's GGUFs carry (recognised by its markers).
  static const auto* chat = new tandem::router::ChatTemplate(
      tandem::router::ChatTemplate::FromTemplateText("{{ '<|im_start|>' + message['role'] }}"));
  return *chat;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tandem::fuzz::FuzzModel();  // written and loaded once, outside the per-input timeout
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  using namespace tandem::router;
  const RouterModel& model = tandem::fuzz::FuzzModel();
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 4) {
    case 0:
    case 1: {
      OpenAiRequest r;
      const ApiKind kind = data[0] % 4 == 0 ? ApiKind::kCompletion : ApiKind::kChat;
      if (std::optional<HttpError> e = ParseOpenAiRequest(kind, body, model, Chat(), &r)) {
        if (e->status < 400 || e->status > 599) std::abort();
        (void)DumpJson(ErrorJson(*e));
        return 0;
      }
      std::vector<int32_t> prompt;
      tandem::engine::SamplingParams sampling;
      absl::Status st =
          ValidateGenerateRequest(r.generate, model, RequestLimits{}, &prompt, &sampling);
      if (!st.ok()) {
        HttpError e = ErrorFromStatus(st, kind);
        if (e.status != 400) std::abort();  // bad input is the client's fault, never a 5xx
        (void)DumpJson(ErrorJson(e));
      }
      break;
    }
    case 2: {
      nlohmann::ordered_json out;
      (void)Tokenize(body, model, Chat(), &out);
      break;
    }
    default: {
      nlohmann::ordered_json out;
      if (!Detokenize(body, model, &out)) (void)DumpJson(out);
      break;
    }
  }
  return 0;
}
