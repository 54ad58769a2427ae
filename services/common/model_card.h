// The model card a worker serves (tandem.v1.ModelCardService): the served model's metadata as
// a GGUF file without tensors, so a router can tokenise, render chat templates and check
// context limits without the weights (NVIDIA Dynamo's model deployment card plays this part).
//
// BuildModelCard copies every metadata key of the model file (architecture, hyperparameters,
// tokenizer, chat template) into a tensorless GGUF; ModelCardHash names it, so routers can
// tell whether two workers serve the same model as far as the router is concerned.
//
// Threading: ModelCardService is immutable after construction and serves calls concurrently.
// Errors: BuildModelCard returns the GGUF reader's error for an unreadable model file.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::services {

// xxh3-64 of a card's GGUF bytes.
uint64_t ModelCardHash(std::span<const uint8_t> gguf);

// The card of the GGUF model at `model_path`; `ctx_size` as the worker runs with (0: default).
absl::StatusOr<v1::ModelCard> BuildModelCard(const std::string& model_path, int32_t ctx_size);

class ModelCardService final : public v1::ModelCardService::Service {
 public:
  explicit ModelCardService(v1::ModelCard card) : card_(std::move(card)) {}
  grpc::Status GetModelCard(grpc::ServerContext*, const v1::ModelCardRequest*,
                            v1::ModelCard* resp) override {
    *resp = card_;
    return grpc::Status::OK;
  }
  const v1::ModelCard& card() const { return card_; }

 private:
  const v1::ModelCard card_;
};

}  // namespace tandem::services
