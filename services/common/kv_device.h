// What the workers do with a KV pool that lives in GPU memory (--device cuda), where the host
// cannot read it: block checksums computed on the device by the CUDA kernel
// (tandem/cuda/kv_checksum.h, the same values as BlockChecksum in kv_layout.h), and copies
// between the pool and pinned host staging for prefix onboarding from the kvstore (host to
// device) and publishing to it (device to host).
//
// Ownership: the caller owns the pool (the engine's KvCache) and the host side of each copy;
// KvStaging owns its pinned buffer and its stream. Threading: any thread, reading or writing
// only blocks no engine step touches meanwhile; a KvStaging is used by one thread at a time.
// Every
// function waits for its device work before returning, so on return the bytes are where they
// were sent. Errors: INTERNAL with the CUDA error and file:line; in a build without CUDA every
// function is FAILED_PRECONDITION ("built without CUDA"), and callers only reach them with a
// device pool, which such a build cannot make.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/kv/kv_cache.h"

namespace tandem::services {

// Checksums of the blocks holding positions [0, num_tokens) of a sequence whose block table is
// `blocks`, like SequenceChecksums, for a device pool (kv.on_device()).
absl::StatusOr<std::vector<uint64_t>> DeviceSequenceChecksums(const engine::KvCache& kv,
                                                              std::span<const int32_t> blocks,
                                                              int64_t num_tokens);

// One contiguous range of the pool (offset from kv.memory().data()) and its host counterpart.
struct KvHostCopy {
  uint64_t pool_offset = 0;
  uint8_t* host = nullptr;
  uint64_t length = 0;
};

class KvStaging {
 public:
  // A pinned buffer of `bytes` (grown by Reserve) on the pool's device.
  static absl::StatusOr<std::unique_ptr<KvStaging>> Create(uint64_t bytes);
  ~KvStaging();
  KvStaging(const KvStaging&) = delete;
  KvStaging& operator=(const KvStaging&) = delete;

  // Grows the buffer to at least `bytes` (contents are not kept).
  absl::Status Reserve(uint64_t bytes);
  uint8_t* data() const;
  uint64_t size() const;

  // Device pool -> host, and host -> device pool; host pointers should lie in data() (pinned,
  // so the copies are asynchronous DMA); other host memory works at pageable speed. Ranges are
  // trusted (callers build them from validated block ids).
  absl::Status ToHost(const engine::KvCache& kv, std::span<const KvHostCopy> copies);
  absl::Status FromHost(engine::KvCache& kv, std::span<const KvHostCopy> copies);

 private:
  struct Impl;
  explicit KvStaging(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::services
