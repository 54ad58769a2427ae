// Informal matmul throughput: GB/s of weights streamed for a rows x cols matrix at a given
// batch, per weight type and thread count. Usage: matmul_bench [rows cols batch iters].
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/util/thread_pool.h"
#include "tandem/kernels/cpu_features.h"
#include "tandem/kernels/matmul.h"
#include "tandem/kernels/quant.h"

using namespace tandem;
using namespace tandem::kernels;

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 2048;
  const int64_t cols = argc > 2 ? std::atoll(argv[2]) : 8192;
  const int64_t batch = argc > 3 ? std::atoll(argv[3]) : 1;
  const int iters = argc > 4 ? std::atoi(argv[4]) : 50;
  std::printf("isa %s, %lld x %lld, batch %lld\n", IsaName(ActiveIsa()), (long long)rows,
              (long long)cols, (long long)batch);
  std::mt19937 rng(1);
  std::normal_distribution<float> dist;
  std::vector<float> row(cols), x(batch * cols), out(batch * rows);
  for (auto& v : x) v = dist(rng);
  for (DType t : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ6_K, DType::kMXFP4,
                  DType::kF16, DType::kBF16, DType::kF32}) {
    const size_t rb = RowBytes(t, cols);
    std::vector<uint8_t> w(rb * rows);
    for (int64_t r = 0; r < rows; ++r) {
      for (auto& v : row) v = dist(rng);
      (void)QuantizeRow(t, row.data(), &w[r * rb], cols);
    }
    MatmulParams p;
    p.weight_type = t;
    p.weight = w.data();
    p.rows = rows;
    p.cols = cols;
    p.input = x.data();
    p.batch = batch;
    p.output = out.data();
    for (int threads : {1, 2}) {
      util::ThreadPool pool(threads);
      for (int i = 0; i < 3; ++i) Matmul(p, &pool);
      double best = 1e9;
      for (int i = 0; i < iters; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        Matmul(p, &pool);
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, s);
      }
      std::printf("%-6s threads %d: %8.3f ms  %6.1f GB/s  %7.1f GMAC/s\n", Traits(t).name.data(),
                  threads, best * 1e3, w.size() / best / 1e9,
                  double(rows) * cols * batch / best / 1e9);
    }
  }
  return 0;
}
