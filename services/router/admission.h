// Admission: bounds how many requests the router works on at once and how many may wait.
//
// Up to max_inflight requests hold a slot; up to max_queue more wait for one, first come first
// served; anything beyond is refused at once with RESOURCE_EXHAUSTED, so overload turns into
// fast, explicit back-pressure instead of unbounded latency. A waiter gives up at its deadline
// (DEADLINE_EXCEEDED) or when its caller is cancelled (CANCELLED).
//
// Threading: thread-safe. A Slot is released by its destructor on any thread.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tandem::router {

class Admission;

class Slot {
 public:
  Slot() = default;
  Slot(Slot&& o) noexcept : owner_(o.owner_) { o.owner_ = nullptr; }
  Slot& operator=(Slot&&) = delete;
  ~Slot();

 private:
  friend class Admission;
  explicit Slot(Admission* owner) : owner_(owner) {}
  Admission* owner_ = nullptr;
};

class Admission {
 public:
  // max_inflight >= 1, max_queue >= 0 (checked by the caller's options validation).
  Admission(int max_inflight, int max_queue);

  // Waits for a slot. `cancelled` is polled while waiting (it may be empty).
  absl::StatusOr<Slot> Acquire(absl::Time deadline, const std::function<bool()>& cancelled);

  int running() const;
  int waiting() const;
  uint64_t rejected() const;

 private:
  friend class Slot;
  void Release();

  const int max_inflight_;
  const int max_queue_;
  mutable absl::Mutex mu_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;  // handed to each waiter in arrival order
  uint64_t serving_ ABSL_GUARDED_BY(mu_) = 0;      // lowest ticket still waiting
  uint64_t rejected_ ABSL_GUARDED_BY(mu_) = 0;
  // Tickets of waiters that gave up, so serving_ can skip them.
  std::vector<uint64_t> abandoned_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router
