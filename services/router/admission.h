// Admission: bounds how many requests the router works on at once and how many may wait.
//
// Up to max_inflight requests hold a slot; up to max_queue more wait for one. A freed slot goes
// to the waiter of the highest priority class (interactive, then standard, then batch), first
// come first served within a class. When the queue is full, a request displaces the newest
// waiter of a lower class (which ends RESOURCE_EXHAUSTED, so batch traffic absorbs the
// overload); with none to displace it is refused at once with RESOURCE_EXHAUSTED, so overload
// turns into fast, explicit back-pressure instead of unbounded latency. A waiter gives up at its
// deadline (DEADLINE_EXCEEDED) or when its caller is cancelled (CANCELLED).
//
// A gate (SetGate) can hold the queue further: the first waiter gets a free slot only while the
// gate is open. The gate is asked with the number of admitted requests not yet on a worker
// (admitted and not yet Arrived()), counted here under the same lock, so two waiters never both
// pass on one opening. The router opens it while the workers' predicted prefill backlog is
// short (services/router/slo.h), so requests wait here, most urgent first, rather than in a
// worker's FIFO queue where an interactive request would wait behind batch ones. Kick() makes
// waiters look at the gate again.
//
// Waiting takes no thread: AcquireAsync queues a callback, which a released slot, Kick(),
// Arrived() or the admission's own timer thread (deadlines, give-up times, cancelled callers and
// a gate that opens unannounced, checked every few ms while anyone waits) calls with the result.
// Acquire() is the blocking form.
//
// Threading: thread-safe. A Slot is released by its destructor on any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tandem::router {

class Admission;

// Request classes, most urgent first (tandem.v1.Priority without UNSPECIFIED).
enum class Priority { kInteractive = 0, kStandard = 1, kBatch = 2 };
const char* PriorityName(Priority p);

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
  ~Admission();  // waiters still queued end CANCELLED
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  struct Request {
    absl::Time deadline = absl::InfiniteFuture();
    // Polled under the admission lock while the request waits (it may be empty): cheap, and
    // must not call into this object.
    std::function<bool()> cancelled;
    Priority priority = Priority::kStandard;
    int64_t tokens = 0;  // the request's prompt length, for tokens_ahead()
    // The last moment the request could start and still meet its TTFT target: still waiting
    // then, it leaves with RESOURCE_EXHAUSTED rather than be served late.
    absl::Time give_up = absl::InfiniteFuture();
  };
  using Done = std::function<void(absl::StatusOr<Slot>)>;

  // Returns the outcome when it is known at once (a free slot, or a refusal), and then never
  // calls `done`. Otherwise the request waits, and `done` is called exactly once with the slot
  // or the failure, later, on another call's thread or the timer thread, with no lock of this
  // object held. `done` must be cheap (it runs inside whichever call freed the slot).
  std::optional<absl::StatusOr<Slot>> AcquireAsync(Request r, Done done);

  // AcquireAsync, waiting on the calling thread.
  absl::StatusOr<Slot> Acquire(absl::Time deadline, const std::function<bool()>& cancelled,
                               Priority priority = Priority::kStandard, int64_t tokens = 0,
                               absl::Time give_up = absl::InfiniteFuture());

  // `open` is called under the admission lock, often: it must be cheap and must not call back
  // into this object. Set it before the first Acquire.
  void SetGate(std::function<bool(int in_transit)> open);
  void Kick();
  // An admitted request reached its worker (or ended): it no longer counts as in transit.
  // Once per successful Acquire.
  void Arrived();

  int running() const;
  int waiting() const;
  // Waiting requests of `priority` and more urgent classes: those a new request of that class
  // would wait behind.
  int waiting_ahead(Priority priority) const;
  // Their prompt tokens.
  int64_t tokens_ahead(Priority priority) const;
  uint64_t rejected() const;   // refused at arrival and displaced
  uint64_t displaced() const;  // of those, waiters pushed out by a more urgent arrival
  uint64_t gave_up() const;    // waiters that reached their give-up time

 private:
  friend class Slot;
  struct Waiter {
    int cls = 0;
    Request r;
    Done done;
  };
  // A finished wait: the callback and what it is given, called once the lock is dropped.
  using Outcome = std::pair<Done, absl::StatusOr<Slot>>;
  void Release();
  std::optional<absl::StatusOr<Slot>> Enqueue(Request r, Done done, std::vector<Outcome>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the waits that have failed (deadline, give-up time, cancelled caller) and hands free
  // slots to the queue's head while the gate allows.
  void Settle(std::vector<Outcome>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CanStart() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void Deliver(std::vector<Outcome>& out);
  void TimerLoop();

  const int max_inflight_;
  const int max_queue_;
  mutable absl::Mutex mu_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;  // handed to each waiter in arrival order
  std::function<bool(int)> gate_ ABSL_GUARDED_BY(mu_);
  int in_transit_ ABSL_GUARDED_BY(mu_) = 0;
  // Waiters in the order they are served: (class, ticket), and each one's request.
  std::set<std::pair<int, uint64_t>> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t rejected_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t displaced_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t gave_up_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread timer_;  // last: started once the rest is built
};

}  // namespace tandem::router
