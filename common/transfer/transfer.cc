#include "common/transfer/transfer.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"

namespace tandem::transfer {
namespace {

// Wire format, little-endian, version 1:
//   magic "TKVD" | u16 version | u16 reserved (0)
//   u32 len | peer_address bytes
//   u64 region_id | u64 base | u64 length
//   u32 len | rkey bytes
// Nothing may follow. Field lengths are capped so a corrupt length cannot ask for gigabytes.
constexpr char kMagic[4] = {'T', 'K', 'V', 'D'};
constexpr uint16_t kVersion = 1;
constexpr uint32_t kMaxFieldBytes = 1u << 20;

void PutU16(std::string& out, uint16_t v) {
  for (int i = 0; i < 2; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Bounds-checked little-endian reader over the input bytes.
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}

  bool Take(size_t n, std::string_view* out) {
    if (in_.size() - pos_ < n) return false;
    *out = in_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  bool Uint(T* v) {
    std::string_view b;
    if (!Take(sizeof(T), &b)) return false;
    T r = 0;
    for (size_t i = 0; i < sizeof(T); ++i) {
      r |= static_cast<T>(static_cast<uint8_t>(b[i])) << (8 * i);
    }
    *v = r;
    return true;
  }
  bool Bytes(std::string* out) {
    uint32_t n = 0;
    if (!Uint(&n) || n > kMaxFieldBytes) return false;
    std::string_view b;
    if (!Take(n, &b)) return false;
    out->assign(b.data(), b.size());
    return true;
  }
  bool AtEnd() const { return pos_ == in_.size(); }

 private:
  std::string_view in_;
  size_t pos_ = 0;
};

}  // namespace

std::string RegionDescriptor::Serialize() const {
  std::string out;
  out.reserve(4 + 4 + 4 + peer_address.size() + 24 + 4 + rkey.size());
  out.append(kMagic, sizeof(kMagic));
  PutU16(out, kVersion);
  PutU16(out, 0);
  PutU32(out, static_cast<uint32_t>(peer_address.size()));
  out.append(peer_address);
  PutU64(out, region_id);
  PutU64(out, base);
  PutU64(out, length);
  PutU32(out, static_cast<uint32_t>(rkey.size()));
  out.append(rkey);
  return out;
}

absl::StatusOr<RegionDescriptor> RegionDescriptor::Parse(std::string_view bytes) {
  Reader r(bytes);
  std::string_view magic;
  if (!r.Take(sizeof(kMagic), &magic) || std::memcmp(magic.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError("region descriptor: bad magic (not a KV region descriptor)");
  }
  uint16_t version = 0, reserved = 0;
  if (!r.Uint(&version) || !r.Uint(&reserved)) {
    return absl::InvalidArgumentError("region descriptor: truncated header");
  }
  if (version != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("region descriptor: unsupported version ", version, " (this build reads ",
                     kVersion, ")"));
  }
  RegionDescriptor d;
  if (!r.Bytes(&d.peer_address) || !r.Uint(&d.region_id) || !r.Uint(&d.base) ||
      !r.Uint(&d.length) || !r.Bytes(&d.rkey)) {
    return absl::InvalidArgumentError("region descriptor: truncated or oversized field");
  }
  if (!r.AtEnd()) {
    return absl::InvalidArgumentError("region descriptor: trailing bytes");
  }
  if (d.peer_address.empty()) {
    return absl::InvalidArgumentError("region descriptor: empty peer address");
  }
  if (d.base + d.length < d.base) {
    return absl::InvalidArgumentError("region descriptor: base + length overflows");
  }
  return d;
}

absl::StatusOr<AllocatedRegion> KvTransport::AllocateRegion(uint64_t) {
  return absl::UnimplementedError("this transport does not allocate regions");
}

absl::Status KvTransport::Write(const RegionDescriptor& dst, std::vector<WriteOp> ops,
                                std::chrono::milliseconds timeout) {
  // The callback may run before WriteAsync returns, on another thread; the shared state lives
  // until both sides are done with it.
  struct State {
    absl::Notification done;
    absl::Status status;
  };
  auto state = std::make_shared<State>();
  WriteAsync(dst, std::move(ops), std::chrono::steady_clock::now() + timeout,
             [state](absl::Status s) {
               state->status = std::move(s);
               state->done.Notify();
             });
  state->done.WaitForNotification();
  return state->status;
}

}  // namespace tandem::transfer
