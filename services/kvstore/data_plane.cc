#include "services/kvstore/data_plane.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/util/status_util.h"
#include "services/common/kv_layout.h"
#include "services/kvstore/kvstore_service.h"

namespace tandem::kvstore {

KvDataPlane::KvDataPlane(const DataPlaneOptions& o, TieredStore* store) : o_(o), store_(store) {}

absl::StatusOr<std::unique_ptr<KvDataPlane>> KvDataPlane::Create(const DataPlaneOptions& o,
                                                                 TieredStore* store) {
  if (o.transport == nullptr) return absl::InvalidArgumentError("the data plane needs a transport");
  if (store == nullptr) return absl::InvalidArgumentError("the data plane needs a store");
  if (o.slot_bytes == 0 || o.staging_bytes < o.slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("staging region of ", o.staging_bytes,
                                                   " bytes holds no slot of ", o.slot_bytes));
  }
  if (o.stage_lease <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("stage lease must be positive");
  }
  std::unique_ptr<KvDataPlane> d(new KvDataPlane(o, store));
  d->num_slots_ = static_cast<int32_t>(std::min<uint64_t>(o.staging_bytes / o.slot_bytes, 1 << 30));
  const uint64_t bytes = uint64_t(d->num_slots_) * o.slot_bytes;
  // Transport-allocated memory first: a local publisher then writes with a single memcpy.
  absl::StatusOr<transfer::AllocatedRegion> a = o.transport->AllocateRegion(bytes);
  if (a.ok()) {
    d->staging_ = static_cast<uint8_t*>(a->base);
    d->region_ = a->descriptor;
  } else if (a.status().code() == absl::StatusCode::kUnimplemented) {
    d->owned_.reset(new uint8_t[bytes]);
    d->staging_ = d->owned_.get();
    TANDEM_ASSIGN_OR_RETURN(d->region_, o.transport->RegisterRegion(d->staging_, bytes));
  } else {
    return a.status();
  }
  d->region_bytes_ = d->region_.Serialize();
  absl::MutexLock l(&d->mu_);
  d->next_stage_ = (static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) << 8) | 1;
  for (int32_t s = d->num_slots_ - 1; s >= 0; --s) d->free_.push_back(static_cast<uint32_t>(s));
  return d;
}

KvDataPlane::~KvDataPlane() { (void)o_.transport->DeregisterRegion(region_.region_id); }

int32_t KvDataPlane::free_slots() const {
  absl::MutexLock l(&mu_);
  return static_cast<int32_t>(free_.size());
}

void KvDataPlane::ExpireLocked(absl::Time now) {
  for (auto it = stages_.begin(); it != stages_.end();) {
    if (it->second.expires <= now) {
      // A slow publisher may still be writing: hold the slots one more lease before reuse.
      cooling_.push_back({std::move(it->second.slots), it->second.expires + o_.stage_lease});
      stages_.erase(it++);
    } else {
      ++it;
    }
  }
  for (auto it = cooling_.begin(); it != cooling_.end();) {
    if (it->until <= now) {
      free_.insert(free_.end(), it->slots.begin(), it->slots.end());
      it = cooling_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<v1::KvStageResponse> KvDataPlane::Stage(const v1::KvStageRequest& req) {
  if (req.num_blocks() <= 0) return absl::InvalidArgumentError("num_blocks must be positive");
  if (req.block_bytes() == 0 || req.block_bytes() > o_.slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("block_bytes ", req.block_bytes(),
                                                   " must be in (0, ", o_.slot_bytes, "]"));
  }
  const absl::Time now = absl::Now();
  v1::KvStageResponse resp;
  absl::MutexLock l(&mu_);
  ExpireLocked(now);
  if (static_cast<int64_t>(free_.size()) < req.num_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat("staging region: ", free_.size(),
                                                     " free slots, ", req.num_blocks(),
                                                     " asked for"));
  }
  StageEntry e;
  e.block_bytes = req.block_bytes();
  e.expires = now + o_.stage_lease;
  for (int i = 0; i < req.num_blocks(); ++i) {
    e.slots.push_back(free_.back());
    free_.pop_back();
    resp.add_offsets(uint64_t(e.slots.back()) * o_.slot_bytes);
  }
  const uint64_t id = next_stage_++;
  resp.set_stage_id(id);
  resp.set_region(region_bytes_);
  resp.set_expires_unix_ms(static_cast<uint64_t>(absl::ToUnixMillis(e.expires)));
  stages_.emplace(id, std::move(e));
  return resp;
}

absl::StatusOr<v1::KvCommitResponse> KvDataPlane::Commit(const v1::KvCommitRequest& req) {
  StageEntry e;
  {
    absl::MutexLock l(&mu_);
    ExpireLocked(absl::Now());
    auto it = stages_.find(req.stage_id());
    if (it == stages_.end()) {
      return absl::NotFoundError(
          absl::StrCat("stage ", absl::Hex(req.stage_id()), " is unknown or expired"));
    }
    if (req.block_hashes_size() != static_cast<int>(it->second.slots.size()) ||
        req.checksums_size() != req.block_hashes_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("commit names ", req.block_hashes_size(), " hashes and ",
                       req.checksums_size(), " checksums for ", it->second.slots.size(),
                       " staged blocks"));
    }
    // Out of the table: from here no other call sees this stage.
    e = std::move(it->second);
    stages_.erase(it);
  }
  v1::KvCommitResponse resp;
  absl::Status first_error;
  for (size_t i = 0; i < e.slots.size(); ++i) {
    const uint8_t* p = staging_ + uint64_t(e.slots[i]) * o_.slot_bytes;
    if (services::KvBytesChecksum(p, e.block_bytes) != req.checksums(static_cast<int>(i))) {
      store_->CountRejectedBlock();
      resp.set_integrity_failures(resp.integrity_failures() + 1);
      continue;
    }
    absl::Status st = store_->Put(req.block_hashes(static_cast<int>(i)),
                                  std::span<const uint8_t>(p, e.block_bytes));
    if (st.ok()) {
      resp.set_stored(resp.stored() + 1);
    } else if (first_error.ok()) {
      first_error = st;
    }
  }
  {
    absl::MutexLock l(&mu_);
    free_.insert(free_.end(), e.slots.begin(), e.slots.end());
  }
  if (resp.stored() == 0 && !first_error.ok()) return first_error;
  return resp;
}

