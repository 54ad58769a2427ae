#include "common/util/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tandem::util {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Spins until pred() holds or *budget has passed; returns pred()'s last value. The budget
// adapts: it grows (up to `limit`) when spinning pays off and shrinks towards a floor when it
// does not, as happens when the machine is oversubscribed and the thread being waited for is
// not running; then the waits sleep almost at once instead of burning the slice it needs. The
// clock is read every 64 polls only.
template <typename Pred>
bool SpinFor(std::chrono::nanoseconds limit, int64_t* budget, Pred pred) {
  if (limit.count() <= 0) return pred();
  const int64_t floor = std::max<int64_t>(1, limit.count() / 32);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::nanoseconds(*budget);
  for (int i = 1;; ++i) {
    if (pred()) {
      *budget = std::min<int64_t>(limit.count(), *budget * 2);
      return true;
    }
    CpuRelax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() >= deadline) {
      const bool done = pred();
      *budget = std::max<int64_t>(floor, done ? *budget : *budget / 4);
      return done;
    }
  }
}

}  // namespace

ThreadPool::ThreadPool(int num_threads, std::chrono::nanoseconds spin)
    : num_threads_(std::max(1, num_threads)), spin_(spin), caller_budget_(spin.count()) {
  workers_.reserve(num_threads_ - 1);
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  stop_ = true;
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  int64_t budget = spin_.count();
  for (;;) {
    uint64_t g = seen;
    SpinFor(spin_, &budget, [&] { return (g = generation_.load(std::memory_order_acquire)) != seen; });
    while (g == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      g = generation_.load(std::memory_order_acquire);
    }
    seen = g;
    if (stop_) return;
    (*job_)(index);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
  }
}

void ThreadPool::RunOnAll(const std::function<void(int)>& fn) {
  if (num_threads_ == 1) {
    fn(0);
    return;
  }
  job_ = &fn;
  pending_.store(num_threads_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  fn(0);
  int left = 0;
  SpinFor(spin_, &caller_budget_, [&] { return (left = pending_.load(std::memory_order_acquire)) == 0; });
  while (left != 0) {
    pending_.wait(left, std::memory_order_acquire);
    left = pending_.load(std::memory_order_acquire);
  }
  job_ = nullptr;
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                             int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_chunks = (n + grain - 1) / grain;
  const int threads = static_cast<int>(std::min<int64_t>(num_threads_, max_chunks));
  if (threads <= 1) {
    fn(0, n, 0);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  RunOnAll([&](int t) {
    if (t >= threads) return;
    const int64_t begin = t * chunk;
    const int64_t end = std::min(n, begin + chunk);
    if (begin < end) fn(begin, end, t);
  });
}

}  // namespace tandem::util
