// GGUF reader. The parser treats the file as hostile: every length and count is compared with
// the bytes that remain before anything is reserved or read, and all size arithmetic is done
// with explicit overflow checks, so no input can make it crash, over-read or over-allocate.
#include "common/gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>

#include "common/util/status_util.h"

namespace tandem::gguf {
namespace {

// Debian's abseil keeps its own string_view type, so absl::StrCat does not take
// std::string_view; this small concatenation does.
inline void AppendPiece(std::string& o, std::string_view s) { o.append(s); }
inline void AppendPiece(std::string& o, const char* s) { o.append(s); }
inline void AppendPiece(std::string& o, char c) { o.push_back(c); }
template <typename T>
requires std::is_arithmetic_v<T>
void AppendPiece(std::string& o, T v) { o += std::to_string(v); }
template <typename... Args>
std::string Cat(const Args&... args) {
  std::string out;
  (AppendPiece(out, args), ...);
  return out;
}

static_assert(std::endian::native == std::endian::little,
              "GGUF is little-endian; tandem reads it in place");

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr size_t kMaxDims = 4;
// Smallest encodings, used to cap counts by the bytes that remain before reserving:
// a KV is key (8-byte length + >= 1 byte) + type (4) + the smallest value (1);
// a tensor info is name (8 + >= 1) + n_dims (4) + one dim (8) + type (4) + offset (8).
constexpr uint64_t kMinKvBytes = 8 + 1 + 4 + 1;
constexpr uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 8 + 4 + 8;

// Size of a fixed-width value type; 0 for string and array.
uint64_t ScalarSize(ValueType t) {
  switch (t) {
    case ValueType::kU8:
    case ValueType::kI8:
    case ValueType::kBool:
      return 1;
    case ValueType::kU16:
    case ValueType::kI16:
      return 2;
    case ValueType::kU32:
    case ValueType::kI32:
    case ValueType::kF32:
      return 4;
    case ValueType::kU64:
    case ValueType::kI64:
    case ValueType::kF64:
      return 8;
    case ValueType::kString:
    case ValueType::kArray:
      return 0;
  }
  return 0;
}

bool IsKnownValueType(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::kF64); }

bool IsUnsigned(ValueType t) {
  return t == ValueType::kU8 || t == ValueType::kU16 || t == ValueType::kU32 ||
         t == ValueType::kU64;
}
bool IsSigned(ValueType t) {
  return t == ValueType::kI8 || t == ValueType::kI16 || t == ValueType::kI32 ||
         t == ValueType::kI64;
}
bool IsFloat(ValueType t) { return t == ValueType::kF32 || t == ValueType::kF64; }

template <typename T>
T LoadLe(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Reads the bytes of a scalar into the variant alternative its type maps to.
Value DecodeScalar(ValueType t, const uint8_t* p) {
  Value out;
  out.type = t;
  switch (t) {
    case ValueType::kU8:
      out.v = uint64_t{LoadLe<uint8_t>(p)};
      break;
    case ValueType::kU16:
      out.v = uint64_t{LoadLe<uint16_t>(p)};
      break;
    case ValueType::kU32:
      out.v = uint64_t{LoadLe<uint32_t>(p)};
      break;
    case ValueType::kU64:
      out.v = LoadLe<uint64_t>(p);
      break;
    case ValueType::kI8:
      out.v = int64_t{LoadLe<int8_t>(p)};
      break;
    case ValueType::kI16:
      out.v = int64_t{LoadLe<int16_t>(p)};
      break;
    case ValueType::kI32:
      out.v = int64_t{LoadLe<int32_t>(p)};
      break;
    case ValueType::kI64:
      out.v = LoadLe<int64_t>(p);
      break;
    case ValueType::kF32:
      out.v = double{LoadLe<float>(p)};
      break;
    case ValueType::kF64:
      out.v = LoadLe<double>(p);
      break;
    case ValueType::kBool:
      out.v = p[0] != 0;
      break;
    case ValueType::kString:
    case ValueType::kArray:
      break;
  }
  return out;
}

// A bounds-checked little-endian cursor over the mapping. Errors carry the byte offset.
class Cursor {
 public:
  Cursor(std::span<const uint8_t> bytes, std::string_view where) : bytes_(bytes), where_(where) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return bytes_.size() - pos_; }

  absl::Status Error(uint64_t at, std::string_view what) const {
    return absl::InvalidArgumentError(Cat("gguf ", where_, ": at byte ", at, ": ", what));
  }

  absl::Status Need(uint64_t n, std::string_view what) const {
    if (n > remaining()) {
      return Error(pos_, Cat("truncated: ", what, " needs ", n, " bytes, ", remaining(), " left"));
    }
    return absl::OkStatus();
  }

  template <typename T>
  absl::Status Read(T* out, std::string_view what) {
    TANDEM_RETURN_IF_ERROR(Need(sizeof(T), what));
    *out = LoadLe<T>(bytes_.data() + pos_);
    pos_ += sizeof(T);
    return absl::OkStatus();
  }

  // A GGUF string: u64 length then bytes, viewed in place.
  absl::Status ReadString(std::string_view* out, std::string_view what) {
    const uint64_t at = pos_;
    uint64_t len = 0;
    TANDEM_RETURN_IF_ERROR(Read(&len, what));
    if (len > remaining()) {
      return Error(at,
                   Cat(what, ": string length ", len, " exceeds the ", remaining(), " bytes left"));
    }
    *out = std::string_view(reinterpret_cast<const char*>(bytes_.data() + pos_), len);
    pos_ += len;
    return absl::OkStatus();
  }

  const uint8_t* Take(uint64_t n) {  // caller has checked Need(n)
    const uint8_t* p = bytes_.data() + pos_;
    pos_ += n;
    return p;
  }

 private:
  std::span<const uint8_t> bytes_;
  std::string_view where_;
  uint64_t pos_ = 0;
};

absl::Status ReadValue(Cursor& c, ValueType type, std::string_view key, Value* out) {
  out->type = type;
  if (type == ValueType::kString) {
    std::string_view s;
    TANDEM_RETURN_IF_ERROR(c.ReadString(&s, Cat("value of '", key, "'")));
    out->v = s;
    return absl::OkStatus();
  }
  if (type != ValueType::kArray) {
    const uint64_t size = ScalarSize(type);
    const uint64_t at = c.pos();
    TANDEM_RETURN_IF_ERROR(c.Need(size, Cat("value of '", key, "'")));
    const uint8_t* p = c.Take(size);
    if (type == ValueType::kBool && p[0] > 1) {
      return c.Error(at, Cat("'", key, "': bool value ", int{p[0]}, " is not 0 or 1"));
    }
    *out = DecodeScalar(type, p);
    return absl::OkStatus();
  }

  const uint64_t at = c.pos();
  uint32_t elem_raw = 0;
  TANDEM_RETURN_IF_ERROR(c.Read(&elem_raw, "array element type"));
  if (!IsKnownValueType(elem_raw)) {
    return c.Error(at, Cat("'", key, "': unknown array element type ", elem_raw));
  }
  const auto elem = static_cast<ValueType>(elem_raw);
  if (elem == ValueType::kArray) {
    return c.Error(at, Cat("'", key, "': nested arrays are not supported"));
  }
  const uint64_t count_at = c.pos();
  uint64_t count = 0;
  TANDEM_RETURN_IF_ERROR(c.Read(&count, "array length"));
  Array arr;
  arr.elem_type = elem;
  arr.count = count;
  if (elem == ValueType::kString) {
    // Every string takes at least its 8-byte length: cap the count before reserving.
    if (count > c.remaining() / 8) {
      return c.Error(count_at, Cat("'", key, "': array of ", count, " strings cannot fit in the ",
                                   c.remaining(), " bytes left"));
    }
    arr.strings.reserve(count);
    for (uint64_t i = 0; i < count; ++i) {
      std::string_view s;
      TANDEM_RETURN_IF_ERROR(c.ReadString(&s, Cat("'", key, "'[", i, "]")));
      arr.strings.push_back(s);
    }
  } else {
    const uint64_t size = ScalarSize(elem);
    if (count > c.remaining() / size) {
      return c.Error(count_at, Cat("'", key, "': array of ", count, " x ", size,
                                   "-byte elements exceeds the ", c.remaining(), " bytes left"));
    }
    const uint64_t data_at = c.pos();
    arr.data = c.Take(count * size);
    if (elem == ValueType::kBool) {
      for (uint64_t i = 0; i < count; ++i) {
        if (arr.data[i] > 1) {
          return c.Error(data_at + i, Cat("'", key, "'[", i, "]: bool value ", int{arr.data[i]},
                                          " is not 0 or 1"));
        }
      }
    }
  }
  out->v = std::move(arr);
  return absl::OkStatus();
}

uint64_t AlignUp(uint64_t x, uint64_t a, bool* overflow) {  // a is a power of two
  const uint64_t mask = a - 1;
  if (x > std::numeric_limits<uint64_t>::max() - mask) {
    *overflow = true;
    return 0;
  }
  return (x + mask) & ~mask;
}

absl::Status WrongType(std::string_view key, const Value& v, std::string_view wanted) {
  return absl::InvalidArgumentError(
      Cat("gguf key '", key, "' has type ", ValueTypeName(v.type), ", wanted ", wanted));
}

}  // namespace

