// libFuzzer target: the GGUF reader, then the tokenizer and model-config readers on whatever it
// accepts. The reader promises that any byte string yields a Status, never a crash or an
// out-of-bounds read (common/gguf/gguf.h); ASan holds it to that.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common/gguf/gguf.h"
#include "engine/model/model.h"
#include "engine/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A heap copy of exactly `size` bytes, so ASan sees any read past the end.
  std::unique_ptr<uint8_t[]> copy(new uint8_t[size == 0 ? 1 : size]);
  if (size > 0) std::memcpy(copy.get(), data, size);
  auto file = tandem::gguf::GgufFile::FromBuffer({copy.get(), size});
  if (!file.ok()) return 0;
  const tandem::gguf::GgufFile& f = **file;
  // Touch every view the reader hands out.
  uint64_t sink = 0;
  for (const tandem::gguf::KeyValue& kv : f.metadata()) {
    sink += kv.key.size();
    if (const auto* a = std::get_if<tandem::gguf::Array>(&kv.value.v)) {
      for (std::string_view s : a->strings) sink += s.empty() ? 0 : static_cast<uint8_t>(s.back());
    }
    if (const auto* s = std::get_if<std::string_view>(&kv.value.v)) sink += s->size();
  }
  for (const tandem::gguf::TensorInfo& t : f.tensors()) {
    if (t.nbytes > 0 && t.data != nullptr) sink += t.data[0] + t.data[t.nbytes - 1];
    sink += static_cast<uint64_t>(t.NumElements());
  }
  (void)f.GetF32Array("tokenizer.ggml.scores");
  (void)f.GetIntArray("tokenizer.ggml.token_type");
  (void)tandem::engine::ModelConfig::FromGguf(f);
  auto tok = tandem::engine::Tokenizer::FromGguf(f);
  if (tok.ok()) {
    std::vector<int32_t> ids = (*tok)->Encode("Hello world <s> 123", true, true);
    sink += (*tok)->Decode(ids, true).size();
  }
  // Keep the reads: the sum escapes through a volatile store.
  volatile uint64_t escape = sink;
  (void)escape;
  return 0;
}
