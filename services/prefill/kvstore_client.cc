#include "services/prefill/kvstore_client.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "services/common/grpc_status.h"
#include "services/common/tls.h"

namespace tandem::prefill {
namespace {

std::unique_ptr<grpc::ClientContext> Ctx(absl::Duration timeout) {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(services::ToChronoDeadline(absl::Now() + timeout));
  return c;
}

}  // namespace

KvStoreClient::KvStoreClient(const KvStoreClientOptions& o, transfer::KvTransport* transport)
    : o_(o), transport_(transport) {}

absl::StatusOr<std::unique_ptr<KvStoreClient>> KvStoreClient::Create(
    const KvStoreClientOptions& o, transfer::KvTransport* transport) {
  if (o.address.empty()) return absl::InvalidArgumentError("kvstore address is empty");
  if (transport == nullptr) return absl::InvalidArgumentError("kvstore client needs a transport");
  if (o.publish_queue_blocks < 0 || o.max_blocks_per_stage <= 0) {
    return absl::InvalidArgumentError("publish queue and stage sizes must be positive");
  }
  std::unique_ptr<KvStoreClient> c(new KvStoreClient(o, transport));
  grpc::ChannelArguments args;
  // A store that restarts is found again within about a second, not gRPC's default 2 minutes;
  // while it is down every call fails at once (no wait-for-ready) and requests run cold.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  c->stub_ = v1::KvStore::NewStub(
      services::CreateClientChannel(o.address, args));  // TLS when the process has it
  c->thread_ = std::thread([p = c.get()] { p->Loop(); });
  return c;
}

KvStoreClient::~KvStoreClient() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
    cv_.Signal();
  }
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<v1::KvLookupResponse> KvStoreClient::Lookup(std::span<const uint64_t> hashes) {
  v1::KvLookupRequest req;
  req.mutable_block_hashes()->Add(hashes.begin(), hashes.end());
  v1::KvLookupResponse resp;
  const grpc::Status gs = stub_->Lookup(Ctx(o_.lookup_timeout).get(), req, &resp);
  if (!gs.ok()) return services::FromGrpcStatus(gs);
  return resp;
}

absl::StatusOr<v1::KvReadResponse> KvStoreClient::Read(const v1::KvReadRequest& req) {
  v1::KvReadResponse resp;
  const grpc::Status gs = stub_->Read(Ctx(o_.read_timeout).get(), req, &resp);
  if (!gs.ok()) return services::FromGrpcStatus(gs);
  return resp;
}

bool KvStoreClient::Publish(PublishBatch batch) {
  if (batch.hashes.empty()) return true;
  const int64_t n = static_cast<int64_t>(batch.hashes.size());
  absl::MutexLock l(&mu_);
  if (queued_blocks_ + n > o_.publish_queue_blocks) {
    stats_.dropped_blocks += n;
    return false;
  }
  queued_blocks_ += n;
  queue_.push_back(std::move(batch));
  cv_.Signal();
  return true;
}

bool KvStoreClient::WaitIdle(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !busy_; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

KvStoreClientStats KvStoreClient::stats() const {
  absl::MutexLock l(&mu_);
  return stats_;
}

absl::StatusOr<int32_t> KvStoreClient::PublishPiece(const PublishBatch& b, size_t first,
                                                    size_t n) {
  const absl::Time deadline = absl::Now() + o_.publish_timeout;
  v1::KvStageRequest sreq;
  sreq.set_num_blocks(static_cast<int32_t>(n));
  sreq.set_block_bytes(b.block_bytes);
  v1::KvStageResponse stage;
  {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(services::ToChronoDeadline(deadline));
    const grpc::Status gs = stub_->Stage(ctx.get(), sreq, &stage);
    if (!gs.ok()) return services::FromGrpcStatus(gs);
  }
  if (stage.offsets_size() != static_cast<int>(n)) {
    return absl::InternalError(absl::StrCat("kvstore staged ", stage.offsets_size(),
                                            " slots for ", n, " blocks"));
  }
  absl::StatusOr<transfer::RegionDescriptor> region =
      transfer::RegionDescriptor::Parse(std::string_view(stage.region()));
  if (!region.ok()) return region.status();
  std::vector<transfer::WriteOp> ops;
  for (size_t i = 0; i < n; ++i) {
    ops.push_back({b.bytes.data() + (first + i) * b.block_bytes, b.block_bytes,
                   stage.offsets(static_cast<int>(i))});
  }
  absl::Time write_until = deadline;
  if (stage.expires_unix_ms() > 0) {
    write_until =
        std::min(write_until, absl::FromUnixMillis(static_cast<int64_t>(stage.expires_unix_ms())));
  }
  const absl::Duration left = std::max(write_until - absl::Now(), absl::ZeroDuration());
  if (absl::Status st = transport_->Write(*region, std::move(ops), absl::ToChronoMilliseconds(left));
      !st.ok()) {
    return st;
  }
  v1::KvCommitRequest creq;
  creq.set_stage_id(stage.stage_id());
  creq.mutable_block_hashes()->Add(b.hashes.begin() + first, b.hashes.begin() + first + n);
  creq.mutable_checksums()->Add(b.checksums.begin() + first, b.checksums.begin() + first + n);
  v1::KvCommitResponse commit;
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(services::ToChronoDeadline(deadline));
  const grpc::Status gs = stub_->Commit(ctx.get(), creq, &commit);
  if (!gs.ok()) return services::FromGrpcStatus(gs);
  absl::MutexLock l(&mu_);
  stats_.rejected_blocks += commit.integrity_failures();
  return commit.stored();
}

void KvStoreClient::Loop() {
  for (;;) {
    PublishBatch b;
    {
      absl::MutexLock l(&mu_);
      busy_ = false;
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      b = std::move(queue_.front());
      queue_.pop_front();
      queued_blocks_ -= static_cast<int64_t>(b.hashes.size());
      busy_ = true;
    }
    const size_t total = b.hashes.size();
    for (size_t first = 0; first < total;) {
      const size_t n = std::min<size_t>(total - first, o_.max_blocks_per_stage);
      absl::StatusOr<int32_t> stored = PublishPiece(b, first, n);
      absl::MutexLock l(&mu_);
      if (stored.ok()) {
        stats_.published_blocks += *stored;
        stats_.dropped_blocks += n - *stored;
      } else {
        // A store that is down or full drops the rest of the batch: it will be published again
        // by the next request that computes these blocks.
        stats_.dropped_blocks += total - first;
        break;
      }
      first += n;
    }
  }
}

}  // namespace tandem::prefill
