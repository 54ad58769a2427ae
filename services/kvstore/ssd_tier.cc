#include "services/kvstore/ssd_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/util/status_util.h"
#include "xxhash.h"

namespace tandem::kvstore {
namespace {

constexpr char kMagic[8] = {'T', 'D', 'M', 'K', 'V', 'B', 'K', '1'};
constexpr uint32_t kVersion = 1;
constexpr char kSuffix[] = ".kvb";
constexpr char kTmpSuffix[] = ".kvb.tmp";

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint64_t hash;
  uint64_t payload_bytes;
  uint64_t payload_xxh3;
  uint64_t header_xxh3;  // of the 40 bytes before it
  uint8_t reserved[16];
};
static_assert(sizeof(Header) == SsdTier::kHeaderBytes);
constexpr size_t kHeaderChecked = offsetof(Header, header_xxh3);

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<uint8_t, FreeDeleter>;

AlignedBuf AllocAligned(uint64_t bytes) {
  return AlignedBuf(static_cast<uint8_t*>(std::aligned_alloc(SsdTier::kAlign, bytes)));
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// "<16 hex>.kvb" -> hash; false for any other name.
bool ParseName(const std::string& name, uint64_t* hash) {
  if (name.size() != 16 + sizeof(kSuffix) - 1 || name.substr(16) != kSuffix) return false;
  uint64_t h = 0;
  for (int i = 0; i < 16; ++i) {
    const char c = name[i];
    int v;
    if (c >= '0' && c <= '9') {
      v = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      v = c - 'a' + 10;
    } else {
      return false;
    }
    h = (h << 4) | static_cast<uint64_t>(v);
  }
  *hash = h;
  return true;
}

bool HeaderValid(const Header& h) {
  return std::memcmp(h.magic, kMagic, sizeof(kMagic)) == 0 && h.version == kVersion &&
         h.header_bytes == SsdTier::kHeaderBytes &&
         h.header_xxh3 == XXH3_64bits(&h, kHeaderChecked);
}

}  // namespace

SsdTier::SsdTier(const SsdTierOptions& o) : o_(o), direct_ok_(o.use_o_direct) {}

SsdTier::~SsdTier() {
  if (ring_ != nullptr) {
    io_uring_queue_exit(ring_);
    delete ring_;
  }
}

absl::StatusOr<std::unique_ptr<SsdTier>> SsdTier::Open(const SsdTierOptions& o) {
  if (o.dir.empty()) return absl::InvalidArgumentError("ssd tier: no directory given");
  if (o.queue_depth < 1 || o.queue_depth > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("ssd tier: queue depth must be 1..256, got ", o.queue_depth));
  }
  std::error_code ec;
  std::filesystem::create_directories(o.dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("ssd tier: cannot create ", o.dir, ": ", ec.message()));
  }
  std::unique_ptr<SsdTier> t(new SsdTier(o));
  if (o.use_io_uring) {
    auto* ring = new io_uring;
    const int rc = io_uring_queue_init(static_cast<unsigned>(o.queue_depth), ring, 0);
    if (rc < 0) {
      delete ring;
      std::fprintf(stderr,
                   "tandem-kvstore: ssd tier: io_uring_queue_init failed (%s); "
                   "falling back to pread/pwrite\n",
                   std::strerror(-rc));
    } else {
      t->ring_ = ring;
    }
  }
  TANDEM_RETURN_IF_ERROR(t->Scan());
  return t;
}

std::string SsdTier::name() const {
  return absl::StrCat("ssd (", o_.dir, ", ", ring_ != nullptr ? "io_uring" : "pread/pwrite",
                      direct_ok_ ? ", O_DIRECT" : ", buffered", ")");
}

std::string SsdTier::PathFor(uint64_t hash) const {
  return absl::StrFormat("%s/%016x%s", o_.dir, hash, kSuffix);
}

int SsdTier::OpenFile(const std::string& path, int flags, int mode) {
  if (direct_ok_) {
    const int fd = open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, mode);
    if (fd >= 0 || errno != EINVAL) return fd;
    direct_ok_ = false;
    std::fprintf(stderr, "tandem-kvstore: ssd tier: %s refuses O_DIRECT; using buffered I/O\n",
                 o_.dir.c_str());
  }
  return open(path.c_str(), flags | O_CLOEXEC, mode);
}

