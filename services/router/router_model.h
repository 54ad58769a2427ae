// RouterModel: what the router needs of the served model — its tokenizer and a few
// hyperparameters — read from the GGUF file without binding or touching the weights.
//
// Threading: immutable after Load; safe to share between threads.
// Errors: Load returns the GGUF or tokenizer error (NOT_FOUND for a missing file,
// INVALID_ARGUMENT for a malformed one, UNIMPLEMENTED for an unknown tokenizer).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/gguf/gguf.h"
#include "engine/model/model.h"
#include "engine/tokenizer/tokenizer.h"

namespace tandem::router {

class RouterModel {
 public:
  // ctx_size: the per-sequence context the workers run with; 0 means the engine's default,
  // min(trained context, 4096). Requests beyond it are rejected here, before any worker.
  static absl::StatusOr<std::unique_ptr<RouterModel>> Load(const std::string& path, std::string id,
                                                           int32_t ctx_size);
  // The same from an open GGUF (a worker's metadata-only model card, model_holder.h); `path`
  // is the name the model file goes by (the card's model file name).
  static absl::StatusOr<std::unique_ptr<RouterModel>> FromGguf(const gguf::GgufFile& file,
                                                               std::string path, std::string id,
                                                               int32_t ctx_size);

  const std::string& id() const { return id_; }  // the name clients use; default: file stem
  const std::string& path() const { return path_; }
  const engine::Tokenizer& tokenizer() const { return *tokenizer_; }
  const engine::ModelConfig& config() const { return config_; }
  int32_t ctx_size() const { return ctx_size_; }
  int32_t vocab_size() const { return tokenizer_->vocab_size(); }
  // True when a request's model field names this model (empty, id, path or file name).
  bool Matches(const std::string& name) const;

 private:
  RouterModel() = default;
  std::string id_, path_;
  std::unique_ptr<engine::Tokenizer> tokenizer_;
  engine::ModelConfig config_;
  int32_t ctx_size_ = 0;
};

}  // namespace tandem::router
