// GGUF v3 reader and writer.
//
// GgufFile memory-maps a model file (or borrows a caller's buffer) and parses its header,
// metadata and tensor table. Every length, count, offset and size is bounds-checked against
// the mapping, so a truncated, corrupted or hostile file yields an error Status, never a crash
// or an out-of-bounds read. After Open succeeds the object is immutable and safe to share
// between threads; views (string_view, spans, tensor data pointers) stay valid for its lifetime.
//
// GgufWriter builds a file in memory-light form (metadata kept in memory, tensor bytes copied
// on Write) and writes it with the required alignment. Tensors may also be streamed from a
// RowSource at Write time, so a multi-GiB model never has to be held in memory. A writer is
// not thread-safe; Write is const and may be repeated.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/kernels/dtype.h"

namespace tandem::gguf {

enum class ValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

std::string_view ValueTypeName(ValueType t);

// An array value. Numeric arrays are views of the mapped bytes (little-endian, possibly
// unaligned: read with the typed accessors); string arrays are parsed into views.
struct Array {
  ValueType elem_type = ValueType::kU8;
  uint64_t count = 0;
  const uint8_t* data = nullptr;          // numeric/bool elements, count * size bytes
  std::vector<std::string_view> strings;  // when elem_type == kString
  // Nested arrays are rejected at parse time (no tokenizer or model uses them).
};

struct Value {
  ValueType type = ValueType::kU8;
  std::variant<uint64_t, int64_t, double, bool, std::string_view, Array> v;
};

struct KeyValue {
  std::string_view key;
  Value value;
};

struct TensorInfo {
  std::string_view name;
  std::vector<int64_t> dims;  // 1..4 dims, each >= 1; dims[0] is the row length
  kernels::DType type = kernels::DType::kF32;
  uint64_t offset = 0;  // relative to the data section
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;

  int64_t NumElements() const;
  int64_t Rows() const;  // product of dims[1..]
};

class GgufFile {
 public:
  // Maps and parses the file. NOT_FOUND / PERMISSION_DENIED for the file itself,
  // INVALID_ARGUMENT (with the byte offset) for malformed content, UNIMPLEMENTED for a
  // tensor type tandem does not support.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses a caller-owned buffer that must outlive the returned object (tests, fuzzing).
  static absl::StatusOr<std::unique_ptr<GgufFile>> FromBuffer(std::span<const uint8_t> bytes);

  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  const std::string& path() const { return path_; }
  // Reads the whole mapping into memory now (page cache, then mapped), so the first forward
  // pass does not stall on page faults; a server calls this at load, a tokenizer-only reader
  // does not. A no-op for borrowed buffers.
  void Prefault() const;
  // Drops the mapped pages that lie wholly inside [p, p + n), which the caller will not read
  // again (they would be read back from the file if it did). A no-op for buffers.
  void Release(const void* p, size_t n) const;
  std::span<const KeyValue> metadata() const { return metadata_; }
  std::span<const TensorInfo> tensors() const { return tensors_; }

  const Value* Find(std::string_view key) const;
  const TensorInfo* FindTensor(std::string_view name) const;

  // Typed getters. NOT_FOUND when absent; INVALID_ARGUMENT when present with a type that does
  // not convert (integers convert between widths when the value fits).
  absl::StatusOr<std::string_view> GetString(std::string_view key) const;
  absl::StatusOr<uint64_t> GetUInt(std::string_view key) const;
  absl::StatusOr<int64_t> GetInt(std::string_view key) const;
  absl::StatusOr<double> GetFloat(std::string_view key) const;  // any numeric type
  absl::StatusOr<bool> GetBool(std::string_view key) const;
  absl::StatusOr<const Array*> GetArray(std::string_view key) const;

  // Absent key: the default. Present but of a wrong type or out of range: an error.
  absl::StatusOr<uint64_t> GetUIntOr(std::string_view key, uint64_t def) const;
  absl::StatusOr<double> GetFloatOr(std::string_view key, double def) const;
  absl::StatusOr<bool> GetBoolOr(std::string_view key, bool def) const;
  absl::StatusOr<std::string_view> GetStringOr(std::string_view key, std::string_view def) const;

