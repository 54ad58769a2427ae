// Worker process plumbing: CPU lists, the atomic port file, advertised addresses.
#include "services/common/process_util.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "services/common/grpc_server.h"

namespace tandem::services {
namespace {

TEST(ProcessUtilTest, ParsesCpuLists) {
  EXPECT_EQ(*ParseCpuList("0"), (std::vector<int>{0}));
  EXPECT_EQ(*ParseCpuList("0-3,6,8-9"), (std::vector<int>{0, 1, 2, 3, 6, 8, 9}));
  for (const char* bad : {"", "a", "3-1", "1-2-3", "-1", "1,,2", "0-99999"}) {
    EXPECT_EQ(ParseCpuList(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ProcessUtilTest, PinsToAnAllowedCpu) {
  cpu_set_t before;
  ASSERT_EQ(sched_getaffinity(0, sizeof(before), &before), 0);
  int first = -1;
  for (int c = 0; c < CPU_SETSIZE && first < 0; ++c) {
    if (CPU_ISSET(c, &before)) first = c;
  }
  ASSERT_GE(first, 0);
  // On a thread of its own, so the test process keeps its affinity.
  std::thread([&] {
    ASSERT_TRUE(PinToCpus({first}).ok());
    cpu_set_t now;
    ASSERT_EQ(sched_getaffinity(0, sizeof(now), &now), 0);
    EXPECT_EQ(CPU_COUNT(&now), 1);
    EXPECT_TRUE(CPU_ISSET(first, &now));
  }).join();
}

TEST(ProcessUtilTest, WritesFilesAtomically) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("tandem-port-" + std::to_string(getpid())))
          .string();
  ASSERT_TRUE(WriteFileAtomically(path, "1234\n").ok());
  ASSERT_TRUE(WriteFileAtomically(path, "5678\n").ok());
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_EQ(ss.str(), "5678\n");
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  std::filesystem::remove(path);
  EXPECT_FALSE(WriteFileAtomically("/nonexistent-dir/x", "1").ok());
}

TEST(ProcessUtilTest, AdvertisesDialableAddresses) {
  EXPECT_EQ(AdvertisedHost("0.0.0.0"), "127.0.0.1");
  EXPECT_EQ(AdvertisedHost("::"), "127.0.0.1");
  EXPECT_EQ(AdvertisedHost("10.1.2.3"), "10.1.2.3");
  EXPECT_EQ(JoinHostPort("::1", 80), "[::1]:80");
  EXPECT_EQ(JoinHostPort("[::1]", 80), "[::1]:80");
  EXPECT_EQ(JoinHostPort("localhost", 9), "localhost:9");
  EXPECT_NE(DefaultWorkerId("decode").find("decode-"), std::string::npos);
}

}  // namespace
}  // namespace tandem::services
