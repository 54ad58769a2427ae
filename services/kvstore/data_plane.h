// The KV store's data plane: block bytes move over the KvTransport, the gRPC calls only say
// which blocks and where (proto/tandem/v1/kvstore.proto: Read, Stage, Commit).
//
// Read: the store copies each requested block out of its tier (a hit promotes it, as Get does),
// writes its segments into the requester's registered region at the offsets its layout gives,
// waits until the transport says they are visible there, and answers with each block's tier and
// checksum (tandem/kernels/kv_checksum.h). The requester checks those checksums over its own copy.
// Stage/Commit: the store owns one registered staging region cut into equal slots (the largest
// block the store accepts). Stage hands out slots under a lease; the publisher writes blocks into
// them with its transport; Commit checksums every staged block and stores only those that match
// what the publisher says it sent. A mismatch is refused and counted
// (TieredStoreStats::rejected_blocks, i.e. kv_integrity_failures_total). Slots of a stage that is
// never committed come back after its lease plus one more lease of quarantine, so a late write
// from a slow publisher cannot land in a slot handed to someone else before that; if one still
// does, the next commit of that slot fails its checksum instead of storing wrong bytes.
//
// Threading: thread-safe. Read blocks its caller until the writes finish or the deadline passes.
// Ownership: the transport and the store are borrowed and must outlive the data plane; the
// staging region is the data plane's and is deregistered by its destructor.
// Errors: INVALID_ARGUMENT (a malformed request), RESOURCE_EXHAUSTED (no free staging slots: the
// publisher should drop the blocks, not wait), NOT_FOUND (unknown or expired stage), the
// transport's status when a write fails (UNAVAILABLE for a dead requester, DEADLINE_EXCEEDED).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/transfer/transfer.h"
#include "services/kvstore/tiered_store.h"
#include "tandem/v1/kvstore.pb.h"

namespace tandem::kvstore {

struct DataPlaneOptions {
  transfer::KvTransport* transport = nullptr;  // required, borrowed
  uint64_t staging_bytes = 64ull << 20;
  uint64_t slot_bytes = 64 << 10;  // the largest block (TieredStoreConfig::device_slot_bytes)
  absl::Duration stage_lease = absl::Seconds(10);
  // Bounds a Read's writes when the call has no deadline.
  absl::Duration max_write_time = absl::Seconds(30);
};

class KvDataPlane {
 public:
  static absl::StatusOr<std::unique_ptr<KvDataPlane>> Create(const DataPlaneOptions& o,
                                                             TieredStore* store);
  ~KvDataPlane();
  KvDataPlane(const KvDataPlane&) = delete;
  KvDataPlane& operator=(const KvDataPlane&) = delete;

  absl::StatusOr<v1::KvReadResponse> Read(const v1::KvReadRequest& req, absl::Time deadline);
  absl::StatusOr<v1::KvStageResponse> Stage(const v1::KvStageRequest& req);
  absl::StatusOr<v1::KvCommitResponse> Commit(const v1::KvCommitRequest& req);

  int32_t free_slots() const;
  int32_t num_slots() const { return num_slots_; }

 private:
  struct StageEntry {
    std::vector<uint32_t> slots;
    uint64_t block_bytes = 0;
    absl::Time expires;
  };
  struct Cooling {
    std::vector<uint32_t> slots;
    absl::Time until;
  };
  KvDataPlane(const DataPlaneOptions& o, TieredStore* store);
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  DataPlaneOptions o_;
  TieredStore* store_;
  uint8_t* staging_ = nullptr;
  std::unique_ptr<uint8_t[]> owned_;  // when the transport could not allocate the region
  transfer::RegionDescriptor region_;
  std::string region_bytes_;
  int32_t num_slots_ = 0;

  mutable absl::Mutex mu_;
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, StageEntry> stages_ ABSL_GUARDED_BY(mu_);
  std::vector<Cooling> cooling_ ABSL_GUARDED_BY(mu_);
  uint64_t next_stage_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace tandem::kvstore
