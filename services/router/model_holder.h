// ModelHolder: the one place the router's services read the served model through.
//
// With a model file (--model) the model is known from the start, as it always was. Without
// one the router learns it from the workers (NVIDIA Dynamo's model deployment card): the first
// worker that registers is asked for its ModelCard (services/common/model_card.h, a
// metadata-only GGUF with the tokenizer, chat template and hyperparameters), bounded by
// fetch_timeout; a failed fetch refuses that registration with UNAVAILABLE, so the worker's
// retry (or the next worker's registration) tries again. Until then model() is null and the
// services answer UNAVAILABLE ("no worker has registered yet"). Once learned, a worker whose
// card hash differs is refused at Register with FAILED_PRECONDITION naming both models.
//
// Threading: model() and chat() may be called from any thread; once non-null they stay valid
// and unchanged for the holder's life. Admit may be called concurrently (card fetches are
// serialised). on_learned runs once, on the registering thread, before Admit returns OK.
// Errors: Create returns the model file's errors; Admit as above.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "services/router/chat_template.h"
#include "services/router/router_model.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::router {

struct ModelHolderOptions {
  std::string model_path;  // empty: learn the model from the first worker's card
  std::string model_id;    // empty: the file's (or the card's model file's) stem
  int32_t ctx_size = 0;    // 0: the card's, else min(trained context, 4096)
  // The chat template must parse (the HTTP front door renders it); otherwise a bad one only
  // leaves chat() the fallback.
  bool need_chat = false;
  absl::Duration fetch_timeout = absl::Milliseconds(1500);
  int max_card_bytes = 256 << 20;
  // Called once when the model becomes known from a card.
  std::function<void(const RouterModel&)> on_learned;
};

class ModelHolder {
 public:
  static absl::StatusOr<std::unique_ptr<ModelHolder>> Create(const ModelHolderOptions& o);
  // A holder of an already-loaded model (tests, tools).
  static std::unique_ptr<ModelHolder> Of(std::unique_ptr<RouterModel> model, ChatTemplate chat);

  const RouterModel* model() const { return model_.load(std::memory_order_acquire); }
  const ChatTemplate* chat() const { return model() == nullptr ? nullptr : &chat_; }
  bool learned_from_card() const { return learned_from_card_.load(); }
  uint64_t card_hash() const { return card_hash_.load(); }

  // Whether the worker registering with `req` may join (see above). OK at once with a model
  // file.
  absl::Status Admit(const v1::RegisterRequest& req);

  // The UNAVAILABLE every service answers before the model is known.
  static absl::Status NotYetKnown();

 private:
  explicit ModelHolder(const ModelHolderOptions& o) : o_(o) {}
  absl::Status Learn(const v1::RegisterRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ModelHolderOptions o_;
  absl::Mutex mu_;  // serialises learning
  std::unique_ptr<RouterModel> owned_ ABSL_GUARDED_BY(mu_);
  ChatTemplate chat_;  // written before model_ is published, then read-only
  std::atomic<const RouterModel*> model_{nullptr};
  std::atomic<bool> learned_from_card_{false};
  std::atomic<uint64_t> card_hash_{0};
};

}  // namespace tandem::router
