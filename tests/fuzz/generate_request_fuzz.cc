// libFuzzer target: bytes parsed as a tandem.v1.GenerateRequest (what the router's gRPC server
// hands the service), then the router's validation (request_validation.h). A request that
// passes must respect what the workers rely on: ids inside the vocabulary and prompt plus
// max_tokens within the context.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "services/router/request_validation.h"
#include "tandem/v1/inference.pb.h"
#include "tests/fuzz/fuzz_model.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tandem::fuzz::FuzzModel();  // written and loaded once, outside the per-input timeout
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const tandem::router::RouterModel& model = tandem::fuzz::FuzzModel();
  tandem::v1::GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  std::vector<int32_t> prompt;
  tandem::engine::SamplingParams sampling;
  absl::Status st = tandem::router::ValidateGenerateRequest(
      req, model, tandem::router::RequestLimits{}, &prompt, &sampling);
  if (!st.ok()) {
    if (st.message().empty()) std::abort();  // every refusal names its field
    return 0;
  }
  if (prompt.empty()) std::abort();
  for (int32_t id : prompt) {
    if (id < 0 || id >= model.vocab_size()) std::abort();
  }
  if (static_cast<int64_t>(prompt.size()) + sampling.max_tokens > model.ctx_size()) std::abort();
  // Round trip through the wire form the workers receive.
  std::string wire;
  if (!req.SerializeToString(&wire)) std::abort();
  return 0;
}
