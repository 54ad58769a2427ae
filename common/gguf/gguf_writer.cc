// GGUF writer: the layout GgufFile reads (and llama.cpp's gguf writer produces): header,
// metadata, tensor infos, padding to the alignment, then each tensor's bytes followed by
// padding to the alignment.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>

#include "common/gguf/gguf.h"
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

constexpr uint32_t kVersion = 3;
constexpr uint32_t kDefaultAlignment = 32;
constexpr uint64_t kChunkBytes = 8u << 20;  // RowSource chunks and file write buffer
constexpr size_t kMaxTensorName = 64;       // GGML_MAX_NAME, including the terminator

template <typename T>
void Append(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));
}

void AppendString(std::vector<uint8_t>& out, std::string_view s) {
  Append<uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

uint64_t ScalarBytes(ValueType t) {
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
    default:
      return 0;
  }
}

// Encodes a scalar in the type it was read with, so a copy is bit-faithful.
void AppendScalar(std::vector<uint8_t>& out, const Value& v) {
  switch (v.type) {
    case ValueType::kU8:
      Append<uint8_t>(out, static_cast<uint8_t>(std::get<uint64_t>(v.v)));
      break;
    case ValueType::kU16:
      Append<uint16_t>(out, static_cast<uint16_t>(std::get<uint64_t>(v.v)));
      break;
    case ValueType::kU32:
      Append<uint32_t>(out, static_cast<uint32_t>(std::get<uint64_t>(v.v)));
      break;
    case ValueType::kU64:
      Append<uint64_t>(out, std::get<uint64_t>(v.v));
      break;
    case ValueType::kI8:
      Append<int8_t>(out, static_cast<int8_t>(std::get<int64_t>(v.v)));
      break;
    case ValueType::kI16:
      Append<int16_t>(out, static_cast<int16_t>(std::get<int64_t>(v.v)));
      break;
    case ValueType::kI32:
      Append<int32_t>(out, static_cast<int32_t>(std::get<int64_t>(v.v)));
      break;
    case ValueType::kI64:
      Append<int64_t>(out, std::get<int64_t>(v.v));
      break;
    case ValueType::kF32:
      Append<float>(out, static_cast<float>(std::get<double>(v.v)));
      break;
    case ValueType::kF64:
      Append<double>(out, std::get<double>(v.v));
      break;
    case ValueType::kBool:
      Append<uint8_t>(out, std::get<bool>(v.v) ? 1 : 0);
      break;
    case ValueType::kString:
      AppendString(out, std::get<std::string_view>(v.v));
      break;
    case ValueType::kArray:
      break;  // handled by the caller
  }
}

uint64_t PadTo(uint64_t x, uint64_t a) { return (a - x % a) % a; }

}  // namespace

namespace {

absl::Status WriteZeros(const std::function<absl::Status(std::span<const uint8_t>)>& sink,
                        uint64_t n) {
  static const uint8_t kZeros[256] = {};
  while (n > 0) {
    const uint64_t k = std::min<uint64_t>(n, sizeof(kZeros));
    TANDEM_RETURN_IF_ERROR(sink(std::span<const uint8_t>(kZeros, k)));
    n -= k;
  }
  return absl::OkStatus();
}

// Buffers writes to a file descriptor in large chunks.
class FdWriter {
 public:
  FdWriter(int fd, std::string path) : fd_(fd), path_(std::move(path)) {
    buf_.reserve(kChunkBytes);
  }
  absl::Status Write(std::span<const uint8_t> b) {
    if (buf_.size() + b.size() > kChunkBytes) {
      TANDEM_RETURN_IF_ERROR(Flush());
      if (b.size() >= kChunkBytes) return WriteAll(b.data(), b.size());
    }
    buf_.insert(buf_.end(), b.begin(), b.end());
    return absl::OkStatus();
  }
  absl::Status Flush() {
    TANDEM_RETURN_IF_ERROR(WriteAll(buf_.data(), buf_.size()));
    buf_.clear();
    return absl::OkStatus();
  }

