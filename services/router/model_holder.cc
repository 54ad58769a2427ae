#include "services/router/model_holder.h"

#include <filesystem>
#include <span>

#include "absl/strings/str_cat.h"
#include "common/gguf/gguf.h"
#include "common/util/status_util.h"
#include "grpcpp/create_channel.h"
#include "services/common/grpc_status.h"
#include "services/common/model_card.h"
#include "services/common/tls.h"
#include "services/router/log.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::router {
namespace {

absl::StatusOr<ChatTemplate> ChatOf(const gguf::GgufFile& file, bool need_chat) {
  absl::StatusOr<ChatTemplate> chat = ChatTemplate::FromGguf(file);
  if (chat.ok() || need_chat) return chat;
  return ChatTemplate();
}

}  // namespace

absl::Status ModelHolder::NotYetKnown() {
  return absl::UnavailableError(
      "no worker has registered yet: this router learns its model from the first worker's "
      "model card");
}

absl::StatusOr<std::unique_ptr<ModelHolder>> ModelHolder::Create(const ModelHolderOptions& o) {
  if (o.ctx_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ctx_size must be >= 0, got ", o.ctx_size));
  }
  if (o.fetch_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the model card fetch timeout must be positive");
  }
  std::unique_ptr<ModelHolder> h(new ModelHolder(o));
  if (o.model_path.empty()) return h;
  absl::MutexLock lock(&h->mu_);  // no other thread has it yet; says so to the analysis
  TANDEM_ASSIGN_OR_RETURN(h->owned_, RouterModel::Load(o.model_path, o.model_id, o.ctx_size));
  if (o.need_chat) {
    // The chat template is GGUF metadata the tokenizer does not keep: read it here (the
    // mapping is opened again, but only the metadata is touched).
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<gguf::GgufFile> file,
                            gguf::GgufFile::Open(o.model_path));
    TANDEM_ASSIGN_OR_RETURN(h->chat_, ChatOf(*file, true));
  }
  h->model_.store(h->owned_.get(), std::memory_order_release);
  return h;
}

std::unique_ptr<ModelHolder> ModelHolder::Of(std::unique_ptr<RouterModel> model,
                                             ChatTemplate chat) {
  std::unique_ptr<ModelHolder> h(new ModelHolder(ModelHolderOptions{}));
  absl::MutexLock lock(&h->mu_);  // no other thread has it yet; says so to the analysis
  h->owned_ = std::move(model);
  h->chat_ = std::move(chat);
  h->model_.store(h->owned_.get(), std::memory_order_release);
  return h;
}

absl::Status ModelHolder::Admit(const v1::RegisterRequest& req) {
  if (!o_.model_path.empty()) return absl::OkStatus();  // a model file: as it always was
  if (model() == nullptr) {
    absl::MutexLock l(&mu_);
    if (model() == nullptr) TANDEM_RETURN_IF_ERROR(Learn(req));
  }
  if (!learned_from_card()) return absl::OkStatus();
  if (req.model_card_hash() != card_hash()) {
    const RouterModel& m = *model();
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", req.worker_id(), " serves model '", req.model(), "' (card ",
        absl::Hex(req.model_card_hash(), absl::kZeroPad16), ") but this router serves '", m.id(),
        "' (", m.path(), ", card ", absl::Hex(card_hash(), absl::kZeroPad16),
        ") learned from the first worker's model card"));
  }
  return absl::OkStatus();
}

absl::Status ModelHolder::Learn(const v1::RegisterRequest& req) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(o_.max_card_bytes);
  auto stub = v1::ModelCardService::NewStub(services::CreateClientChannel(req.address(), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(services::ToChronoDeadline(absl::Now() + o_.fetch_timeout));
  v1::ModelCard card;
  const grpc::Status gs = stub->GetModelCard(&ctx, v1::ModelCardRequest(), &card);
  if (!gs.ok()) {
    return absl::UnavailableError(absl::StrCat("fetching the model card of worker ",
                                               req.worker_id(), " at ", req.address(), ": ",
                                               gs.error_message()));
  }
  const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(card.gguf().data()),
                                       card.gguf().size());
  if (services::ModelCardHash(bytes) != card.card_hash()) {
    return absl::DataLossError(absl::StrCat("the model card of worker ", req.worker_id(),
                                            " does not match its own hash"));
  }
  absl::StatusOr<std::unique_ptr<gguf::GgufFile>> file = gguf::GgufFile::FromBuffer(bytes);
  if (!file.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("the model card of worker ", req.worker_id(),
                                                   ": ", file.status().message()));
  }
  const int32_t ctx_size = o_.ctx_size > 0 ? o_.ctx_size : card.ctx_size();
  TANDEM_ASSIGN_OR_RETURN(owned_, RouterModel::FromGguf(**file, card.model(), o_.model_id,
                                                        std::max(0, ctx_size)));
  TANDEM_ASSIGN_OR_RETURN(chat_, ChatOf(**file, o_.need_chat));
  card_hash_.store(card.card_hash());
  learned_from_card_.store(true);
  model_.store(owned_.get(), std::memory_order_release);
  Logf("learned model %s (%s, context %d, vocab %d) from worker %s's model card %016llx",
       owned_->id().c_str(), owned_->config().arch_name.c_str(), owned_->ctx_size(),
       owned_->vocab_size(), req.worker_id().c_str(),
       static_cast<unsigned long long>(card.card_hash()));
  if (o_.on_learned) o_.on_learned(*owned_);
  return absl::OkStatus();
}

}  // namespace tandem::router
