// The prefill worker's side of the KV store (tandem-kvstore): lookups and reads on the request's
// critical path, each under a short deadline, and publishing of newly computed blocks off it.
//
// Reads and publishes move block bytes over the KvTransport (kvstore.proto's data plane): Read
// asks the store to write blocks into this worker's registered KV pool; publishing stages slots
// in the store's staging region, writes the blocks there and commits them with checksums.
//
// Publishing is asynchronous: Publish copies nothing and never blocks; it queues a batch (whose
// bytes the caller already copied out of the KV pool) for one publisher thread, and drops it
// when the queue holds `publish_queue_blocks` blocks already (counted). A store that is down or
// slow therefore costs requests nothing but the lookup's deadline.
//
// Threading: thread-safe. Lookup and Read block their caller for at most their deadline.
// Ownership: the transport is borrowed and must outlive the client.
// Errors: whatever the call or the transport returned; callers treat every error as a miss.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/transfer/transfer.h"
#include "tandem/v1/kvstore.grpc.pb.h"

namespace tandem::prefill {

struct KvStoreClientOptions {
  std::string address;  // host:port of tandem-kvstore; empty: no store
  absl::Duration lookup_timeout = absl::Milliseconds(200);
  absl::Duration read_timeout = absl::Seconds(5);
  absl::Duration publish_timeout = absl::Seconds(10);
  int32_t publish_queue_blocks = 512;  // publishing drops batches past this many queued blocks
  int32_t max_blocks_per_stage = 64;   // a batch is staged and committed in pieces this big
};

// Full blocks to publish: `bytes` holds them back to back, each `block_bytes` long in segment
// order (layer 0 K, layer 0 V, ...), with their chained hashes and KV block checksums
// (tandem/kernels/kv_checksum.h).
struct PublishBatch {
  std::vector<uint64_t> hashes;
  std::vector<uint64_t> checksums;
  uint64_t block_bytes = 0;
  std::vector<uint8_t> bytes;
};

struct KvStoreClientStats {
  uint64_t published_blocks = 0;  // committed and stored
  uint64_t dropped_blocks = 0;    // queue full, or staging/writing/committing failed
  uint64_t rejected_blocks = 0;   // the store refused them (checksum mismatch)
};

class KvStoreClient {
 public:
  static absl::StatusOr<std::unique_ptr<KvStoreClient>> Create(const KvStoreClientOptions& o,
                                                               transfer::KvTransport* transport);
  // Drops what is still queued and joins the publisher.
  ~KvStoreClient();
  KvStoreClient(const KvStoreClient&) = delete;
  KvStoreClient& operator=(const KvStoreClient&) = delete;

  absl::StatusOr<v1::KvLookupResponse> Lookup(std::span<const uint64_t> hashes);
  absl::StatusOr<v1::KvReadResponse> Read(const v1::KvReadRequest& req);
  // False when the batch was dropped (queue full).
  bool Publish(PublishBatch batch);
  // Waits until nothing is queued or being published (tests, benchmarks); false on timeout.
  bool WaitIdle(absl::Duration timeout);
  KvStoreClientStats stats() const;
  const KvStoreClientOptions& options() const { return o_; }

 private:
  KvStoreClient(const KvStoreClientOptions& o, transfer::KvTransport* transport);
  void Loop();
  // Stages, writes and commits blocks [first, first + n) of `b`; the number stored.
  absl::StatusOr<int32_t> PublishPiece(const PublishBatch& b, size_t first, size_t n);

  KvStoreClientOptions o_;
  transfer::KvTransport* transport_;
  std::unique_ptr<v1::KvStore::Stub> stub_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<PublishBatch> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  KvStoreClientStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace tandem::prefill