  // Array helpers: element conversion with the same rules as the scalar getters.
  absl::StatusOr<std::vector<float>> GetF32Array(std::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> GetIntArray(std::string_view key) const;
  absl::StatusOr<std::span<const std::string_view>> GetStringArray(std::string_view key) const;

 private:
  GgufFile() = default;
  absl::Status Parse();

  std::string path_;
  void* map_ = nullptr;  // owned mmap, or null when borrowing
  size_t map_size_ = 0;
  std::span<const uint8_t> bytes_;
  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  std::vector<KeyValue> metadata_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string_view, size_t> key_index_;
  std::unordered_map<std::string_view, size_t> tensor_index_;
};

// Reads element i of a numeric array as double / int64 (no range checks beyond the type).
double ArrayElementAsDouble(const Array& a, uint64_t i);
int64_t ArrayElementAsInt(const Array& a, uint64_t i);

class GgufWriter {
 public:
  GgufWriter() = default;

  void SetU32(std::string key, uint32_t v);
  void SetI32(std::string key, int32_t v);
  void SetU64(std::string key, uint64_t v);
  void SetF32(std::string key, float v);
  void SetBool(std::string key, bool v);
  void SetString(std::string key, std::string v);
  void SetStringArray(std::string key, std::vector<std::string> v);
  void SetF32Array(std::string key, std::vector<float> v);
  void SetI32Array(std::string key, std::vector<int32_t> v);
  // Copies a value read from another file (e.g. the tokenizer of a vocab GGUF).
  void CopyValue(std::string key, const Value& v);

  // Adds a tensor; bytes must be RowBytes(type, dims[0]) * rows long. The bytes are copied.
  // INVALID_ARGUMENT for a duplicate, empty or over-long (>= 64 bytes: llama.cpp's limit) name,
  // 0 or more than 4 dims, a dim < 1, a row length that is not a multiple of the type's block,
  // or a wrong byte count.
  absl::Status AddTensor(std::string name, std::vector<int64_t> dims, kernels::DType type,
                         std::span<const uint8_t> bytes);

  // Produces rows [row_begin, row_end) of a tensor (rows = product of dims[1..]) into `out`,
  // which holds exactly (row_end - row_begin) * RowBytes(type, dims[0]) bytes. Write calls it
  // in increasing row order, in chunks of a few MiB, once per Write; an error aborts the Write.
  using RowSource =
      std::function<absl::Status(int64_t row_begin, int64_t row_end, std::span<uint8_t> out)>;
  // Adds a tensor whose bytes are produced at Write time. The source (and anything it
  // captures) must stay valid until the last Write. Same checks as AddTensor.
  absl::Status AddTensorFromSource(std::string name, std::vector<int64_t> dims, kernels::DType type,
                                   RowSource source);

  // Writes the file (atomically: a temp file in the same folder, renamed over path). An
  // alignment other than 32 is recorded as general.alignment (u32); it must be a power of two.
  absl::Status Write(const std::string& path, uint32_t alignment = 32) const;
  // The same bytes in memory (tests and small files).
  absl::StatusOr<std::vector<uint8_t>> WriteToBuffer(uint32_t alignment = 32) const;

  size_t num_tensors() const { return tensors_.size(); }

 private:
  struct Entry {
    std::string key;
    ValueType type;
    std::vector<uint8_t> encoded;  // the value as it is serialised after the type tag
  };
  struct Tensor {
    std::string name;
    std::vector<int64_t> dims;
    kernels::DType type;
    uint64_t nbytes = 0;
    int64_t rows = 0;
    std::vector<uint8_t> bytes;  // when source is empty
    RowSource source;
  };
  using ByteSink = std::function<absl::Status(std::span<const uint8_t>)>;
  void Put(std::string key, ValueType type, std::vector<uint8_t> encoded);
  absl::Status CheckNewTensor(const std::string& name, const std::vector<int64_t>& dims,
                              kernels::DType type, uint64_t* nbytes, int64_t* rows) const;
  absl::Status WriteTo(const ByteSink& sink, uint32_t alignment) const;
  std::vector<Entry> entries_;
  std::vector<Tensor> tensors_;
};

}  // namespace tandem::gguf
