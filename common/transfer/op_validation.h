// Checks shared by every backend before a write touches the wire: each op must lie inside the
// destination region and name real source bytes. Backends call it first, so an out-of-range
// batch fails as a whole with INVALID_ARGUMENT and nothing of it is written.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/transfer/transfer.h"

namespace tandem::transfer {

inline absl::Status ValidateOps(uint64_t region_length, const std::vector<WriteOp>& ops) {
  for (size_t i = 0; i < ops.size(); ++i) {
    const WriteOp& op = ops[i];
    if (op.length == 0) continue;
    if (op.src == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("write op ", i, ": null source"));
    }
    if (op.remote_offset > region_length || op.length > region_length - op.remote_offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("write op ", i, ": [", op.remote_offset, ", +", op.length,
                       ") is outside the remote region of ", region_length, " bytes"));
    }
  }
  return absl::OkStatus();
}

inline uint64_t TotalBytes(const std::vector<WriteOp>& ops) {
  uint64_t n = 0;
  for (const WriteOp& op : ops) n += op.length;
  return n;
}

}  // namespace tandem::transfer
