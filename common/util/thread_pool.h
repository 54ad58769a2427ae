// A fixed pool of worker threads for data-parallel kernels.
//
// ParallelFor splits [0, n) into contiguous chunks, one per thread, runs them and returns when
// all are done; the calling thread takes a chunk itself. Workers sleep on a condition variable
// between jobs, so an idle pool costs no CPU (several services may share two cores). One
// ParallelFor at a time per pool: callers serialise (the engine owns its pool).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem::util {

class ThreadPool {
 public:
  // num_threads counts the caller: 1 means run everything inline.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // fn(begin, end, thread_index) over disjoint chunks covering [0, n). Chunks are at least
  // `grain` elements long, so small loops run on fewer threads.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                   int64_t grain = 1);

  // fn(thread_index) once on every thread; returns when all are done.
  void RunOnAll(const std::function<void(int)>& fn);

 private:
  void WorkerLoop(int index);

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int)>* job_ = nullptr;  // guarded by mu_
  uint64_t generation_ = 0;                         // guarded by mu_
  int pending_ = 0;                                 // guarded by mu_
  bool stop_ = false;                               // guarded by mu_
};

}  // namespace tandem::util
