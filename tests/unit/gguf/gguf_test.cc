// GGUF reader/writer: round trips, typed getters, hostile inputs and the real stories260K file.
#include "common/gguf/gguf.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/kernels/dtype.h"

namespace tandem::gguf {
namespace {

using kernels::DType;
using ::testing::HasSubstr;

// Raw little-endian byte builder for hand-made (often hostile) files.
struct Raw {
  std::vector<uint8_t> b;
  template <typename T>
  Raw& Put(T v) {
    const size_t at = b.size();
    b.resize(at + sizeof(T));
    std::memcpy(b.data() + at, &v, sizeof(T));
    return *this;
  }
  Raw& Str(std::string_view s) {
    Put<uint64_t>(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Raw& Header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    b.insert(b.end(), {'G', 'G', 'U', 'F'});
    Put<uint32_t>(version);
    Put<uint64_t>(n_tensors);
    Put<uint64_t>(n_kv);
    return *this;
  }
  Raw& KvU32(std::string_view key, uint32_t v) {
    Str(key);
    Put<uint32_t>(4);
    Put<uint32_t>(v);
    return *this;
  }
  Raw& TensorInfo(std::string_view name, std::vector<uint64_t> dims, uint32_t type,
                  uint64_t offset) {
    Str(name);
    Put<uint32_t>(static_cast<uint32_t>(dims.size()));
    for (uint64_t d : dims) Put<uint64_t>(d);
    Put<uint32_t>(type);
    Put<uint64_t>(offset);
    return *this;
  }
  Raw& PadTo(size_t a) {
    while (b.size() % a != 0) b.push_back(0);
    return *this;
  }
  Raw& Zeros(size_t n) {
    b.insert(b.end(), n, 0);
    return *this;
  }
};

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

absl::StatusOr<std::unique_ptr<GgufFile>> Parse(const std::vector<uint8_t>& bytes) {
  return GgufFile::FromBuffer(std::span<const uint8_t>(bytes));
}

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = static_cast<uint8_t>(rng());
  return v;
}

// A small valid model-like file: metadata of several kinds and three tensors.
std::vector<uint8_t> SmallValidFile() {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetU32("llama.block_count", 2);
  w.SetF32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.SetStringArray("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "a"});
  w.SetF32Array("tokenizer.ggml.scores", {0.f, 0.f, 0.f, -1.5f});
  w.SetI32Array("tokenizer.ggml.token_type", {2, 3, 3, 1});
  EXPECT_TRUE(w.AddTensor("a.weight", {32, 2}, DType::kF32, RandomBytes(256, 1)).ok());
  EXPECT_TRUE(w.AddTensor("b.weight", {64, 1}, DType::kQ8_0, RandomBytes(68, 2)).ok());
  EXPECT_TRUE(w.AddTensor("c.weight", {16}, DType::kF16, RandomBytes(32, 3)).ok());
  auto bytes = w.WriteToBuffer();
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return *bytes;
}

TEST(GgufRoundTrip, EveryValueType) {
  GgufWriter w;
  w.SetU32("u32", 4000000000u);
  w.SetI32("i32", -7);
  w.SetU64("u64", 0xfedcba9876543210ull);
  w.SetF32("f32", 0.25f);
  w.SetBool("bool", true);
  w.SetString("str", "hello \xe2\x96\x81world");
  w.SetStringArray("strs", {"a", "", "ccc"});
  w.SetF32Array("f32s", {1.5f, -2.0f, 3.25f});
  w.SetI32Array("i32s", {-1, 0, 2147483647});
  // The remaining scalar types go through CopyValue, as a copied tokenizer would.
  w.CopyValue("u8", Value{ValueType::kU8, uint64_t{200}});
  w.CopyValue("i8", Value{ValueType::kI8, int64_t{-100}});
  w.CopyValue("u16", Value{ValueType::kU16, uint64_t{65000}});
  w.CopyValue("i16", Value{ValueType::kI16, int64_t{-30000}});
  w.CopyValue("i64", Value{ValueType::kI64, int64_t{-5000000000}});
  w.CopyValue("f64", Value{ValueType::kF64, 1.0 / 3.0});
  const uint8_t bools[3] = {1, 0, 1};
  w.CopyValue("bools", Value{ValueType::kArray, Array{ValueType::kBool, 3, bools, {}}});
  uint64_t u64s[2] = {1, 0xffffffffffffffffull};
  w.CopyValue("u64s", Value{ValueType::kArray,
                            Array{ValueType::kU64, 2, reinterpret_cast<uint8_t*>(u64s), {}}});
  w.SetU32("u32", 4000000001u);  // a repeated key replaces the value, keeping one entry

  auto bytes = w.WriteToBuffer();
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto f = Parse(*bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.metadata().size(), 17u);
  EXPECT_EQ(g.metadata()[0].key, "u32");
  EXPECT_EQ(*g.GetUInt("u32"), 4000000001u);
  EXPECT_EQ(g.Find("u32")->type, ValueType::kU32);
  EXPECT_EQ(*g.GetInt("i32"), -7);
  EXPECT_EQ(*g.GetUInt("u64"), 0xfedcba9876543210ull);
  EXPECT_EQ(*g.GetFloat("f32"), 0.25);
  EXPECT_TRUE(*g.GetBool("bool"));
  EXPECT_EQ(*g.GetString("str"), "hello \xe2\x96\x81world");
  EXPECT_THAT(*g.GetStringArray("strs"), ::testing::ElementsAre("a", "", "ccc"));
  EXPECT_THAT(*g.GetF32Array("f32s"), ::testing::ElementsAre(1.5f, -2.0f, 3.25f));
  EXPECT_THAT(*g.GetIntArray("i32s"), ::testing::ElementsAre(-1, 0, 2147483647));
  EXPECT_EQ(*g.GetUInt("u8"), 200u);
  EXPECT_EQ(g.Find("u8")->type, ValueType::kU8);
  EXPECT_EQ(*g.GetInt("i8"), -100);
  EXPECT_EQ(*g.GetUInt("u16"), 65000u);
  EXPECT_EQ(*g.GetInt("i16"), -30000);
  EXPECT_EQ(*g.GetInt("i64"), -5000000000);
  EXPECT_EQ(*g.GetFloat("f64"), 1.0 / 3.0);
  EXPECT_EQ(g.Find("f64")->type, ValueType::kF64);
  EXPECT_THAT(Msg(g.GetIntArray("bools").status()), HasSubstr("bool"));
  const Array* b = *g.GetArray("bools");
  ASSERT_EQ(b->count, 3u);
  EXPECT_EQ(ArrayElementAsInt(*b, 0), 1);
  EXPECT_EQ(ArrayElementAsInt(*b, 1), 0);
  const Array* u = *g.GetArray("u64s");
  EXPECT_EQ(static_cast<uint64_t>(ArrayElementAsInt(*u, 1)), 0xffffffffffffffffull);
  EXPECT_EQ(g.GetIntArray("u64s").status().code(), absl::StatusCode::kInvalidArgument);

  // Conversions and their limits.
  EXPECT_EQ(*g.GetInt("u32"), 4000000001);
  EXPECT_EQ(*g.GetFloat("i32"), -7.0);
  EXPECT_EQ(g.GetUInt("i32").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetInt("u64").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetBool("u32").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetString("u32").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetArray("str").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetUInt("f32").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetStringArray("f32s").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetF32Array("strs").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetUInt("missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*g.GetUIntOr("missing", 9), 9u);
  EXPECT_EQ(*g.GetUIntOr("u32", 9), 4000000001u);
  EXPECT_EQ(g.GetUIntOr("str", 9).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*g.GetFloatOr("missing", 2.5), 2.5);
  EXPECT_EQ(*g.GetBoolOr("missing", true), true);
  EXPECT_EQ(*g.GetBoolOr("bool", false), true);
  EXPECT_EQ(*g.GetStringOr("missing", "x"), "x");
  EXPECT_EQ(g.GetStringOr("u8", "x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(g.tensors().empty());
}

TEST(GgufRoundTrip, CopyValueReproducesBytes) {
  // Copying every KV of a parsed file into a new writer reproduces the file exactly.
  const std::vector<uint8_t> orig = SmallValidFile();
  auto f = Parse(orig);
  ASSERT_TRUE(f.ok()) << f.status();
  GgufWriter w;
  for (const KeyValue& kv : (*f)->metadata()) w.CopyValue(std::string(kv.key), kv.value);
  for (const TensorInfo& t : (*f)->tensors()) {
    ASSERT_TRUE(w.AddTensor(std::string(t.name), t.dims, t.type, {t.data, t.nbytes}).ok());
  }
  auto copy = w.WriteToBuffer();
  ASSERT_TRUE(copy.ok());
  EXPECT_EQ(*copy, orig);
}

class GgufTensorTypes : public ::testing::TestWithParam<DType> {};

TEST_P(GgufTensorTypes, RoundTripAtTwoAlignments) {
  const DType type = GetParam();
  const auto& tr = kernels::Traits(type);
  for (uint32_t alignment : {32u, 64u}) {
    GgufWriter w;
    w.SetString("general.architecture", "test");
    const std::vector<int64_t> dims_a = {2 * tr.block_elems, 3};
    const std::vector<int64_t> dims_b = {tr.block_elems, 2, 1, 3};
    const auto bytes_a = RandomBytes(kernels::RowBytes(type, dims_a[0]) * 3, 11);
    const auto bytes_b = RandomBytes(kernels::RowBytes(type, dims_b[0]) * 6, 12);
    ASSERT_TRUE(w.AddTensor("x.weight", dims_a, type, bytes_a).ok());
    // A streamed tensor must land exactly like a copied one.
    ASSERT_TRUE(w.AddTensorFromSource("y.weight", dims_b, type,
                                      [&](int64_t r0, int64_t r1, std::span<uint8_t> out) {
                                        const uint64_t rb = bytes_b.size() / 6;
                                        EXPECT_EQ(out.size(), (r1 - r0) * rb);
                                        std::memcpy(out.data(), bytes_b.data() + r0 * rb,
                                                    out.size());
                                        return absl::OkStatus();
                                      })
                    .ok());
    auto out = w.WriteToBuffer(alignment);
    ASSERT_TRUE(out.ok()) << out.status();
    auto f = Parse(*out);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->alignment(), alignment);
    if (alignment != 32) {
      EXPECT_EQ(*(*f)->GetUInt("general.alignment"), alignment);
    }
    ASSERT_EQ((*f)->tensors().size(), 2u);
    const TensorInfo* a = (*f)->FindTensor("x.weight");
    const TensorInfo* b = (*f)->FindTensor("y.weight");
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(a->type, type);
    EXPECT_EQ(a->dims, dims_a);
    EXPECT_EQ(b->dims, dims_b);
    EXPECT_EQ(a->Rows(), 3);
    EXPECT_EQ(b->Rows(), 6);
    EXPECT_EQ(b->NumElements(), tr.block_elems * 6);
    ASSERT_EQ(a->nbytes, bytes_a.size());
    ASSERT_EQ(b->nbytes, bytes_b.size());
    EXPECT_EQ(0, std::memcmp(a->data, bytes_a.data(), a->nbytes));
    EXPECT_EQ(0, std::memcmp(b->data, bytes_b.data(), b->nbytes));
    EXPECT_EQ((a->data - out->data()) % alignment, 0);
    EXPECT_EQ((b->data - out->data()) % alignment, 0);
    EXPECT_EQ((*f)->FindTensor("z.weight"), nullptr);
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, GgufTensorTypes,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0,
                                           DType::kQ4_0, DType::kQ4_K, DType::kQ6_K, DType::kQ8_K,
                                           DType::kMXFP4),
                         [](const auto& info) {
                           return std::string(kernels::Traits(info.param).name);
                         });

TEST(GgufWriter, RejectsBadTensors) {
  GgufWriter w;
  const auto b = RandomBytes(128, 1);
  EXPECT_TRUE(w.AddTensor("t", {32}, DType::kF32, b).ok());
  EXPECT_EQ(w.AddTensor("t", {32}, DType::kF32, b).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.AddTensor("", {32}, DType::kF32, b).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.AddTensor(std::string(64, 'x'), {32}, DType::kF32, b).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(w.AddTensor(std::string(63, 'x'), {32}, DType::kF32, b).ok());
  EXPECT_EQ(w.AddTensor("u", {}, DType::kF32, b).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.AddTensor("u", {1, 1, 1, 1, 32}, DType::kF32, b).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.AddTensor("u", {-32}, DType::kF32, b).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.AddTensor("u", {32, 0}, DType::kF32, {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.AddTensor("u", {31}, DType::kF32, b).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.AddTensor("u", {48}, DType::kQ8_0, b).code(),
            absl::StatusCode::kInvalidArgument);  // not a multiple of 32
  EXPECT_EQ(w.AddTensorFromSource("u", {32}, DType::kF32, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.num_tensors(), 2u);
  EXPECT_EQ(w.WriteToBuffer(48).status().code(), absl::StatusCode::kInvalidArgument);
  w.SetU32("general.alignment", 64);
  EXPECT_EQ(w.WriteToBuffer(32).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(w.WriteToBuffer(64).ok());
}

TEST(GgufWriter, SourceErrorAbortsWriteAndLeavesNoFile) {
  const std::string dir = ::testing::TempDir() + "/gguf_src_err";
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/out.gguf";
  std::filesystem::remove(path);
  GgufWriter w;
  ASSERT_TRUE(
      w.AddTensorFromSource("t", {32, 4}, DType::kF32, [](int64_t, int64_t, std::span<uint8_t>) {
         return absl::DataLossError("boom");
       }).ok());
  EXPECT_EQ(w.Write(path).code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(std::filesystem::is_empty(dir));  // the temp file was removed too
}

TEST(GgufFileIo, WriteThenOpenMapsTheFile) {
  const std::string path = ::testing::TempDir() + "/gguf_io_test.gguf";
  const std::vector<uint8_t> bytes = SmallValidFile();
  GgufWriter w;
  {
    auto f = Parse(bytes);
    ASSERT_TRUE(f.ok());
    for (const KeyValue& kv : (*f)->metadata()) w.CopyValue(std::string(kv.key), kv.value);
    for (const TensorInfo& t : (*f)->tensors()) {
      ASSERT_TRUE(w.AddTensor(std::string(t.name), t.dims, t.type, {t.data, t.nbytes}).ok());
    }
  }
  ASSERT_TRUE(w.Write(path).ok());
  std::ifstream in(path, std::ios::binary);
  std::vector<uint8_t> disk((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(disk, bytes);
  EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::others_read,
            std::filesystem::perms::others_read);
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->path(), path);
  EXPECT_EQ(*(*f)->GetString("general.architecture"), "llama");
  const TensorInfo* t = (*f)->FindTensor("b.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->type, DType::kQ8_0);
  EXPECT_EQ(0, std::memcmp(t->data, RandomBytes(68, 2).data(), 68));
  std::filesystem::remove(path);
}

TEST(GgufFileIo, OsErrors) {
  auto missing = GgufFile::Open("/nonexistent/dir/model.gguf");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(missing.status()), HasSubstr("/nonexistent/dir/model.gguf"));
  EXPECT_EQ(GgufFile::Open(::testing::TempDir()).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string empty = ::testing::TempDir() + "/gguf_empty.gguf";
  std::ofstream(empty).close();
  EXPECT_EQ(GgufFile::Open(empty).status().code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove(empty);
  GgufWriter w;
  EXPECT_EQ(w.Write("/nonexistent/dir/out.gguf").code(), absl::StatusCode::kNotFound);
}

TEST(GgufHostile, EveryTruncationIsAnError) {
  const std::vector<uint8_t> full = SmallValidFile();
  auto f = Parse(full);
  ASSERT_TRUE(f.ok());
  // The shortest valid prefix ends with the last tensor's data (trailing padding is optional).
  size_t needed = 0;
  for (const TensorInfo& t : (*f)->tensors()) {
    needed = std::max<size_t>(needed, (t.data - full.data()) + t.nbytes);
  }
  ASSERT_GT(needed, 400u);
  for (size_t n = 0; n < full.size(); ++n) {
    std::vector<uint8_t> cut(full.begin(), full.begin() + n);
    auto r = Parse(cut);
    if (n < needed) {
      ASSERT_FALSE(r.ok()) << "prefix of " << n << " bytes parsed";
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << n;
      EXPECT_THAT(Msg(r.status()),
                  ::testing::AnyOf(HasSubstr("at byte"), HasSubstr("outside the file")))
          << n;
    } else {
      EXPECT_TRUE(r.ok()) << n << ": " << r.status();
    }
  }
}

// Every accepted file must only point inside its buffer.
void CheckInvariants(const GgufFile& g, const std::vector<uint8_t>& buf) {
  for (const TensorInfo& t : g.tensors()) {
    ASSERT_GE(t.data, buf.data());
    ASSERT_LE(t.data + t.nbytes, buf.data() + buf.size());
    ASSERT_EQ(t.nbytes, kernels::RowBytes(t.type, t.dims[0]) * t.Rows());
  }
  for (const KeyValue& kv : g.metadata()) {
    ASSERT_GE(reinterpret_cast<const uint8_t*>(kv.key.data()), buf.data());
    ASSERT_LE(reinterpret_cast<const uint8_t*>(kv.key.data()) + kv.key.size(),
              buf.data() + buf.size());
  }
}

TEST(GgufHostile, RandomByteFlipsNeverCrash) {
  const std::vector<uint8_t> full = SmallValidFile();
  std::mt19937_64 rng(12345);
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 100000; ++iter) {
    std::vector<uint8_t> buf = full;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      // Bias toward the header and metadata, where the structure lives.
      const size_t limit = (rng() % 4 == 0) ? buf.size() : std::min<size_t>(buf.size(), 400);
      const size_t at = rng() % limit;
      switch (rng() % 3) {
        case 0:
          buf[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
          break;
        case 1:
          buf[at] = static_cast<uint8_t>(rng());
          break;
        default:
          buf[at] = 0xff;
          break;
      }
    }
    auto r = Parse(buf);
    if (r.ok()) {
      ++accepted;
      CheckInvariants(**r, buf);
    } else {
      ++rejected;
      EXPECT_FALSE(Msg(r.status()).empty());
    }
  }
  // Both outcomes occur (flips in tensor data or string bytes are harmless).
  EXPECT_GT(accepted, 100);
  EXPECT_GT(rejected, 100);
}

TEST(GgufHostile, BadMagicAndVersions) {
  std::vector<uint8_t> b = SmallValidFile();
  b[0] = 'X';
  auto r = Parse(b);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(r.status()), HasSubstr("magic"));

  EXPECT_THAT(Msg(Parse(Raw().Header(0, 0, 1).b).status()), HasSubstr("v1"));
  EXPECT_FALSE(Parse(Raw().Header(0, 0, 4).b).ok());
  EXPECT_FALSE(Parse(Raw().Header(0, 0, 0x03000000).b).ok());  // byte-swapped
  auto v2 = Parse(Raw().Header(0, 1, 2).KvU32("k", 5).b);
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_EQ((*v2)->version(), 2u);
  EXPECT_TRUE(Parse(Raw().Header(0, 0).b).ok());
}

TEST(GgufHostile, AbsurdCountsAndLengths) {
  auto expect_invalid = [](const std::vector<uint8_t>& b, std::string_view what) {
    auto r = Parse(b);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(Msg(r.status()), HasSubstr("at byte")) << what << ": " << r.status();
  };
  expect_invalid(Raw().Header(0, 1ull << 62).b, "kv count");
  expect_invalid(Raw().Header(~0ull, 0).b, "tensor count");
  expect_invalid(Raw().Header(0, 1).Put<uint64_t>(~0ull).b, "key length");
  expect_invalid(Raw().Header(0, 1).Str("").Put<uint32_t>(4).Put<uint32_t>(1).b, "empty key");
  expect_invalid(Raw().Header(0, 1).Str("k").Put<uint32_t>(8).Put<uint64_t>(1ull << 60).b,
                 "string value length");
  expect_invalid(Raw().Header(0, 1).Str("k").Put<uint32_t>(13).Put<uint32_t>(0).b, "value type");
  expect_invalid(Raw().Header(0, 1).Str("k").Put<uint32_t>(7).Put<uint8_t>(2).b, "bool 2");
  expect_invalid(
      Raw().Header(0, 1).Str("k").Put<uint32_t>(9).Put<uint32_t>(8).Put<uint64_t>(~0ull).b,
      "string array count");
  expect_invalid(Raw()
                     .Header(0, 1)
                     .Str("k")
                     .Put<uint32_t>(9)
                     .Put<uint32_t>(10)
                     .Put<uint64_t>(1ull << 61)
                     .Zeros(64)
                     .b,
                 "u64 array count");
  expect_invalid(Raw().Header(0, 1).Str("k").Put<uint32_t>(9).Put<uint32_t>(9).b, "nested array");
  expect_invalid(Raw().Header(0, 1).Str("k").Put<uint32_t>(9).Put<uint32_t>(77).b,
                 "array elem type");
  expect_invalid(Raw().Header(0, 2).KvU32("k", 1).KvU32("k", 2).b, "duplicate key");
  expect_invalid(Raw().Header(1, 0).TensorInfo("t", {1, 2, 3, 4, 5}, 0, 0).PadTo(32).Zeros(480).b,
                 "5 dims");
  expect_invalid(Raw().Header(1, 0).TensorInfo("t", {}, 0, 0).PadTo(32).Zeros(32).b, "0 dims");
  expect_invalid(Raw().Header(1, 0).TensorInfo("t", {1ull << 40, 1ull << 40}, 0, 0).Zeros(64).b,
                 "element overflow");
  expect_invalid(Raw().Header(1, 0).TensorInfo("t", {1ull << 63}, 0, 0).Zeros(64).b, "dim > int64");
  expect_invalid(Raw().Header(1, 0).TensorInfo("t", {8, 0}, 0, 0).PadTo(32).Zeros(64).b,
                 "zero dim");
  expect_invalid(Raw().Header(1, 0).TensorInfo("t", {33}, 2, 0).PadTo(32).Zeros(64).b,
                 "q4_0 row length 33");
  expect_invalid(Raw()
                     .Header(2, 0)
                     .TensorInfo("t", {8}, 0, 0)
                     .TensorInfo("t", {8}, 0, 32)
                     .PadTo(32)
                     .Zeros(64)
                     .b,
                 "duplicate tensor");
  expect_invalid(Raw().Header(1, 0).TensorInfo("", {8}, 0, 0).PadTo(32).Zeros(32).b,
                 "empty tensor name");
}

TEST(GgufHostile, UnknownTensorTypeIsUnimplemented) {
  auto r = Parse(Raw().Header(1, 0).TensorInfo("blk.0.odd", {32}, 6, 0).PadTo(32).Zeros(64).b);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(Msg(r.status()), HasSubstr("blk.0.odd"));
  EXPECT_THAT(Msg(r.status()), HasSubstr("type id 6"));
  r = Parse(Raw().Header(1, 0).TensorInfo("x", {32}, 0xdeadbeef, 0).PadTo(32).Zeros(64).b);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(Msg(r.status()), HasSubstr(std::to_string(0xdeadbeefu)));
}

TEST(GgufHostile, TensorDataPlacement) {
  auto status_of = [](const std::vector<uint8_t>& b) { return Parse(b).status(); };
  // Valid baseline: two f32 tensors of 8 elements at 0 and 32.
  auto base = [](uint64_t off_a, uint64_t off_b, size_t data = 64) {
    return Raw()
        .Header(2, 0)
        .TensorInfo("a", {8}, 0, off_a)
        .TensorInfo("b", {8}, 0, off_b)
        .PadTo(32)
        .Zeros(data)
        .b;
  };
  EXPECT_TRUE(status_of(base(0, 32)).ok());
  EXPECT_TRUE(status_of(base(32, 0)).ok());  // order in the table need not follow the data
  EXPECT_THAT(Msg(status_of(base(0, 16))), HasSubstr("not a multiple of the alignment"));
  EXPECT_THAT(Msg(status_of(base(0, 0))), HasSubstr("overlaps"));
  EXPECT_THAT(Msg(status_of(base(0, 64))), HasSubstr("outside the file"));
  EXPECT_THAT(Msg(status_of(base(0, 32, 63))), HasSubstr("outside the file"));
  EXPECT_THAT(Msg(status_of(base(0, ~0ull << 5))), HasSubstr("outside the file"));
  // A big tensor that covers two later ones.
  auto r = Parse(Raw()
                     .Header(3, 0)
                     .TensorInfo("big", {32}, 0, 0)
                     .TensorInfo("mid", {8}, 0, 64)
                     .TensorInfo("late", {8}, 0, 96)
                     .PadTo(32)
                     .Zeros(128)
                     .b);
  EXPECT_THAT(Msg(r.status()), HasSubstr("overlaps"));
  // The file ends before the aligned start of the data section.
  EXPECT_THAT(Msg(Parse(Raw().Header(1, 0).TensorInfo("a", {8}, 0, 0).b).status()),
              HasSubstr("past the end"));
}

TEST(GgufHostile, AlignmentKey) {
  auto with_alignment = [](uint32_t a) {
    Raw r;
    r.Header(1, 1).KvU32("general.alignment", a).TensorInfo("a", {8}, 0, 0).Zeros(300);
    return r.b;
  };
  EXPECT_TRUE(Parse(with_alignment(64)).ok());
  EXPECT_EQ((*Parse(with_alignment(64)))->alignment(), 64u);
  EXPECT_THAT(Msg(Parse(with_alignment(48)).status()), HasSubstr("power of two"));
  EXPECT_THAT(Msg(Parse(with_alignment(0)).status()), HasSubstr("power of two"));
  EXPECT_THAT(Msg(Parse(with_alignment(1u << 31)).status()), HasSubstr("past the end"));
  Raw wrong;
  wrong.Header(0, 1).Str("general.alignment").Put<uint32_t>(10).Put<uint64_t>(32);
  EXPECT_THAT(Msg(Parse(wrong.b).status()), HasSubstr("must be u32"));
}

TEST(GgufRealModel, Stories260K) {
  const std::string path = std::string(TANDEM_SHARED_MODELS_DIR) + "/stories260K/stories260K.gguf";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is absent";
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(*g.GetString("general.architecture"), "llama");
  EXPECT_EQ(*g.GetUInt("llama.embedding_length"), 64u);
  EXPECT_EQ(*g.GetUInt("llama.block_count"), 5u);
  EXPECT_EQ(*g.GetUInt("llama.feed_forward_length"), 172u);
  EXPECT_EQ(*g.GetUInt("llama.attention.head_count"), 8u);
  EXPECT_EQ(*g.GetUInt("llama.attention.head_count_kv"), 4u);
  EXPECT_NEAR(*g.GetFloat("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-9);
  EXPECT_EQ(*g.GetString("tokenizer.ggml.model"), "llama");
  auto tokens = g.GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok());
  ASSERT_EQ(tokens->size(), 512u);
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ((*tokens)[3], "<0x00>");
  EXPECT_EQ(g.GetF32Array("tokenizer.ggml.scores")->size(), 512u);
  EXPECT_EQ(*g.GetUInt("tokenizer.ggml.bos_token_id"), 1u);
  EXPECT_EQ(g.tensors().size(), 48u);
  const TensorInfo* emb = g.FindTensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->type, DType::kF32);
  EXPECT_EQ(emb->dims, (std::vector<int64_t>{64, 512}));
  const TensorInfo* down = g.FindTensor("blk.4.ffn_down.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->dims, (std::vector<int64_t>{172, 64}));
  // Trained RMSNorm weights are finite and not all equal.
  const TensorInfo* norm = g.FindTensor("output_norm.weight");
  ASSERT_NE(norm, nullptr);
  std::vector<float> w(64);
  std::memcpy(w.data(), norm->data, 256);
  float lo = w[0], hi = w[0];
  for (float x : w) {
    ASSERT_TRUE(std::isfinite(x));
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  EXPECT_LT(lo, hi);
}

}  // namespace
}  // namespace tandem::gguf
