// Helpers shared by the kvstore tests: random payloads and a scratch directory per test.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "services/kvstore/ssd_tier.h"

namespace tandem::kvstore::testing {

inline std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Inverts one payload byte of an SSD tier block file in place (the corruption the tier's
// checksums must catch).
inline ::testing::AssertionResult FlipPayloadByte(const std::string& path, off_t payload_offset) {
  const int fd = open(path.c_str(), O_RDWR);
  if (fd < 0) return ::testing::AssertionFailure() << "cannot open " << path;
  const off_t off = static_cast<off_t>(SsdTier::kHeaderBytes) + payload_offset;
  uint8_t b = 0;
  const bool ok = pread(fd, &b, 1, off) == 1 && (b = static_cast<uint8_t>(~b), true) &&
                  pwrite(fd, &b, 1, off) == 1;
  close(fd);
  if (!ok) return ::testing::AssertionFailure() << "cannot rewrite byte " << off << " of " << path;
  return ::testing::AssertionSuccess();
}

// A fresh directory removed when the object goes away.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string leaf = std::string("tandem-kvstore-") + std::to_string(getpid()) + "-" +
                       info->test_suite_name() + "-" + info->name();
    for (char& c : leaf) {
      if (c == '/') c = '_';  // parameterised test names
    }
    path_ = (std::filesystem::temp_directory_path() / leaf).string();
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace tandem::kvstore::testing