 private:
  absl::Status WriteAll(const uint8_t* p, uint64_t n) {
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, std::min<uint64_t>(n, 1u << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        return util::FromErrno(errno, Cat("write ", path_));
      }
      p += w;
      n -= static_cast<uint64_t>(w);
    }
    return absl::OkStatus();
  }
  int fd_;
  std::string path_;
  std::vector<uint8_t> buf_;
};

}  // namespace

// Keys keep their first position when set again, so a copied file's order is preserved.
void GgufWriter::Put(std::string key, ValueType type, std::vector<uint8_t> encoded) {
  for (Entry& e : entries_) {
    if (e.key == key) {
      e.type = type;
      e.encoded = std::move(encoded);
      return;
    }
  }
  entries_.push_back(Entry{std::move(key), type, std::move(encoded)});
}

void GgufWriter::SetU32(std::string key, uint32_t v) {
  std::vector<uint8_t> e;
  Append(e, v);
  Put(std::move(key), ValueType::kU32, std::move(e));
}
void GgufWriter::SetI32(std::string key, int32_t v) {
  std::vector<uint8_t> e;
  Append(e, v);
  Put(std::move(key), ValueType::kI32, std::move(e));
}
void GgufWriter::SetU64(std::string key, uint64_t v) {
  std::vector<uint8_t> e;
  Append(e, v);
  Put(std::move(key), ValueType::kU64, std::move(e));
}
void GgufWriter::SetF32(std::string key, float v) {
  std::vector<uint8_t> e;
  Append(e, v);
  Put(std::move(key), ValueType::kF32, std::move(e));
}
void GgufWriter::SetBool(std::string key, bool v) {
  std::vector<uint8_t> e;
  Append<uint8_t>(e, v ? 1 : 0);
  Put(std::move(key), ValueType::kBool, std::move(e));
}
void GgufWriter::SetString(std::string key, std::string v) {
  std::vector<uint8_t> e;
  AppendString(e, v);
  Put(std::move(key), ValueType::kString, std::move(e));
}
void GgufWriter::SetStringArray(std::string key, std::vector<std::string> v) {
  std::vector<uint8_t> e;
  Append<uint32_t>(e, static_cast<uint32_t>(ValueType::kString));
  Append<uint64_t>(e, v.size());
  for (const std::string& s : v) AppendString(e, s);
  Put(std::move(key), ValueType::kArray, std::move(e));
}
void GgufWriter::SetF32Array(std::string key, std::vector<float> v) {
  std::vector<uint8_t> e;
  Append<uint32_t>(e, static_cast<uint32_t>(ValueType::kF32));
  Append<uint64_t>(e, v.size());
  for (float f : v) Append(e, f);
  Put(std::move(key), ValueType::kArray, std::move(e));
}
void GgufWriter::SetI32Array(std::string key, std::vector<int32_t> v) {
  std::vector<uint8_t> e;
  Append<uint32_t>(e, static_cast<uint32_t>(ValueType::kI32));
  Append<uint64_t>(e, v.size());
  for (int32_t x : v) Append(e, x);
  Put(std::move(key), ValueType::kArray, std::move(e));
}

void GgufWriter::CopyValue(std::string key, const Value& v) {
  std::vector<uint8_t> e;
  if (v.type == ValueType::kArray) {
    const Array& a = std::get<Array>(v.v);
    Append<uint32_t>(e, static_cast<uint32_t>(a.elem_type));
    Append<uint64_t>(e, a.count);
    if (a.elem_type == ValueType::kString) {
      for (std::string_view s : a.strings) AppendString(e, s);
    } else if (a.count > 0) {
      e.insert(e.end(), a.data, a.data + a.count * ScalarBytes(a.elem_type));
    }
  } else {
    AppendScalar(e, v);
  }
  Put(std::move(key), v.type, std::move(e));
}