std::string_view ValueTypeName(ValueType t) {
  switch (t) {
    case ValueType::kU8:
      return "u8";
    case ValueType::kI8:
      return "i8";
    case ValueType::kU16:
      return "u16";
    case ValueType::kI16:
      return "i16";
    case ValueType::kU32:
      return "u32";
    case ValueType::kI32:
      return "i32";
    case ValueType::kF32:
      return "f32";
    case ValueType::kBool:
      return "bool";
    case ValueType::kString:
      return "string";
    case ValueType::kArray:
      return "array";
    case ValueType::kU64:
      return "u64";
    case ValueType::kI64:
      return "i64";
    case ValueType::kF64:
      return "f64";
  }
  return "unknown";
}

int64_t TensorInfo::NumElements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;  // overflow was ruled out at parse time
  return n;
}

int64_t TensorInfo::Rows() const {
  int64_t n = 1;
  for (size_t i = 1; i < dims.size(); ++i) n *= dims[i];
  return n;
}

double ArrayElementAsDouble(const Array& a, uint64_t i) {
  const Value v = DecodeScalar(a.elem_type, a.data + i * ScalarSize(a.elem_type));
  if (const auto* u = std::get_if<uint64_t>(&v.v)) return static_cast<double>(*u);
  if (const auto* s = std::get_if<int64_t>(&v.v)) return static_cast<double>(*s);
  if (const auto* d = std::get_if<double>(&v.v)) return *d;
  if (const auto* b = std::get_if<bool>(&v.v)) return *b ? 1.0 : 0.0;
  return 0.0;
}

