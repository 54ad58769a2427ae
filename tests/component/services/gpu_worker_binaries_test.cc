// The worker binaries of this build with --device cuda, on a machine without a GPU (every CI
// machine): they must refuse at start with FAILED_PRECONDITION saying there is no CUDA device
// (a CUDA build, which links the CUDA engine) or that the build has no CUDA, and the CUDA-linked
// binaries must still serve /metrics (cuBLASLt is loaded at first GEMM use, never at start,
// because a process with libcublasLt loaded cannot start civetweb; kernels/cuda/gemm.cu).
// With a GPU present the refusal cases skip: the gpu-check run covers those binaries.
#include <signal.h>
#include <unistd.h>

#include <filesystem>

#include "gtest/gtest.h"
#include "tests/fakes/child_process.h"
#include "tests/fakes/tiny_model.h"
#include "tests/unit/services/metrics_scrape.h"

#if defined(TANDEM_HAVE_CUDA)
#include "tandem/cuda/cuda_common.h"
#endif

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;

bool HaveGpu() {
#if defined(TANDEM_HAVE_CUDA)
  return kernels::cuda::VisibleDeviceCount() > 0;
#else
  return false;
#endif
}

// What a refusal must say in this build.
std::string ExpectedReason() {
#if defined(TANDEM_HAVE_CUDA)
  return "no CUDA device";
#else
  return "built without CUDA";
#endif
}

class GpuWorkerBinariesTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tandem-gpu-bin-" + std::to_string(getpid()) + "-" +
                                        std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(dir_);
    model_path_ = (dir_ / "tiny.gguf").string();
    ASSERT_TRUE(WriteTinyModel(TinyModelOptions(), model_path_).ok());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
  std::string model_path_;
};

TEST_P(GpuWorkerBinariesTest, DeviceCudaWithoutGpuFailsAtStartWithFailedPrecondition) {
  if (HaveGpu()) GTEST_SKIP() << "a CUDA device is present";
  for (const std::string transport : {"ucx", "cuda_ipc", "nccl"}) {
    ChildProcess c(GetParam(),
                   {"--model", model_path_, "--port", "0", "--port-file", Path("w.port"),
                    "--device", "cuda", "--transport", transport, "--threads", "1"},
                   Path("w.log"));
    EXPECT_EQ(c.Wait(absl::Seconds(20)), 1) << c.Log();
    const std::string log = c.Log();
    EXPECT_NE(log.find(GetParam() + ": --device cuda: FAILED_PRECONDITION"), std::string::npos)
        << log;
    EXPECT_NE(log.find(ExpectedReason()), std::string::npos) << log;
    EXPECT_FALSE(fs::exists(Path("w.port"))) << "it must not start serving";
  }
}

// NCCL moves device memory only: a host pool is refused at start, GPU or not.
TEST_P(GpuWorkerBinariesTest, NcclWithAHostPoolFailsAtStartWithFailedPrecondition) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  ChildProcess c(GetParam(),
                 {"--model", model_path_, "--port", std::to_string(port), "--port-file",
                  Path("w.port"), "--device", "cpu", "--transport", "nccl", "--threads", "1"},
                 Path("w.log"));
  EXPECT_EQ(c.Wait(absl::Seconds(20)), 1) << c.Log();
  const std::string log = c.Log();
  EXPECT_NE(log.find(GetParam() + ": --transport: FAILED_PRECONDITION"), std::string::npos)
      << log;
  EXPECT_NE(log.find("needs --device cuda"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(Path("w.port"))) << "it must not start serving";
}

TEST_P(GpuWorkerBinariesTest, ServesMetricsOnTheCpu) {
  const int mport = FreePort();
  ASSERT_GT(mport, 0);
  std::vector<std::string> args = {
      "--model",        model_path_,
      "--port",         "0",
      "--port-file",    Path("w.port"),
      "--threads",      "1",
      "--ctx-size",     "256",
      "--max-seqs",     "2",
      "--metrics-port", std::to_string(mport),
      "--grace-ms",     "2000",
      "--transport",    GetParam() == "tandem-decode" ? "none" : "inproc"};
  ChildProcess c(GetParam(), args, Path("w.log"));
  ASSERT_GT(WaitForPortFile(Path("w.port"), &c), 0) << c.Log();
  HttpReply r = HttpGet(mport, "/metrics");
  EXPECT_EQ(r.status, 200) << c.Log();
  EXPECT_NE(r.body.find("num_requests_running"), std::string::npos) << r.body;
  EXPECT_EQ(c.Stop(absl::Seconds(20)), 0) << c.Log();
}

INSTANTIATE_TEST_SUITE_P(Workers, GpuWorkerBinariesTest,
                         ::testing::Values("tandem-decode", "tandem-prefill"),
                         [](const auto& info) {
                           return info.param == "tandem-decode" ? "decode" : "prefill";
                         });

}  // namespace
}  // namespace tandem::testing