absl::Status GgufWriter::CheckNewTensor(const std::string& name, const std::vector<int64_t>& dims,
                                        kernels::DType type, uint64_t* nbytes,
                                        int64_t* rows) const {
  if (name.empty()) return absl::InvalidArgumentError("gguf writer: empty tensor name");
  if (name.size() >= kMaxTensorName) {
    return absl::InvalidArgumentError(Cat("gguf writer: tensor name '", name,
                                          "' is longer than llama.cpp accepts (",
                                          kMaxTensorName - 1, " bytes)"));
  }
  for (const Tensor& t : tensors_) {
    if (t.name == name) {
      return absl::InvalidArgumentError(Cat("gguf writer: duplicate tensor name '", name, "'"));
    }
  }
  if (dims.empty() || dims.size() > 4) {
    return absl::InvalidArgumentError(
        Cat("gguf writer: tensor '", name, "' has ", dims.size(), " dims (must be 1..4)"));
  }
  int64_t r = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] <= 0) {
      return absl::InvalidArgumentError(Cat("gguf writer: tensor '", name, "' has a dim < 1"));
    }
    if (i == 0) continue;
    if (r > std::numeric_limits<int64_t>::max() / dims[i]) {
      return absl::InvalidArgumentError(Cat("gguf writer: tensor '", name, "' is too large"));
    }
    r *= dims[i];
  }
  const auto row_bytes = kernels::RowBytesChecked(type, static_cast<uint64_t>(dims[0]));
  if (!row_bytes) {
    return absl::InvalidArgumentError(Cat("gguf writer: tensor '", name, "' row length ", dims[0],
                                          " is not a multiple of the ", kernels::Traits(type).name,
                                          " block size ", kernels::Traits(type).block_elems));
  }
  if (*row_bytes > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(r)) {
    return absl::InvalidArgumentError(Cat("gguf writer: tensor '", name, "' is too large"));
  }
  *nbytes = *row_bytes * static_cast<uint64_t>(r);
  *rows = r;
  return absl::OkStatus();
}

absl::Status GgufWriter::AddTensor(std::string name, std::vector<int64_t> dims, kernels::DType type,
                                   std::span<const uint8_t> bytes) {
  Tensor t;
  TANDEM_RETURN_IF_ERROR(CheckNewTensor(name, dims, type, &t.nbytes, &t.rows));
  if (bytes.size() != t.nbytes) {
    return absl::InvalidArgumentError(
        Cat("gguf writer: tensor '", name, "' needs ", t.nbytes, " bytes, got ", bytes.size()));
  }
  t.name = std::move(name);
  t.dims = std::move(dims);
  t.type = type;
  t.bytes.assign(bytes.begin(), bytes.end());
  tensors_.push_back(std::move(t));
  return absl::OkStatus();
}

absl::Status GgufWriter::AddTensorFromSource(std::string name, std::vector<int64_t> dims,
                                             kernels::DType type, RowSource source) {
  if (!source) return absl::InvalidArgumentError("gguf writer: null RowSource");
  Tensor t;
  TANDEM_RETURN_IF_ERROR(CheckNewTensor(name, dims, type, &t.nbytes, &t.rows));
  t.name = std::move(name);
  t.dims = std::move(dims);
  t.type = type;
  t.source = std::move(source);
  tensors_.push_back(std::move(t));
  return absl::OkStatus();
}