int64_t ArrayElementAsInt(const Array& a, uint64_t i) {
  const Value v = DecodeScalar(a.elem_type, a.data + i * ScalarSize(a.elem_type));
  if (const auto* u = std::get_if<uint64_t>(&v.v)) return static_cast<int64_t>(*u);
  if (const auto* s = std::get_if<int64_t>(&v.v)) return *s;
  if (const auto* d = std::get_if<double>(&v.v)) return static_cast<int64_t>(*d);
  if (const auto* b = std::get_if<bool>(&v.v)) return *b ? 1 : 0;
  return 0;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return util::FromErrno(errno, Cat("open ", path));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return util::FromErrno(err, Cat("stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(Cat("gguf ", path, ": not a regular file"));
  }
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = path;
  const size_t size = static_cast<size_t>(st.st_size);
  if (size > 0) {
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return util::FromErrno(err, Cat("mmap ", path));
    }
    f->map_ = m;
    f->map_size_ = size;
    f->bytes_ = std::span<const uint8_t>(static_cast<const uint8_t*>(m), size);
  }
  ::close(fd);  // the mapping keeps the file alive
  TANDEM_RETURN_IF_ERROR(f->Parse());
  return f;
}

void GgufFile::Prefault() const {
  if (map_ == nullptr) return;
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14; older kernels answer EINVAL and we touch pages
#endif
  if (::madvise(map_, map_size_, MADV_POPULATE_READ) == 0) return;
  ::madvise(map_, map_size_, MADV_WILLNEED);
  volatile uint8_t sink = 0;
  const long page = ::sysconf(_SC_PAGESIZE);
  for (size_t off = 0; off < map_size_; off += static_cast<size_t>(page)) {
    sink = sink ^ bytes_[off];
  }
}

