#include "engine/kv/block_pool.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"
#include "xxhash.h"

namespace tandem::engine {

BlockPool::BlockPool(int32_t num_blocks) : refs_(num_blocks, 0) {
  free_.reserve(num_blocks);
  for (int32_t i = num_blocks - 1; i >= 0; --i) free_.push_back(i);
}

absl::StatusOr<int32_t> BlockPool::Allocate() {
  if (free_.empty() && reclaimer_ != nullptr) reclaimer_->ReclaimOne();
  if (free_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: all ", num_blocks(), " blocks in use"));
  }
  int32_t b = free_.back();
  free_.pop_back();
  refs_[b] = 1;
  return b;
}

absl::StatusOr<std::vector<int32_t>> BlockPool::AllocateN(int32_t n) {
  if (n > num_available()) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache full: need ", n, " blocks, ",
                                                     num_free(), " of ", num_blocks(), " free"));
  }
  std::vector<int32_t> out;
  out.reserve(n);
  for (int32_t i = 0; i < n; ++i) out.push_back(*Allocate());
  return out;
}

absl::Status BlockPool::CheckHeld(int32_t block, const char* verb, const char* bug) {
  absl::Status st;
  if (block < 0 || block >= num_blocks()) {
    st = absl::OutOfRangeError(
        absl::StrCat("KV block ", block, " ", verb, ": the pool has ", num_blocks()));
  } else if (refs_[block] <= 0) {
    st = absl::FailedPreconditionError(
        absl::StrCat("KV block ", block, " ", verb, " while free (a ", bug, ")"));
  } else {
    return absl::OkStatus();
  }
  return Violation(std::move(st));
}

absl::Status BlockPool::Violation(absl::Status st) {
  ++violations_;
  last_violation_ = st;
  return st;
}

absl::Status BlockPool::CheckSoleHolder(std::span<const int32_t> blocks, const char* holder) {
  absl::Status first;
  for (int32_t b : blocks) {
    absl::Status st = CheckHeld(b, "held", "block released under its holder");
    if (st.ok() && refs_[b] != 1) {
      st = Violation(absl::FailedPreconditionError(
          absl::StrCat("KV block ", b, " of ", holder, " has ", refs_[b] - 1,
                       " other reference(s): a block that must have one holder is in use")));
    }
    first.Update(st);
  }
  return first;
}

absl::Status BlockPool::Ref(int32_t block) {
  TANDEM_RETURN_IF_ERROR(CheckHeld(block, "referenced", "use after free"));
  ++refs_[block];
  return absl::OkStatus();
}

absl::Status BlockPool::Unref(int32_t block) {
  TANDEM_RETURN_IF_ERROR(CheckHeld(block, "released", "double free"));
  if (--refs_[block] == 0) free_.push_back(block);
  return absl::OkStatus();
}

absl::Status BlockPool::UnrefAll(std::span<const int32_t> blocks) {
  absl::Status first;
  for (int32_t b : blocks) first.Update(Unref(b));
  return first;
}

std::vector<uint64_t> ComputeBlockHashes(std::span<const int32_t> tokens, int32_t block_size,
                                         uint64_t salt, uint64_t parent) {
  std::vector<uint64_t> out;
  const size_t full = tokens.size() / block_size;
  out.reserve(full);
  std::vector<uint8_t> buf(sizeof(uint64_t) + sizeof(int32_t) * block_size);
  for (size_t i = 0; i < full; ++i) {
    std::memcpy(buf.data(), &parent, sizeof(parent));
    std::memcpy(buf.data() + sizeof(parent), tokens.data() + i * block_size,
                sizeof(int32_t) * block_size);
    parent = XXH3_64bits_withSeed(buf.data(), buf.size(), salt);
    out.push_back(parent);
  }
  return out;
}

}  // namespace tandem::engine