absl::Status GgufWriter::WriteTo(const ByteSink& sink, uint32_t alignment) const {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError(
        Cat("gguf writer: alignment ", alignment, " is not a power of two"));
  }
  // general.alignment must agree with the layout actually written.
  std::vector<uint8_t> align_value;
  Append<uint32_t>(align_value, alignment);
  bool have_align_key = false;
  for (const Entry& e : entries_) {
    if (e.key != "general.alignment") continue;
    have_align_key = true;
    if (e.type != ValueType::kU32 || e.encoded != align_value) {
      return absl::InvalidArgumentError(
          Cat("gguf writer: general.alignment is set and differs from the write alignment ",
              alignment));
    }
  }
  const bool add_align_key = !have_align_key && alignment != kDefaultAlignment;

  std::vector<uint8_t> head;
  Append<uint32_t>(head, 0x46554747);  // "GGUF"
  Append<uint32_t>(head, kVersion);
  Append<uint64_t>(head, tensors_.size());
  Append<uint64_t>(head, entries_.size() + (add_align_key ? 1 : 0));
  for (const Entry& e : entries_) {
    AppendString(head, e.key);
    Append<uint32_t>(head, static_cast<uint32_t>(e.type));
    head.insert(head.end(), e.encoded.begin(), e.encoded.end());
  }
  if (add_align_key) {
    AppendString(head, "general.alignment");
    Append<uint32_t>(head, static_cast<uint32_t>(ValueType::kU32));
    head.insert(head.end(), align_value.begin(), align_value.end());
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    AppendString(head, t.name);
    Append<uint32_t>(head, static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) Append<uint64_t>(head, static_cast<uint64_t>(d));
    Append<uint32_t>(head, static_cast<uint32_t>(t.type));
    Append<uint64_t>(head, offset);
    offset += t.nbytes + PadTo(t.nbytes, alignment);
  }
  TANDEM_RETURN_IF_ERROR(sink(head));
  if (tensors_.empty()) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(WriteZeros(sink, PadTo(head.size(), alignment)));

  std::vector<uint8_t> chunk;
  for (const Tensor& t : tensors_) {
    if (!t.source) {
      TANDEM_RETURN_IF_ERROR(sink(t.bytes));
    } else {
      const uint64_t row_bytes = t.nbytes / static_cast<uint64_t>(t.rows);
      const int64_t rows_per_chunk =
          static_cast<int64_t>(std::max<uint64_t>(1, kChunkBytes / row_bytes));
      for (int64_t r = 0; r < t.rows; r += rows_per_chunk) {
        const int64_t end = std::min(t.rows, r + rows_per_chunk);
        chunk.resize(static_cast<uint64_t>(end - r) * row_bytes);
        TANDEM_RETURN_IF_ERROR(t.source(r, end, std::span<uint8_t>(chunk)));
        TANDEM_RETURN_IF_ERROR(sink(chunk));
      }
    }
    TANDEM_RETURN_IF_ERROR(WriteZeros(sink, PadTo(t.nbytes, alignment)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> GgufWriter::WriteToBuffer(uint32_t alignment) const {
  std::vector<uint8_t> out;
  TANDEM_RETURN_IF_ERROR(WriteTo(
      [&out](std::span<const uint8_t> b) {
        out.insert(out.end(), b.begin(), b.end());
        return absl::OkStatus();
      },
      alignment));
  return out;
}

absl::Status GgufWriter::Write(const std::string& path, uint32_t alignment) const {
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) return util::FromErrno(errno, Cat("create temp file for ", path));
  // mkstemp makes the file 0600; a model file is ordinary data.
  ::fchmod(fd, 0644);
  FdWriter file(fd, tmp);
  absl::Status st =
      WriteTo([&file](std::span<const uint8_t> b) { return file.Write(b); }, alignment);
  if (st.ok()) st = file.Flush();
  if (st.ok() && ::fsync(fd) != 0) st = util::FromErrno(errno, Cat("fsync ", tmp));
  if (::close(fd) != 0 && st.ok()) st = util::FromErrno(errno, Cat("close ", tmp));
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    st = util::FromErrno(errno, Cat("rename ", tmp, " to ", path));
  }
  if (!st.ok()) ::unlink(tmp.c_str());
  return st;
}

}  // namespace tandem::gguf
