// Admission: in-flight and queue limits, FIFO hand-over within a priority class and the most
// urgent class first, displacement of less urgent waiters from a full queue, deadline and
// cancellation of waiters.
#include "services/router/admission.h"

#include <atomic>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace tandem::router {
namespace {

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

TEST(AdmissionTest, RefusesBeyondInflightPlusQueue) {
  Admission adm(/*max_inflight=*/2, /*max_queue=*/0);
  auto a = adm.Acquire(Soon(), nullptr);
  auto b = adm.Acquire(Soon(), nullptr);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(b.ok());
  auto c = adm.Acquire(Soon(), nullptr);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(adm.running(), 2);
  EXPECT_EQ(adm.rejected(), 1u);
  { Slot gone = std::move(*a); }
  EXPECT_EQ(adm.running(), 1);
  EXPECT_TRUE(adm.Acquire(Soon(), nullptr).ok());
}

TEST(AdmissionTest, WaitersAreServedInArrivalOrder) {
  Admission adm(1, 8);
  std::optional<Slot> first(*adm.Acquire(Soon(), nullptr));
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<std::thread> waiters;
  for (int i = 0; i < 4; ++i) {
    waiters.emplace_back([&, i] {
      auto s = adm.Acquire(Soon(), nullptr);
      ASSERT_TRUE(s.ok());
      absl::MutexLock lock(&mu);
      order.push_back(i);
    });
    // Make arrival order deterministic.
    while (adm.waiting() != i + 1) absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(adm.running(), 1);
  first.reset();
  for (auto& t : waiters) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(adm.running(), 0);
  EXPECT_EQ(adm.waiting(), 0);
}

TEST(AdmissionTest, WaiterPastItsGiveUpTimeLeavesExhaustedAndTheQueueMovesOn) {
  Admission adm(1, 4);
  std::optional<Slot> held(*adm.Acquire(Soon(), nullptr));
  const absl::Time t0 = absl::Now();
  auto late = adm.Acquire(Soon(), nullptr, Priority::kBatch, 100, t0 + absl::Milliseconds(80));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(late.status().message().find("target"), std::string::npos) << late.status();
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(75));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2)) << "left at its give-up time, not its deadline";
  EXPECT_EQ(adm.gave_up(), 1u);
  EXPECT_EQ(adm.waiting(), 0);
  EXPECT_EQ(adm.tokens_ahead(Priority::kBatch), 0);
  // A give-up time already past does not refuse a request that finds a free slot.
  held.reset();
  EXPECT_TRUE(adm.Acquire(Soon(), nullptr, Priority::kBatch, 1, t0).ok());
}

TEST(AdmissionTest, WaiterGivesUpAtDeadlineOrCancellationWithoutBlockingOthers) {
  Admission adm(1, 4);
  std::optional<Slot> held(*adm.Acquire(Soon(), nullptr));
  const absl::Time t0 = absl::Now();
  auto late = adm.Acquire(t0 + absl::Milliseconds(100), nullptr);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(95));
  std::atomic<bool> cancel{false};
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(50));
    cancel = true;
  });
  auto cancelled = adm.Acquire(Soon(), [&] { return cancel.load(); });
  canceller.join();
  EXPECT_EQ(cancelled.status().code(), absl::StatusCode::kCancelled);
  // The abandoned tickets must not block the next waiter.
  std::thread next([&] { EXPECT_TRUE(adm.Acquire(Soon(), nullptr).ok()); });
  while (adm.waiting() != 1) absl::SleepFor(absl::Milliseconds(1));
  held.reset();
  next.join();
  EXPECT_EQ(adm.waiting(), 0);
}

// Queues `priorities` in order behind a held slot, then frees it; returns the order in which
// they were served, by index.
std::vector<int> ServedOrder(Admission& adm, const std::vector<Priority>& priorities) {
  std::optional<Slot> held(*adm.Acquire(Soon(), nullptr));
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<std::thread> waiters;
  for (size_t i = 0; i < priorities.size(); ++i) {
    waiters.emplace_back([&, i] {
      auto s = adm.Acquire(Soon(), nullptr, priorities[i]);
      EXPECT_TRUE(s.ok()) << s.status();
      absl::MutexLock lock(&mu);
      order.push_back(static_cast<int>(i));
    });
    while (adm.waiting() != static_cast<int>(i) + 1) absl::SleepFor(absl::Milliseconds(1));
  }
  held.reset();
  for (auto& t : waiters) t.join();
  return order;
}