absl::Status SsdTier::ReadAt(int fd, uint8_t* buf, uint64_t len, uint64_t off, uint64_t* got) {
  *got = 0;
  while (*got < len) {
    int64_t n;
    if (ring_ != nullptr) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring_);
      if (sqe == nullptr) return absl::InternalError("ssd tier: io_uring queue full");
      io_uring_prep_read(sqe, fd, buf + *got, static_cast<unsigned>(len - *got), off + *got);
      int rc = io_uring_submit(ring_);
      if (rc < 0) return util::FromErrno(-rc, "io_uring_submit (read)");
      io_uring_cqe* cqe = nullptr;
      rc = io_uring_wait_cqe(ring_, &cqe);
      if (rc < 0) return util::FromErrno(-rc, "io_uring_wait_cqe (read)");
      n = cqe->res;
      io_uring_cqe_seen(ring_, cqe);
      if (n < 0) return util::FromErrno(static_cast<int>(-n), "read block file");
    } else {
      n = pread(fd, buf + *got, len - *got, static_cast<off_t>(off + *got));
      if (n < 0) {
        if (errno == EINTR) continue;
        return util::FromErrno(errno, "pread block file");
      }
    }
    const bool short_read = static_cast<uint64_t>(n) < len - *got;
    *got += static_cast<uint64_t>(n);
    // Regular files read short only at end of file (and with O_DIRECT a retry at the unaligned
    // offset would fail anyway): stop, and let the caller judge the length.
    if (n == 0 || short_read) break;
  }
  return absl::OkStatus();
}

void SsdTier::DropRing(const char* why, int err) {
  std::fprintf(stderr, "tandem-kvstore: ssd tier: %s failed (%s); falling back to pread/pwrite\n",
               why, std::strerror(err));
  io_uring_queue_exit(ring_);
  delete ring_;
  ring_ = nullptr;
}

int64_t SsdTier::SyncIo(const IoReq& r) {
  uint64_t done = 0;
  while (done < r.len) {
    const ssize_t n = r.write ? pwrite(r.fd, r.buf + done, r.len - done, static_cast<off_t>(done))
                              : pread(r.fd, r.buf + done, r.len - done, static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) {
      if (r.write) return -EIO;  // a write that makes no progress
      break;                     // end of file
    }
    done += static_cast<uint64_t>(n);
    // With O_DIRECT a read short of an aligned length is the end of the file, and a retry at
    // the unaligned offset would fail anyway; a short write is finished the same way.
    if (!r.write && done % kAlign != 0) break;
  }
  return static_cast<int64_t>(done);
}

