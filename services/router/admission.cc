#include "services/router/admission.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tandem::router {

Slot::~Slot() {
  if (owner_ != nullptr) owner_->Release();
}

Admission::Admission(int max_inflight, int max_queue)
    : max_inflight_(std::max(1, max_inflight)), max_queue_(std::max(0, max_queue)) {}

absl::StatusOr<Slot> Admission::Acquire(absl::Time deadline,
                                        const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  // Fast path: a free slot and nobody ahead in the queue.
  if (running_ < max_inflight_ && waiting_ == 0) {
    running_++;
    return Slot(this);
  }
  if (waiting_ >= max_queue_) {
    rejected_++;
    return absl::ResourceExhaustedError(
        absl::StrCat("router overloaded: ", running_, " requests running and ", waiting_,
                     " waiting (limits ", max_inflight_, " and ", max_queue_, ")"));
  }
  const uint64_t ticket = next_ticket_++;
  waiting_++;
  auto my_turn = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return serving_ == ticket && running_ < max_inflight_;
  };
  absl::Status failure;
  while (!my_turn()) {
    // Wake at least every 50 ms to notice a cancelled caller.
    const absl::Time wake = std::min(deadline, absl::Now() + absl::Milliseconds(50));
    mu_.AwaitWithDeadline(absl::Condition(&my_turn), wake);
    if (my_turn()) break;
    if (cancelled && cancelled()) {
      failure = absl::CancelledError("request cancelled while queued at the router");
      break;
    }
    if (absl::Now() >= deadline) {
      failure = absl::DeadlineExceededError("deadline passed while queued at the router");
      break;
    }
  }
  waiting_--;
  if (!failure.ok()) {
    // Leave the queue: if it was our turn, pass it on; otherwise remember to skip our ticket.
    if (serving_ == ticket) {
      serving_++;
    } else {
      abandoned_.push_back(ticket);
    }
  } else {
    serving_++;
    running_++;
  }
  // Skip tickets whose owners gave up before their turn came.
  for (bool moved = true; moved;) {
    moved = false;
    auto it = std::find(abandoned_.begin(), abandoned_.end(), serving_);
    if (it != abandoned_.end()) {
      abandoned_.erase(it);
      serving_++;
      moved = true;
    }
  }
  if (!failure.ok()) return failure;
  return Slot(this);
}

void Admission::Release() {
  absl::MutexLock lock(&mu_);
  running_--;
}

int Admission::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

int Admission::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

uint64_t Admission::rejected() const {
  absl::MutexLock lock(&mu_);
  return rejected_;
}

}  // namespace tandem::router