void GgufFile::Release(const void* p, size_t n) const {
  if (map_ == nullptr || n == 0) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(p);
  const auto map_begin = reinterpret_cast<uintptr_t>(map_);
  if (begin < map_begin || begin + n > map_begin + map_size_) return;
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = (begin + n) / page * page;
  if (first < last) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::FromBuffer(std::span<const uint8_t> bytes) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = "<buffer>";
  f->bytes_ = bytes;
  TANDEM_RETURN_IF_ERROR(f->Parse());
  return f;
}

GgufFile::~GgufFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

absl::Status GgufFile::Parse() {
  Cursor c(bytes_, path_);

  uint32_t magic = 0;
  TANDEM_RETURN_IF_ERROR(c.Read(&magic, "magic"));
  if (magic != kMagic) return c.Error(0, "bad magic: not a GGUF file");
  TANDEM_RETURN_IF_ERROR(c.Read(&version_, "version"));
  if (version_ == 1) return c.Error(4, "GGUF v1 is not supported (re-convert the model)");
  // v2 and v3 share one layout (v3 only added big-endian files, which carry a byte-swapped
  // version and so fail this check).
  if (version_ != 2 && version_ != 3) {
    return c.Error(4, Cat("unsupported GGUF version ", version_));
  }
  uint64_t n_tensors = 0;
  uint64_t n_kv = 0;
  TANDEM_RETURN_IF_ERROR(c.Read(&n_tensors, "tensor count"));
  TANDEM_RETURN_IF_ERROR(c.Read(&n_kv, "metadata count"));
  if (n_kv > c.remaining() / kMinKvBytes) {
    return c.Error(
        16, Cat("metadata count ", n_kv, " cannot fit in the ", c.remaining(), " bytes left"));
  }

  metadata_.reserve(n_kv);
  for (uint64_t i = 0; i < n_kv; ++i) {
    const uint64_t at = c.pos();
    KeyValue kv;
    TANDEM_RETURN_IF_ERROR(c.ReadString(&kv.key, Cat("key ", i)));
    if (kv.key.empty()) return c.Error(at, Cat("key ", i, " is empty"));
    if (key_index_.count(kv.key) != 0) {
      return c.Error(at, Cat("duplicate key '", kv.key, "'"));
    }
    const uint64_t type_at = c.pos();
    uint32_t type = 0;
    TANDEM_RETURN_IF_ERROR(c.Read(&type, "value type"));
    if (!IsKnownValueType(type)) {
      return c.Error(type_at, Cat("key '", kv.key, "' has unknown value type ", type));
    }
    TANDEM_RETURN_IF_ERROR(ReadValue(c, static_cast<ValueType>(type), kv.key, &kv.value));
    key_index_.emplace(kv.key, metadata_.size());
    metadata_.push_back(std::move(kv));
  }

  if (const Value* a = Find("general.alignment")) {
    if (a->type != ValueType::kU32) {
      return absl::InvalidArgumentError(Cat("gguf ", path_, ": general.alignment has type ",
                                            ValueTypeName(a->type), ", must be u32"));
    }
    const uint64_t v = std::get<uint64_t>(a->v);
    if (v == 0 || (v & (v - 1)) != 0) {
      return absl::InvalidArgumentError(
          Cat("gguf ", path_, ": general.alignment ", v, " is not a power of two"));
    }
    alignment_ = static_cast<uint32_t>(v);
  }

  if (n_tensors > c.remaining() / kMinTensorInfoBytes) {
    return c.Error(8, Cat("tensor count ", n_tensors, " cannot fit in the ", c.remaining(),
                          " bytes left after the metadata"));
  }
  tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    const uint64_t at = c.pos();
    TensorInfo t;
    TANDEM_RETURN_IF_ERROR(c.ReadString(&t.name, Cat("tensor name ", i)));
    if (t.name.empty()) return c.Error(at, Cat("tensor ", i, " has an empty name"));
    if (tensor_index_.count(t.name) != 0) {
      return c.Error(at, Cat("duplicate tensor name '", t.name, "'"));
    }
    const uint64_t dims_at = c.pos();
    uint32_t n_dims = 0;
    TANDEM_RETURN_IF_ERROR(c.Read(&n_dims, "tensor n_dims"));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return c.Error(dims_at,
                     Cat("tensor '", t.name, "' has ", n_dims, " dimensions (must be 1..4)"));
    }
    t.dims.resize(n_dims);
    int64_t elems = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim_at = c.pos();
      uint64_t dim = 0;
      TANDEM_RETURN_IF_ERROR(c.Read(&dim, "tensor dim"));
      // Zero-sized dims are rejected: no model has them, and downstream code divides by them.
      if (dim == 0 || dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return c.Error(dim_at,
                       Cat("tensor '", t.name, "' dim ", d, " = ", dim, " is out of range"));
      }
      t.dims[d] = static_cast<int64_t>(dim);
      if (elems > std::numeric_limits<int64_t>::max() / t.dims[d]) {
        return c.Error(dim_at, Cat("tensor '", t.name, "' element count overflows int64"));
      }
      elems *= t.dims[d];
    }
    const uint64_t type_at = c.pos();
    uint32_t type_id = 0;
    TANDEM_RETURN_IF_ERROR(c.Read(&type_id, "tensor type"));
    const auto traits = kernels::GetDTypeTraits(type_id);
    if (!traits) {
      return absl::UnimplementedError(Cat("gguf ", path_, ": at byte ", type_at, ": tensor '",
                                          t.name, "' has type id ", type_id,
                                          ", which tandem does not support"));
    }
    t.type = traits->type;
    const auto row_bytes = kernels::RowBytesChecked(t.type, static_cast<uint64_t>(t.dims[0]));
    if (!row_bytes) {
      return c.Error(
          type_at, Cat("tensor '", t.name, "' row length ", t.dims[0], " is not a multiple of the ",
                       traits->name, " block size ", traits->block_elems));
    }
    const uint64_t rows = static_cast<uint64_t>(elems / t.dims[0]);
    if (*row_bytes > std::numeric_limits<uint64_t>::max() / rows) {
      return c.Error(type_at, Cat("tensor '", t.name, "' byte size overflows"));
    }
    t.nbytes = *row_bytes * rows;
    TANDEM_RETURN_IF_ERROR(c.Read(&t.offset, "tensor offset"));
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  if (tensors_.empty()) return absl::OkStatus();  // vocab-only files end after the header

  bool overflow = false;
  const uint64_t data_start = AlignUp(c.pos(), alignment_, &overflow);
  if (overflow || data_start > bytes_.size()) {
    return c.Error(c.pos(), Cat("data section (aligned to ", alignment_,
                                ") starts past the end of the file (", bytes_.size(), " bytes)"));
  }
  const uint64_t data_size = bytes_.size() - data_start;
  for (TensorInfo& t : tensors_) {
    if (t.offset % alignment_ != 0) {
      return absl::InvalidArgumentError(Cat("gguf ", path_, ": tensor '", t.name, "' data offset ",
                                            t.offset, " is not a multiple of the alignment ",
                                            alignment_));
    }
    if (t.offset > data_size || t.nbytes > data_size - t.offset) {
      return absl::InvalidArgumentError(Cat("gguf ", path_, ": tensor '", t.name, "' data [",
                                            data_start, "+", t.offset, ", +", t.nbytes,
                                            ") lies outside the file (", bytes_.size(), " bytes)"));
    }
    t.data = bytes_.data() + data_start + t.offset;
  }
  // Overlap check: sort by offset and require each range to end before the next begins.
  std::vector<size_t> order(tensors_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  const TensorInfo* furthest = nullptr;  // the non-empty range seen so far that ends last
  for (size_t k : order) {
    const TensorInfo& cur = tensors_[k];
    if (cur.nbytes == 0) continue;
    if (furthest != nullptr && furthest->offset + furthest->nbytes > cur.offset) {
      return absl::InvalidArgumentError(Cat("gguf ", path_, ": tensor '", cur.name,
                                            "' data at byte ", data_start + cur.offset,
                                            " overlaps tensor '", furthest->name, "'"));
    }
    furthest = &cur;
  }
  return absl::OkStatus();
}

