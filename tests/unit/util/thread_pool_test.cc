// ThreadPool: every index is visited exactly once, back-to-back jobs (the spinning fast path)
// and jobs after the workers have gone to sleep (the futex path) both complete, and an idle pool
// shuts down promptly.
#include "common/util/thread_pool.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::util {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

TEST(ThreadPoolTest, ParallelForVisitsEveryIndexOnceForAnyShape) {
  for (int threads : {1, 2, 3, 5}) {
    for (auto spin : {microseconds(0), microseconds(50)}) {
      ThreadPool pool(threads, spin);
      EXPECT_EQ(pool.num_threads(), threads);
      for (int64_t n : {0, 1, 2, 7, 64, 1001}) {
        for (int64_t grain : {1, 3, 100}) {
          std::vector<std::atomic<int>> hits(n);
          std::atomic<int> max_thread{-1};
          pool.ParallelFor(n, [&](int64_t b, int64_t e, int t) {
            ASSERT_LE(0, b);
            ASSERT_LE(b, e);
            ASSERT_LE(e, n);
            // A chunk shorter than the grain only at the end.
            if (e < n) ASSERT_GE(e - b, grain);
            for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
            int m = max_thread.load();
            while (t > m && !max_thread.compare_exchange_weak(m, t)) {
            }
          }, grain);
          for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "i=" << i << " n=" << n;
          EXPECT_LT(max_thread.load(), threads);
        }
      }
    }
  }
}

TEST(ThreadPoolTest, BackToBackJobsAndJobsAfterSleepBothComplete) {
  for (auto spin : {microseconds(0), microseconds(200)}) {
    ThreadPool pool(3, spin);
    std::atomic<int64_t> sum{0};
    // Back to back: the workers are still spinning when the next job comes.
    for (int i = 0; i < 20000; ++i) pool.RunOnAll([&](int t) { sum.fetch_add(t + 1); });
    EXPECT_EQ(sum.load(), 20000 * (1 + 2 + 3));
    // After a pause well past the spin, the workers sleep in the futex and must be woken.
    for (int i = 0; i < 5; ++i) {
      std::this_thread::sleep_for(milliseconds(5));
      std::vector<int> seen(3, 0);
      pool.RunOnAll([&](int t) { seen[t]++; });
      EXPECT_EQ(seen, (std::vector<int>{1, 1, 1}));
    }
  }
}

TEST(ThreadPoolTest, JobResultsAreVisibleToTheCaller) {
  // Plain (non-atomic) writes by workers must be visible once RunOnAll returns.
  ThreadPool pool(2);
  std::vector<int64_t> out(2);
  for (int64_t i = 0; i < 5000; ++i) {
    pool.RunOnAll([&](int t) { out[t] = i * 10 + t; });
    ASSERT_EQ(out[0], i * 10);
    ASSERT_EQ(out[1], i * 10 + 1);
  }
}

TEST(ThreadPoolTest, IdlePoolShutsDownPromptly) {
  const auto t0 = std::chrono::steady_clock::now();
  {
    ThreadPool pool(4);
    pool.RunOnAll([](int) {});
    std::this_thread::sleep_for(milliseconds(2));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(500));
}

}  // namespace
}  // namespace tandem::util