void SsdTier::RunBatch(size_t n, uint64_t buf_bytes,
                       const std::function<std::optional<IoReq>(size_t, uint8_t*)>& start,
                       const std::function<void(size_t, uint8_t*, int64_t)>& done) {
  const int depth = ring_ != nullptr ? static_cast<int>(std::min<size_t>(o_.queue_depth, n)) : 1;
  if (n == 0) return;
  if (!IoBuffers(depth, buf_bytes)) {
    for (size_t i = 0; i < n; ++i) done(i, nullptr, -ENOMEM);
    return;
  }
  // Slot s holds item items[s] (or none) and its buffer io_bufs_[s].
  std::vector<size_t> item(depth);
  std::vector<IoReq> req(depth);
  std::vector<int> free_slots;
  for (int s = depth - 1; s >= 0; --s) free_slots.push_back(s);
  size_t next = 0;
  int in_flight = 0;
  // The ring failed: run what it held, and the rest, without it. Each transfer is a whole file
  // from offset 0, so running one again is harmless. The kernel may still be using the
  // buffers of the transfers it held, so those are left to it (a few blocks, once) and the
  // transfers run again on fresh copies.
  const auto recover = [&](const char* why, int err) {
    std::vector<int> busy;
    for (int slot = 0; slot < depth; ++slot) {
      if (std::find(free_slots.begin(), free_slots.end(), slot) == free_slots.end()) {
        busy.push_back(slot);
      }
    }
    DropRing(why, err);
    for (int slot : busy) {
      auto* fresh = static_cast<uint8_t*>(std::aligned_alloc(kAlign, io_buf_bytes_));
      if (fresh == nullptr) {
        done(item[slot], nullptr, -ENOMEM);
        continue;
      }
      if (req[slot].write) std::memcpy(fresh, req[slot].buf, req[slot].len);
      (void)io_bufs_[slot].release();
      io_bufs_[slot].reset(fresh);
      req[slot].buf = fresh;
      done(item[slot], fresh, SyncIo(req[slot]));
    }
    for (; next < n; ++next) {
      std::optional<IoReq> r = start(next, io_bufs_[0].get());
      if (r.has_value()) done(next, io_bufs_[0].get(), SyncIo(*r));
    }
  };
  while (next < n || in_flight > 0) {
    // Fill every free slot, then submit them together.
    int queued = 0;
    while (next < n && !free_slots.empty()) {
      const int slot = free_slots.back();
      uint8_t* buf = io_bufs_[slot].get();
      const size_t i = next++;
      std::optional<IoReq> r = start(i, buf);
      if (!r.has_value()) continue;  // failed before any I/O; start said why
      if (ring_ == nullptr) {
        done(i, buf, SyncIo(*r));
        continue;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(ring_);
      if (sqe == nullptr) {  // cannot happen with one sqe per slot; never lose the item
        done(i, buf, SyncIo(*r));
        continue;
      }
      if (r->write) {
        io_uring_prep_write(sqe, r->fd, r->buf, static_cast<unsigned>(r->len), 0);
      } else {
        io_uring_prep_read(sqe, r->fd, r->buf, static_cast<unsigned>(r->len), 0);
      }
      io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(slot));
      item[slot] = i;
      req[slot] = *r;
      free_slots.pop_back();
      ++queued;
    }
    if (queued > 0) {
      int submitted = 0;
      int rc = 0;
      while (submitted < queued) {
        rc = io_uring_submit(ring_);
        if (rc <= 0) break;
        submitted += rc;
      }
      if (submitted < queued) {
        recover("io_uring_submit", rc < 0 ? -rc : EBUSY);
        return;
      }
      in_flight += queued;
      max_in_flight_ = std::max(max_in_flight_, in_flight);
    }
    if (in_flight == 0) continue;
    io_uring_cqe* cqe = nullptr;
    const int rc = io_uring_wait_cqe(ring_, &cqe);
    if (rc == -EINTR) continue;
    if (rc < 0) {
      recover("io_uring_wait_cqe", -rc);
      return;
    }
    const int slot = static_cast<int>(io_uring_cqe_get_data64(cqe));
    int64_t res = cqe->res;
    io_uring_cqe_seen(ring_, cqe);
    --in_flight;
    const IoReq& r = req[slot];
    if (r.write && res >= 0 && static_cast<uint64_t>(res) < r.len) {
      // A short write: finish it in place (rare; whole files from offset 0).
      IoReq rest{r.fd, r.buf + res, r.len - static_cast<uint64_t>(res), true};
      uint64_t off = static_cast<uint64_t>(res);
      while (rest.len > 0) {
        const ssize_t w = pwrite(rest.fd, rest.buf, rest.len, static_cast<off_t>(off));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
          res = w < 0 ? -errno : -EIO;
          break;
        }
        rest.buf += w;
        rest.len -= static_cast<uint64_t>(w);
        off += static_cast<uint64_t>(w);
        res = static_cast<int64_t>(off);
      }
    }
    done(item[slot], io_bufs_[slot].get(), res);
    free_slots.push_back(slot);
  }
}

void SsdTier::Drop(uint64_t hash) {
  auto it = index_.find(hash);
  if (it != index_.end()) {
    used_ -= it->second.file_bytes;
    index_.erase(it);
  }
  unlink(PathFor(hash).c_str());
}

absl::Status SsdTier::Scan() {
  DIR* d = opendir(o_.dir.c_str());
  if (d == nullptr) return util::FromErrno(errno, absl::StrCat("opendir ", o_.dir));
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) names.emplace_back(e->d_name);
  closedir(d);
  AlignedBuf page = AllocAligned(kAlign);
  for (const std::string& n : names) {
    if (n == "." || n == "..") continue;
    const std::string path = o_.dir + "/" + n;
    if (n.size() > sizeof(kTmpSuffix) - 1 &&
        n.compare(n.size() - (sizeof(kTmpSuffix) - 1), std::string::npos, kTmpSuffix) == 0) {
      unlink(path.c_str());  // a write that never finished
      ++dropped_on_open_;
      continue;
    }
    uint64_t hash;
    if (!ParseName(n, &hash)) continue;  // not ours: leave it alone
    struct stat st;
    if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    bool ok = false;
    Header h;
    if (static_cast<uint64_t>(st.st_size) >= kHeaderBytes) {
      Fd fd(OpenFile(path, O_RDONLY));
      uint64_t got = 0;
      if (fd.get() >= 0 && ReadAt(fd.get(), page.get(), kAlign, 0, &got).ok() &&
          got >= kHeaderBytes) {
        std::memcpy(&h, page.get(), sizeof(h));
        ok = HeaderValid(h) && h.hash == hash &&
             static_cast<uint64_t>(st.st_size) >= FileBytes(h.payload_bytes);
      }
    }
    if (!ok) {
      std::fprintf(stderr, "tandem-kvstore: ssd tier: dropping corrupt or truncated %s\n",
                   path.c_str());
      unlink(path.c_str());
      ++dropped_on_open_;
      ++integrity_failures_;
      continue;
    }
    const uint64_t fb = FileBytes(h.payload_bytes);
    index_[hash] = Entry{h.payload_bytes, fb};
    used_ += fb;
  }
  return absl::OkStatus();
}