absl::StatusOr<v1::KvReadResponse> KvDataPlane::Read(const v1::KvReadRequest& req,
                                                     absl::Time deadline) {
  const v1::KvRegionLayout& dst = req.destination();
  if (req.block_ids_size() < req.block_hashes_size()) {
    return absl::InvalidArgumentError(absl::StrCat("read names ", req.block_hashes_size(),
                                                   " blocks but only ", req.block_ids_size(),
                                                   " destination block ids"));
  }
  if (dst.num_layers() <= 0 || dst.segment_bytes() == 0) {
    return absl::InvalidArgumentError("destination layout needs num_layers and segment_bytes");
  }
  TANDEM_ASSIGN_OR_RETURN(transfer::RegionDescriptor region,
                          transfer::RegionDescriptor::Parse(std::string_view(dst.region())));
  const uint64_t segments = 2 * uint64_t(dst.num_layers());
  const uint64_t block_bytes = segments * dst.segment_bytes();
  v1::KvReadResponse resp;
  // The blocks' bytes stay here until every write that reads them has completed.
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<transfer::WriteOp> ops;
  for (int i = 0; i < req.block_ids_size(); ++i) {
    if (req.block_ids(i) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("block id ", req.block_ids(i), " is negative"));
    }
  }
  absl::Status stop;
  std::vector<TieredStore::Found> found = store_->GetPrefix(
      std::span<const uint64_t>(req.block_hashes().data(), req.block_hashes_size()), &stop);
  for (size_t i = 0; i < found.size(); ++i) {
    const int32_t b = req.block_ids(static_cast<int>(i));
    // A block stored by a worker with another KV shape is not this requester's block.
    if (found[i].data.size() != block_bytes) {
      stop = absl::OkStatus();
      break;
    }
    resp.add_tiers(ToProtoTier(found[i].tier));
    resp.add_checksums(services::KvBytesChecksum(found[i].data.data(), found[i].data.size()));
    blocks.push_back(std::move(found[i].data));
    const uint8_t* src = blocks.back().data();
    for (uint64_t s = 0; s < segments; ++s) {
      const uint64_t off =
          (s / 2) * dst.layer_stride() + (s % 2) * dst.kv_stride() + uint64_t(b) * dst.segment_bytes();
      ops.push_back({src + s * dst.segment_bytes(), dst.segment_bytes(), off});
    }
  }
  if (absl::IsDataLoss(stop)) {
    resp.set_integrity_failures(resp.integrity_failures() + 1);
  } else if (!stop.ok() && !absl::IsNotFound(stop) && blocks.size() == found.size()) {
    return stop;
  }
  resp.set_read(static_cast<int32_t>(blocks.size()));
  if (ops.empty()) return resp;
  const absl::Duration left =
      std::clamp(deadline - absl::Now(), absl::ZeroDuration(), o_.max_write_time);
  const absl::Time t0 = absl::Now();
  TANDEM_RETURN_IF_ERROR(
      o_.transport->Write(region, std::move(ops), absl::ToChronoMilliseconds(left)));
  resp.set_transfer_seconds(absl::ToDoubleSeconds(absl::Now() - t0));
  resp.set_bytes(blocks.size() * block_bytes);
  return resp;
}

}  // namespace tandem::kvstore
