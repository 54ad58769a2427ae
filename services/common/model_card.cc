#include "services/common/model_card.h"

#include <xxhash.h>

#include <filesystem>

#include "common/gguf/gguf.h"
#include "common/util/status_util.h"

namespace tandem::services {

uint64_t ModelCardHash(std::span<const uint8_t> gguf) {
  return XXH3_64bits(gguf.data(), gguf.size());
}

absl::StatusOr<v1::ModelCard> BuildModelCard(const std::string& model_path, int32_t ctx_size) {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<gguf::GgufFile> file, gguf::GgufFile::Open(model_path));
  gguf::GgufWriter w;
  for (const gguf::KeyValue& kv : file->metadata()) {
    // These describe the weights' encoding, which the card leaves out: the same model
    // quantised differently has the same card.
    if (kv.key == "general.alignment" || kv.key == "general.file_type" ||
        kv.key == "general.quantization_version") {
      continue;
    }
    w.CopyValue(std::string(kv.key), kv.value);
  }
  TANDEM_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, w.WriteToBuffer());
  v1::ModelCard card;
  card.set_model(std::filesystem::path(model_path).filename().string());
  card.set_ctx_size(ctx_size);
  card.set_card_hash(ModelCardHash(bytes));
  card.set_gguf(std::string(bytes.begin(), bytes.end()));
  return card;
}

}  // namespace tandem::services