absl::Status SsdTier::Put(uint64_t hash, std::span<const uint8_t> data) {
  const BlockRef b{hash, data};
  return PutMany(std::span<const BlockRef>(&b, 1))[0];
}

absl::StatusOr<std::vector<uint8_t>> SsdTier::Get(uint64_t hash) {
  return std::move(GetMany(std::span<const uint64_t>(&hash, 1))[0]);
}

std::vector<absl::Status> SsdTier::PutMany(std::span<const BlockRef> blocks) {
  std::vector<absl::Status> out(blocks.size());
  // Two writes of one hash in a batch would share a temporary file: such a batch goes one
  // block at a time, in order (the later bytes win, as with two Puts).
  absl::flat_hash_set<uint64_t> seen;
  for (const BlockRef& b : blocks) {
    if (!seen.insert(b.hash).second) {
      for (size_t i = 0; i < blocks.size(); ++i) out[i] = PutMany(blocks.subspan(i, 1))[0];
      return out;
    }
  }
  uint64_t max_bytes = 0;
  for (const BlockRef& b : blocks) max_bytes = std::max(max_bytes, FileBytes(b.data.size()));
  // Bytes of the writes in flight, counted against the capacity as if they had landed.
  int64_t pending = 0;
  std::vector<int> fds(blocks.size(), -1);
  std::vector<int64_t> grow(blocks.size(), 0);
  RunBatch(
      blocks.size(), max_bytes,
      [&](size_t i, uint8_t* buf) -> std::optional<IoReq> {
        const BlockRef& b = blocks[i];
        if (b.data.empty()) {
          out[i] = absl::InvalidArgumentError("ssd tier: empty block");
          return std::nullopt;
        }
        const uint64_t fb = FileBytes(b.data.size());
        auto it = index_.find(b.hash);
        const uint64_t old = it == index_.end() ? 0 : it->second.file_bytes;
        if (static_cast<int64_t>(used_) + pending - static_cast<int64_t>(old) +
                static_cast<int64_t>(fb) >
            static_cast<int64_t>(o_.capacity_bytes)) {
          out[i] = absl::ResourceExhaustedError(absl::StrCat(
              "ssd tier: ", fb, " more bytes exceed the capacity ", o_.capacity_bytes));
          return std::nullopt;
        }
        Header h{};
        std::memcpy(h.magic, kMagic, sizeof(kMagic));
        h.version = kVersion;
        h.header_bytes = kHeaderBytes;
        h.hash = b.hash;
        h.payload_bytes = b.data.size();
        h.payload_xxh3 = XXH3_64bits(b.data.data(), b.data.size());
        h.header_xxh3 = XXH3_64bits(&h, kHeaderChecked);
        // Zero what is not header or payload: the header's padding and the tail up to the
        // alignment.
        std::memset(buf, 0, kHeaderBytes);
        std::memcpy(buf, &h, sizeof(h));
        std::memcpy(buf + kHeaderBytes, b.data.data(), b.data.size());
        std::memset(buf + kHeaderBytes + b.data.size(), 0, fb - kHeaderBytes - b.data.size());
        const std::string tmp = PathFor(b.hash) + ".tmp";
        fds[i] = OpenFile(tmp, O_WRONLY | O_CREAT | O_TRUNC);
        if (fds[i] < 0) {
          out[i] = util::FromErrno(errno, absl::StrCat("open ", tmp));
          return std::nullopt;
        }
        grow[i] = static_cast<int64_t>(fb) - static_cast<int64_t>(old);
        pending += grow[i];
        return IoReq{fds[i], buf, fb, /*write=*/true};
      },
      [&](size_t i, uint8_t*, int64_t res) {
        const BlockRef& b = blocks[i];
        pending -= grow[i];
        const uint64_t fb = FileBytes(b.data.size());
        const std::string path = PathFor(b.hash);
        const std::string tmp = path + ".tmp";
        absl::Status st;
        if (res < 0) {
          st = util::FromErrno(static_cast<int>(-res), "write block file");
        } else if (static_cast<uint64_t>(res) != fb) {
          st = absl::InternalError("ssd tier: write made no progress");
        } else if (o_.fsync && fsync(fds[i]) != 0) {
          st = util::FromErrno(errno, "fsync");
        }
        if (fds[i] >= 0) close(fds[i]);
        if (st.ok() && rename(tmp.c_str(), path.c_str()) != 0) {
          st = util::FromErrno(errno, absl::StrCat("rename ", tmp));
        }
        if (!st.ok()) {
          unlink(tmp.c_str());
          out[i] = st;
          return;
        }
        auto it = index_.find(b.hash);
        const uint64_t old = it == index_.end() ? 0 : it->second.file_bytes;
        index_[b.hash] = Entry{b.data.size(), fb};
        used_ = used_ - old + fb;
      });
  return out;
}

