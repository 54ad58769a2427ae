// A fixed pool of worker threads for data-parallel kernels.
//
// ParallelFor splits [0, n) into contiguous chunks, one per thread, runs them and returns when
// all are done; the calling thread takes a chunk itself. One ParallelFor at a time per pool:
// callers serialise (the engine owns its pool).
//
// Waiting: a decode step hands the pool about a hundred jobs a few microseconds apart, and a
// sleeping worker costs a futex wake-up per job. So after each job a worker (and the caller,
// waiting for the others) first spins for up to `spin` on an atomic, then sleeps in
// std::atomic::wait, a futex. Between steps and when idle the pool sleeps and costs no CPU,
// which matters when several services share two cores. Each waiter's spin budget adapts: it
// shrinks to a thirty-second of `spin` while spins keep timing out (an oversubscribed machine,
// where the awaited thread is not even running) and grows back while they succeed. spin = 0
// makes every wait sleep at once.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace tandem::util {

class ThreadPool {
 public:
  static constexpr std::chrono::microseconds kDefaultSpin{50};

  // num_threads counts the caller: 1 means run everything inline.
  explicit ThreadPool(int num_threads, std::chrono::nanoseconds spin = kDefaultSpin);
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
  const std::chrono::nanoseconds spin_;
  int64_t caller_budget_;  // the caller's current spin budget (ns); see SpinFor
  std::vector<std::thread> workers_;
  // The caller publishes job_ (and stop_) before bumping generation_ with release order;
  // workers read them after seeing the new generation with acquire order.
  const std::function<void(int)>* job_ = nullptr;
  bool stop_ = false;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};  // workers still running the current job
};

}  // namespace tandem::util
