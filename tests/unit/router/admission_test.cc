// Admission: in-flight and queue limits, FIFO hand-over, deadline and cancellation of waiters.
#include "services/router/admission.h"

#include <atomic>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
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

}  // namespace
}  // namespace tandem::router