TEST(AdmissionTest, MoreUrgentClassesAreServedFirstAndFifoWithinAClass) {
  Admission adm(1, 8);
  using P = Priority;
  const std::vector<P> arrivals = {P::kBatch,    P::kStandard,    P::kBatch,
                                   P::kInteractive, P::kStandard, P::kInteractive};
  EXPECT_EQ(ServedOrder(adm, arrivals), (std::vector<int>{3, 5, 1, 4, 0, 2}));
  EXPECT_EQ(adm.waiting(), 0);
  EXPECT_EQ(adm.running(), 0);
}

TEST(AdmissionTest, WaitingAheadCountsOnlyTheSameOrMoreUrgentClasses) {
  Admission adm(1, 8);
  std::optional<Slot> held(*adm.Acquire(Soon(), nullptr));
  std::vector<std::thread> waiters;
  const std::vector<Priority> arrivals = {Priority::kBatch, Priority::kStandard,
                                          Priority::kInteractive, Priority::kBatch};
  for (size_t i = 0; i < arrivals.size(); ++i) {
    waiters.emplace_back([&, i] { EXPECT_TRUE(adm.Acquire(Soon(), nullptr, arrivals[i]).ok()); });
    while (adm.waiting() != static_cast<int>(i) + 1) absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(adm.waiting_ahead(Priority::kInteractive), 1);
  EXPECT_EQ(adm.waiting_ahead(Priority::kStandard), 2);
  EXPECT_EQ(adm.waiting_ahead(Priority::kBatch), 4);
  held.reset();
  for (auto& t : waiters) t.join();
}

TEST(AdmissionTest, FullQueueDisplacesTheNewestLessUrgentWaiter) {
  Admission adm(1, 2);
  std::optional<Slot> held(*adm.Acquire(Soon(), nullptr));
  std::optional<absl::StatusOr<Slot>> old_batch, new_batch;
  std::thread a([&] { old_batch.emplace(adm.Acquire(Soon(), nullptr, Priority::kBatch)); });
  while (adm.waiting() != 1) absl::SleepFor(absl::Milliseconds(1));
  std::thread b([&] { new_batch.emplace(adm.Acquire(Soon(), nullptr, Priority::kBatch)); });
  while (adm.waiting() != 2) absl::SleepFor(absl::Milliseconds(1));
  // Full. Another batch request is refused at once; an interactive one takes the newest batch
  // waiter's place.
  EXPECT_EQ(adm.Acquire(Soon(), nullptr, Priority::kBatch).status().code(),
            absl::StatusCode::kResourceExhausted);
  std::optional<absl::StatusOr<Slot>> urgent;
  std::thread c([&] { urgent.emplace(adm.Acquire(Soon(), nullptr, Priority::kInteractive)); });
  b.join();
  ASSERT_TRUE(new_batch.has_value());
  EXPECT_EQ(new_batch->status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(new_batch->status().message().find("displaced"), std::string::npos);
  EXPECT_EQ(adm.displaced(), 1u);
  EXPECT_EQ(adm.rejected(), 2u);
  EXPECT_EQ(adm.waiting(), 2);
  // The freed slot goes to the interactive request, then the older batch one runs.
  held.reset();
  c.join();
  ASSERT_TRUE(urgent.has_value() && urgent->ok());
  EXPECT_FALSE(old_batch.has_value()) << "the batch waiter ran before the interactive one";
  urgent.reset();
  a.join();
  ASSERT_TRUE(old_batch.has_value());
  EXPECT_TRUE(old_batch->ok());
}

// The gate holds the queue with slots free; when it opens and waiters are kicked, the most
// urgent waiter goes first. tokens_ahead sums the prompts a class waits behind.
TEST(AdmissionTest, ClosedGateHoldsFreeSlotsAndTheMostUrgentGoesWhenItOpens) {
  Admission adm(/*max_inflight=*/8, /*max_queue=*/8);
  // Open for `allowed` admissions in all (none arrives on a worker here).
  std::atomic<int> allowed{0};
  adm.SetGate([&](int in_transit) { return in_transit < allowed.load(); });
  absl::Mutex mu;
  std::vector<Priority> served;
  std::vector<std::thread> waiters;
  const std::vector<std::pair<Priority, int64_t>> arrivals = {
      {Priority::kBatch, 100}, {Priority::kInteractive, 7}, {Priority::kStandard, 30}};
  for (size_t i = 0; i < arrivals.size(); ++i) {
    waiters.emplace_back([&, i] {
      absl::StatusOr<Slot> s = adm.Acquire(Soon(), nullptr, arrivals[i].first, arrivals[i].second);
      EXPECT_TRUE(s.ok());
      absl::MutexLock l(&mu);
      served.push_back(arrivals[i].first);
    });
    while (adm.waiting() != static_cast<int>(i) + 1) absl::SleepFor(absl::Milliseconds(1));
  }
  absl::SleepFor(absl::Milliseconds(30));  // polls pass; the gate is shut
  EXPECT_EQ(adm.waiting(), 3);
  EXPECT_EQ(adm.running(), 0);
  EXPECT_EQ(adm.tokens_ahead(Priority::kInteractive), 7);
  EXPECT_EQ(adm.tokens_ahead(Priority::kStandard), 37);
  EXPECT_EQ(adm.tokens_ahead(Priority::kBatch), 137);
  for (int n = 1; n <= 3; ++n) {
    allowed = n;  // one more may pass
    adm.Kick();
    while (adm.waiting() != 3 - n) absl::SleepFor(absl::Milliseconds(1));
    absl::SleepFor(absl::Milliseconds(10));
    EXPECT_EQ(adm.waiting(), 3 - n) << "exactly one passed";
  }
  for (auto& t : waiters) t.join();
  EXPECT_EQ(served, (std::vector<Priority>{Priority::kInteractive, Priority::kStandard,
                                           Priority::kBatch}));
  EXPECT_EQ(adm.tokens_ahead(Priority::kBatch), 0);
  // A closed gate also stops the fast path; an arrival opens it again.
  EXPECT_EQ(adm.Acquire(absl::Now() + absl::Milliseconds(20), nullptr).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  adm.Arrived();
  EXPECT_TRUE(adm.Acquire(Soon(), nullptr).ok());
}


// The router's form: no thread waits. The outcome comes back at once when known, and otherwise
// exactly once, later, from the call that freed the slot (or the timer), never from inside
// AcquireAsync itself.
TEST(AdmissionTest, AsyncWaitersTakeNoThreadAndAreCalledOnceFromTheReleasingCall) {
  Admission adm(1, 4);
  auto now = adm.AcquireAsync({Soon()}, [](absl::StatusOr<Slot>) { FAIL() << "decided at once"; });
  ASSERT_TRUE(now.has_value());
  ASSERT_TRUE(now->ok());
  std::optional<Slot> held(std::move(**now));

  std::vector<absl::StatusOr<Slot>> got;
  std::vector<std::thread::id> threads;
  auto record = [&](absl::StatusOr<Slot> s) {
    got.push_back(std::move(s));
    threads.push_back(std::this_thread::get_id());
  };
  Admission::Request batch{Soon()};
  batch.priority = Priority::kBatch;
  EXPECT_FALSE(adm.AcquireAsync(batch, record).has_value());
  Admission::Request interactive{Soon()};
  interactive.priority = Priority::kInteractive;
  EXPECT_FALSE(adm.AcquireAsync(interactive, record).has_value());
  EXPECT_TRUE(got.empty());  // queued: nothing called yet
  EXPECT_EQ(adm.waiting(), 2);

  held.reset();  // frees the slot: the interactive waiter gets it inside this call
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(threads[0], std::this_thread::get_id());
  ASSERT_TRUE(got[0].ok());
  EXPECT_EQ(adm.running(), 1);
  EXPECT_EQ(adm.waiting(), 1);

  std::optional<Slot> second(std::move(*got[0]));
  second.reset();  // frees it: the batch waiter is next, again from this thread
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(threads[1], std::this_thread::get_id());
  ASSERT_TRUE(got[1].ok());
  EXPECT_EQ(adm.running(), 1);
  EXPECT_EQ(adm.waiting(), 0);
}

// A waiter whose deadline passes is answered by the admission's timer thread, with nobody
// freeing a slot, and one still queued when the admission goes away is answered CANCELLED.
TEST(AdmissionTest, AsyncWaitersEndAtTheirDeadlineOrWhenTheAdmissionGoes) {
  absl::Notification expired;
  std::optional<absl::Status> timed_out;
  std::optional<absl::Status> at_end;
  {
    Admission adm(1, 4);
    adm.SetGate([](int) { return false; });  // holds every request in the queue
    const absl::Time start = absl::Now();
    ASSERT_FALSE(adm.AcquireAsync({start + absl::Milliseconds(80)},
                                  [&](absl::StatusOr<Slot> s) {
                                    timed_out = s.status();
                                    expired.Notify();
                                  })
                     .has_value());
    ASSERT_TRUE(expired.WaitForNotificationWithTimeout(absl::Seconds(5)));
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(80));
    EXPECT_EQ(timed_out->code(), absl::StatusCode::kDeadlineExceeded);
    ASSERT_FALSE(adm.AcquireAsync({Soon()}, [&](absl::StatusOr<Slot> s) { at_end = s.status(); })
                     .has_value());
    EXPECT_FALSE(at_end.has_value());
  }
  ASSERT_TRUE(at_end.has_value());
  EXPECT_EQ(at_end->code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace tandem::router
