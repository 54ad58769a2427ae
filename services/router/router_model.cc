#include "services/router/router_model.h"

#include <algorithm>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/gguf/gguf.h"
#include "common/util/status_util.h"

namespace tandem::router {

absl::StatusOr<std::unique_ptr<RouterModel>> RouterModel::Load(const std::string& path,
                                                               std::string id, int32_t ctx_size) {
  if (ctx_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ctx_size must be >= 0, got ", ctx_size));
  }
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<gguf::GgufFile> file, gguf::GgufFile::Open(path));
  // The tokenizer copies what it needs; the mapping is released when `file` goes.
  return FromGguf(*file, path, std::move(id), ctx_size);
}

absl::StatusOr<std::unique_ptr<RouterModel>> RouterModel::FromGguf(const gguf::GgufFile& file,
                                                                   std::string path,
                                                                   std::string id,
                                                                   int32_t ctx_size) {
  if (ctx_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ctx_size must be >= 0, got ", ctx_size));
  }
  auto m = std::unique_ptr<RouterModel>(new RouterModel());
  TANDEM_ASSIGN_OR_RETURN(m->config_, engine::ModelConfig::FromGguf(file));
  TANDEM_ASSIGN_OR_RETURN(m->tokenizer_, engine::Tokenizer::FromGguf(file));
  m->id_ = id.empty() ? std::filesystem::path(path).stem().string() : std::move(id);
  m->path_ = std::move(path);
  const int32_t trained = m->config_.n_ctx_train;
  m->ctx_size_ = ctx_size == 0 ? std::min(trained, 4096) : ctx_size;
  return m;
}

bool RouterModel::Matches(const std::string& name) const {
  return name.empty() || name == id_ || name == path_ ||
         name == std::filesystem::path(path_).filename().string();
}

}  // namespace tandem::router
