#include "common/util/thread_pool.h"

#include <algorithm>

namespace tandem::util {

ThreadPool::ThreadPool(int num_threads) : num_threads_(std::max(1, num_threads)) {
  workers_.reserve(num_threads_ - 1);
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    (*job)(index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::RunOnAll(const std::function<void(int)>& fn) {
  if (num_threads_ == 1) {
    fn(0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    pending_ = num_threads_ - 1;
    ++generation_;
  }
  work_cv_.notify_all();
  fn(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
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
