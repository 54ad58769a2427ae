// The SSD tier: one file per block under a directory, so blocks survive a restart.
//
// File format (host byte order, little-endian on every machine tandem targets): a 64-byte
// header, then the payload, the whole file padded with zeros to a multiple of 4096 bytes so it
// is written and read in one O_DIRECT transfer through io_uring.
//   0  char[8] magic "TDMKVBK1"   8  u32 version (1)   12 u32 header bytes (64)
//   16 u64 block hash             24 u64 payload bytes  32 u64 XXH3-64 of the payload
//   40 u64 XXH3-64 of bytes 0..39 48..63 zero
// A file is named "<hash as 16 hex digits>.kvb" and written as "<name>.tmp" then renamed, so a
// crash mid-write leaves only a temporary file, which Open deletes.
//
// Open rebuilds the index by scanning the directory: files with a bad header, a name that does
// not match their hash, or fewer bytes than their header promises (truncated) are deleted and
// counted as integrity failures. Payload checksums are checked on every Get: a mismatch deletes
// the file, counts an integrity failure and returns DATA_LOSS.
//
// I/O: io_uring (liburing) with O_DIRECT and 4096-aligned buffers. GetMany and PutMany keep up
// to `queue_depth` block files in flight (one buffer each, reused as each completes); Get and
// Put are batches of one. When io_uring_queue_init fails (old kernel, seccomp), or a submission
// fails later, it logs once to stderr and uses pread/pwrite; when the file system refuses
// O_DIRECT (tmpfs), it logs once and uses buffered I/O.
// Threading: thread-compatible (one ring, no locks); the TieredStore serialises calls.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "services/kvstore/tier.h"

struct io_uring;

namespace tandem::kvstore {

struct SsdTierOptions {
  std::string dir;  // created if missing
  uint64_t capacity_bytes = 0;
  bool use_io_uring = true;  // false: pread/pwrite (also the fallback when the ring fails)
  bool use_o_direct = true;
  bool fsync = false;  // fsync each block file before the rename (power-loss durability)
  int queue_depth = 8;  // block files in flight at once in GetMany / PutMany (1..256)
};

class SsdTier : public Tier {
 public:
  static constexpr uint64_t kAlign = 4096;
  static constexpr uint64_t kHeaderBytes = 64;

  // Creates the directory if needed and rebuilds the index from the files in it.
  static absl::StatusOr<std::unique_ptr<SsdTier>> Open(const SsdTierOptions& o);
  ~SsdTier() override;

  TierKind kind() const override { return TierKind::kSsd; }
  std::string name() const override;
  absl::Status Put(uint64_t hash, std::span<const uint8_t> data) override;
  absl::StatusOr<std::vector<uint8_t>> Get(uint64_t hash) override;
  std::vector<absl::StatusOr<std::vector<uint8_t>>> GetMany(
      std::span<const uint64_t> hashes) override;
  std::vector<absl::Status> PutMany(std::span<const BlockRef> blocks) override;
  bool Contains(uint64_t hash) const override { return index_.contains(hash); }
  absl::Status Erase(uint64_t hash) override;
  uint64_t Used() const override { return used_; }
  uint64_t Capacity() const override { return o_.capacity_bytes; }
  uint64_t Footprint(uint64_t payload) const override { return FileBytes(payload); }
  int64_t NumBlocks() const override { return static_cast<int64_t>(index_.size()); }
  std::vector<uint64_t> Keys() const override;
  int64_t integrity_failures() const override { return integrity_failures_; }

  // Files deleted by Open because they were corrupt, truncated or temporary.
  int64_t dropped_on_open() const { return dropped_on_open_; }
  bool using_io_uring() const { return ring_ != nullptr; }
  // The most transfers the ring has held at once (at most queue_depth).
  int max_in_flight() const { return max_in_flight_; }
  std::string PathFor(uint64_t hash) const;
  static uint64_t FileBytes(uint64_t payload) {
    return (kHeaderBytes + payload + kAlign - 1) / kAlign * kAlign;
  }

 private:
  explicit SsdTier(const SsdTierOptions& o);
  absl::Status Scan();
  // One file's transfer in a batch: the whole file from offset 0.
  struct IoReq {
    int fd = -1;
    uint8_t* buf = nullptr;
    uint64_t len = 0;
    bool write = false;
  };
  // Runs `n` transfers with up to queue_depth in flight. start(i, buf) prepares item i in `buf`
  // (at least buf_bytes; filled first for a write) and returns its transfer, or nullopt when
  // the item failed before any I/O. done(i, buf, res) gets the bytes moved (a read stops short
  // only at end of file) or -errno; `buf` is reused once it returns.
  void RunBatch(size_t n, uint64_t buf_bytes,
                const std::function<std::optional<IoReq>(size_t, uint8_t*)>& start,
                const std::function<void(size_t, uint8_t*, int64_t)>& done);
  // The whole transfer with pread/pwrite; bytes moved or -errno.
  static int64_t SyncIo(const IoReq& r);
  absl::Status ReadAt(int fd, uint8_t* buf, uint64_t len, uint64_t off, uint64_t* got);
  absl::StatusOr<std::vector<uint8_t>> Verify(uint64_t hash, const uint8_t* buf, uint64_t got);
  void DropRing(const char* why, int err);
  // Opens with O_DIRECT when allowed, falling back (once, logged) when the file system refuses.
  int OpenFile(const std::string& path, int flags, int mode = 0644);
  void Drop(uint64_t hash);
  // The O_DIRECT buffers, one per transfer in flight, each at least `bytes` long, kept between
  // calls: a fresh block-sized allocation is a fresh mapping, and faulting its pages in cost
  // more than the I/O itself. False when memory ran out.
  bool IoBuffers(int count, uint64_t bytes);

  struct Entry {
    uint64_t payload = 0;
    uint64_t file_bytes = 0;
  };
  SsdTierOptions o_;
  io_uring* ring_ = nullptr;
  bool direct_ok_ = true;
  uint64_t used_ = 0;
  int64_t integrity_failures_ = 0;
  int64_t dropped_on_open_ = 0;
  int max_in_flight_ = 0;
  absl::flat_hash_map<uint64_t, Entry> index_;
  struct FreeDeleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::vector<std::unique_ptr<uint8_t, FreeDeleter>> io_bufs_;
  uint64_t io_buf_bytes_ = 0;
};

}  // namespace tandem::kvstore