std::vector<absl::StatusOr<std::vector<uint8_t>>> SsdTier::GetMany(
    std::span<const uint64_t> hashes) {
  std::vector<absl::StatusOr<std::vector<uint8_t>>> out(hashes.size(),
                                                        absl::InternalError("not read"));
  uint64_t max_bytes = 0;
  for (uint64_t h : hashes) {
    if (auto it = index_.find(h); it != index_.end()) {
      max_bytes = std::max(max_bytes, it->second.file_bytes);
    }
  }
  std::vector<int> fds(hashes.size(), -1);
  RunBatch(
      hashes.size(), max_bytes,
      [&](size_t i, uint8_t* buf) -> std::optional<IoReq> {
        auto it = index_.find(hashes[i]);
        if (it == index_.end()) {
          out[i] = absl::NotFoundError("ssd tier: no such block");
          return std::nullopt;
        }
        const std::string path = PathFor(hashes[i]);
        fds[i] = OpenFile(path, O_RDONLY);
        if (fds[i] < 0) {
          if (errno == ENOENT) {  // removed behind our back
            Drop(hashes[i]);
            out[i] = absl::NotFoundError("ssd tier: block file vanished");
          } else {
            out[i] = util::FromErrno(errno, absl::StrCat("open ", path));
          }
          return std::nullopt;
        }
        return IoReq{fds[i], buf, it->second.file_bytes, /*write=*/false};
      },
      [&](size_t i, uint8_t* buf, int64_t res) {
        if (fds[i] >= 0) close(fds[i]);
        if (res < 0) {
          out[i] = util::FromErrno(static_cast<int>(-res), "read block file");
          return;
        }
        out[i] = Verify(hashes[i], buf, static_cast<uint64_t>(res));
      });
  return out;
}

absl::StatusOr<std::vector<uint8_t>> SsdTier::Verify(uint64_t hash, const uint8_t* buf,
                                                     uint64_t got) {
  auto it = index_.find(hash);
  if (it == index_.end()) return absl::NotFoundError("ssd tier: no such block");
  const Entry e = it->second;
  Header h;
  std::memcpy(&h, buf, sizeof(h));
  const char* why = nullptr;
  if (got < kHeaderBytes + e.payload) {
    why = "truncated";
  } else if (!HeaderValid(h) || h.hash != hash || h.payload_bytes != e.payload) {
    why = "bad header";
  } else if (XXH3_64bits(buf + kHeaderBytes, e.payload) != h.payload_xxh3) {
    why = "payload checksum mismatch";
  }
  if (why != nullptr) {
    ++integrity_failures_;
    Drop(hash);
    return absl::DataLossError(absl::StrCat("ssd tier: block ", absl::Hex(hash), " in ",
                                            PathFor(hash), ": ", why, "; dropped"));
  }
  return std::vector<uint8_t>(buf + kHeaderBytes, buf + kHeaderBytes + e.payload);
}

bool SsdTier::IoBuffers(int count, uint64_t bytes) {
  bytes = std::max<uint64_t>(bytes, kAlign);
  if (bytes > io_buf_bytes_) {
    io_bufs_.clear();
    io_buf_bytes_ = bytes;
  }
  while (static_cast<int>(io_bufs_.size()) < count) {
    io_bufs_.emplace_back(static_cast<uint8_t*>(std::aligned_alloc(kAlign, io_buf_bytes_)));
    if (io_bufs_.back() == nullptr) {
      io_bufs_.pop_back();
      return false;
    }
  }
  return true;
}

absl::Status SsdTier::Erase(uint64_t hash) {
  if (!index_.contains(hash)) return absl::NotFoundError("ssd tier: no such block");
  Drop(hash);
  return absl::OkStatus();
}

std::vector<uint64_t> SsdTier::Keys() const {
  std::vector<uint64_t> out;
  out.reserve(index_.size());
  for (const auto& [h, e] : index_) out.push_back(h);
  return out;
}

}  // namespace tandem::kvstore