const Value* GgufFile::Find(std::string_view key) const {
  auto it = key_index_.find(key);
  return it == key_index_.end() ? nullptr : &metadata_[it->second].value;
}

const TensorInfo* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {
absl::Status NotFound(std::string_view key) {
  return absl::NotFoundError(Cat("gguf key '", key, "' not found"));
}
}  // namespace

absl::StatusOr<std::string_view> GgufFile::GetString(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return NotFound(key);
  if (v->type != ValueType::kString) return WrongType(key, *v, "string");
  return std::get<std::string_view>(v->v);
}

absl::StatusOr<uint64_t> GgufFile::GetUInt(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return NotFound(key);
  if (IsUnsigned(v->type)) return std::get<uint64_t>(v->v);
  if (IsSigned(v->type)) {
    const int64_t s = std::get<int64_t>(v->v);
    if (s < 0) {
      return absl::InvalidArgumentError(
          Cat("gguf key '", key, "' = ", s, " is negative, wanted an unsigned value"));
    }
    return static_cast<uint64_t>(s);
  }
  return WrongType(key, *v, "an unsigned integer");
}

absl::StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return NotFound(key);
  if (IsSigned(v->type)) return std::get<int64_t>(v->v);
  if (IsUnsigned(v->type)) {
    const uint64_t u = std::get<uint64_t>(v->v);
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(
          Cat("gguf key '", key, "' = ", u, " does not fit in int64"));
    }
    return static_cast<int64_t>(u);
  }
  return WrongType(key, *v, "an integer");
}

