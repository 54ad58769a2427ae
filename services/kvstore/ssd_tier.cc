#include "services/kvstore/ssd_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

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
  std::error_code ec;
  std::filesystem::create_directories(o.dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("ssd tier: cannot create ", o.dir, ": ", ec.message()));
  }
  std::unique_ptr<SsdTier> t(new SsdTier(o));
  if (o.use_io_uring) {
    auto* ring = new io_uring;
    const int rc = io_uring_queue_init(8, ring, 0);
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

absl::Status SsdTier::WriteAt(int fd, const uint8_t* buf, uint64_t len, uint64_t off) {
  uint64_t done = 0;
  while (done < len) {
    int64_t n;
    if (ring_ != nullptr) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring_);
      if (sqe == nullptr) return absl::InternalError("ssd tier: io_uring queue full");
      io_uring_prep_write(sqe, fd, buf + done, static_cast<unsigned>(len - done), off + done);
      int rc = io_uring_submit(ring_);
      if (rc < 0) return util::FromErrno(-rc, "io_uring_submit (write)");
      io_uring_cqe* cqe = nullptr;
      rc = io_uring_wait_cqe(ring_, &cqe);
      if (rc < 0) return util::FromErrno(-rc, "io_uring_wait_cqe (write)");
      n = cqe->res;
      io_uring_cqe_seen(ring_, cqe);
      if (n < 0) return util::FromErrno(static_cast<int>(-n), "write block file");
    } else {
      n = pwrite(fd, buf + done, len - done, static_cast<off_t>(off + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return util::FromErrno(errno, "pwrite block file");
      }
    }
    if (n == 0) return absl::InternalError("ssd tier: write made no progress");
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
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
  if (data.empty()) return absl::InvalidArgumentError("ssd tier: empty block");
  const uint64_t fb = FileBytes(data.size());
  auto it = index_.find(hash);
  const uint64_t old = it == index_.end() ? 0 : it->second.file_bytes;
  if (used_ - old + fb > o_.capacity_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ssd tier: ", fb, " more bytes exceed the capacity ", o_.capacity_bytes));
  }
  uint8_t* buf = IoBuffer(fb);
  if (buf == nullptr) return absl::ResourceExhaustedError("ssd tier: no memory for a buffer");
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kVersion;
  h.header_bytes = kHeaderBytes;
  h.hash = hash;
  h.payload_bytes = data.size();
  h.payload_xxh3 = XXH3_64bits(data.data(), data.size());
  h.header_xxh3 = XXH3_64bits(&h, kHeaderChecked);
  // Zero what is not header or payload: the header's padding and the tail up to the alignment.
  std::memset(buf, 0, kHeaderBytes);
  std::memcpy(buf, &h, sizeof(h));
  std::memcpy(buf + kHeaderBytes, data.data(), data.size());
  std::memset(buf + kHeaderBytes + data.size(), 0, fb - kHeaderBytes - data.size());

  const std::string path = PathFor(hash);
  const std::string tmp = path + ".tmp";
  {
    Fd fd(OpenFile(tmp, O_WRONLY | O_CREAT | O_TRUNC));
    if (fd.get() < 0) return util::FromErrno(errno, absl::StrCat("open ", tmp));
    absl::Status st = WriteAt(fd.get(), buf, fb, 0);
    if (st.ok() && o_.fsync && fsync(fd.get()) != 0) st = util::FromErrno(errno, "fsync");
    if (!st.ok()) {
      unlink(tmp.c_str());
      return st;
    }
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return util::FromErrno(err, absl::StrCat("rename ", tmp));
  }
  index_[hash] = Entry{data.size(), fb};
  used_ = used_ - old + fb;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> SsdTier::Get(uint64_t hash) {
  auto it = index_.find(hash);
  if (it == index_.end()) return absl::NotFoundError("ssd tier: no such block");
  const Entry e = it->second;
  const std::string path = PathFor(hash);
  Fd fd(OpenFile(path, O_RDONLY));
  if (fd.get() < 0) {
    if (errno == ENOENT) {  // removed behind our back
      Drop(hash);
      return absl::NotFoundError("ssd tier: block file vanished");
    }
    return util::FromErrno(errno, absl::StrCat("open ", path));
  }
  uint8_t* buf = IoBuffer(e.file_bytes);
  if (buf == nullptr) return absl::ResourceExhaustedError("ssd tier: no memory for a buffer");
  uint64_t got = 0;
  TANDEM_RETURN_IF_ERROR(ReadAt(fd.get(), buf, e.file_bytes, 0, &got));
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
    return absl::DataLossError(
        absl::StrCat("ssd tier: block ", absl::Hex(hash), " in ", path, ": ", why, "; dropped"));
  }
  return std::vector<uint8_t>(buf + kHeaderBytes, buf + kHeaderBytes + e.payload);
}

uint8_t* SsdTier::IoBuffer(uint64_t bytes) {
  if (bytes > io_buf_bytes_) {
    io_buf_.reset(static_cast<uint8_t*>(std::aligned_alloc(kAlign, bytes)));
    io_buf_bytes_ = io_buf_ == nullptr ? 0 : bytes;
  }
  return io_buf_.get();
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