absl::StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return NotFound(key);
  if (IsFloat(v->type)) return std::get<double>(v->v);
  if (IsUnsigned(v->type)) return static_cast<double>(std::get<uint64_t>(v->v));
  if (IsSigned(v->type)) return static_cast<double>(std::get<int64_t>(v->v));
  return WrongType(key, *v, "a number");
}

absl::StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return NotFound(key);
  if (v->type != ValueType::kBool) return WrongType(key, *v, "bool");
  return std::get<bool>(v->v);
}

absl::StatusOr<const Array*> GgufFile::GetArray(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) return NotFound(key);
  if (v->type != ValueType::kArray) return WrongType(key, *v, "array");
  return &std::get<Array>(v->v);
}

absl::StatusOr<uint64_t> GgufFile::GetUIntOr(std::string_view key, uint64_t def) const {
  if (Find(key) == nullptr) return def;
  return GetUInt(key);
}

absl::StatusOr<double> GgufFile::GetFloatOr(std::string_view key, double def) const {
  if (Find(key) == nullptr) return def;
  return GetFloat(key);
}

absl::StatusOr<bool> GgufFile::GetBoolOr(std::string_view key, bool def) const {
  if (Find(key) == nullptr) return def;
  return GetBool(key);
}

absl::StatusOr<std::string_view> GgufFile::GetStringOr(std::string_view key,
                                                       std::string_view def) const {
  if (Find(key) == nullptr) return def;
  return GetString(key);
}

absl::StatusOr<std::vector<float>> GgufFile::GetF32Array(std::string_view key) const {
  TANDEM_ASSIGN_OR_RETURN(const Array* a, GetArray(key));
  const ValueType t = a->elem_type;
  if (!IsFloat(t) && !IsSigned(t) && !IsUnsigned(t)) {
    return absl::InvalidArgumentError(
        Cat("gguf key '", key, "' is an array of ", ValueTypeName(t), ", wanted numbers"));
  }
  std::vector<float> out(a->count);
  for (uint64_t i = 0; i < a->count; ++i) {
    out[i] = static_cast<float>(ArrayElementAsDouble(*a, i));
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
  TANDEM_ASSIGN_OR_RETURN(const Array* a, GetArray(key));
  const ValueType t = a->elem_type;
  if (!IsSigned(t) && !IsUnsigned(t)) {
    return absl::InvalidArgumentError(
        Cat("gguf key '", key, "' is an array of ", ValueTypeName(t), ", wanted integers"));
  }
  std::vector<int64_t> out(a->count);
  for (uint64_t i = 0; i < a->count; ++i) {
    if (t == ValueType::kU64) {
      const uint64_t u = LoadLe<uint64_t>(a->data + i * 8);
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(
            Cat("gguf key '", key, "'[", i, "] = ", u, " does not fit in int64"));
      }
    }
    out[i] = ArrayElementAsInt(*a, i);
  }
  return out;
}

absl::StatusOr<std::span<const std::string_view>> GgufFile::GetStringArray(
    std::string_view key) const {
  TANDEM_ASSIGN_OR_RETURN(const Array* a, GetArray(key));
  if (a->elem_type != ValueType::kString) {
    return absl::InvalidArgumentError(Cat("gguf key '", key, "' is an array of ",
                                          ValueTypeName(a->elem_type), ", wanted strings"));
  }
  return std::span<const std::string_view>(a->strings);
}

}  // namespace tandem::gguf
