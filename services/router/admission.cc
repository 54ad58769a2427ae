#include "services/router/admission.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tandem::router {

Slot::~Slot() {
  if (owner_ != nullptr) owner_->Release();
}

const char* PriorityName(Priority p) {
  switch (p) {
    case Priority::kInteractive:
      return "interactive";
    case Priority::kStandard:
      return "standard";
    case Priority::kBatch:
      return "batch";
  }
  return "standard";
}

Admission::Admission(int max_inflight, int max_queue)
    : max_inflight_(std::max(1, max_inflight)), max_queue_(std::max(0, max_queue)) {}

absl::StatusOr<Slot> Admission::Acquire(absl::Time deadline,
                                        const std::function<bool()>& cancelled,
                                        Priority priority, int64_t tokens, absl::Time give_up) {
  absl::MutexLock lock(&mu_);
  // Fast path: a free slot, an open gate and nobody ahead in the queue.
  if (running_ < max_inflight_ && queue_.empty() && (!gate_ || gate_(in_transit_))) {
    running_++;
    in_transit_++;
    return Slot(this);
  }
  const int cls = static_cast<int>(priority);
  if (static_cast<int>(queue_.size()) >= max_queue_) {
    // Full: push out the newest waiter of a less urgent class, or refuse this one.
    if (max_queue_ == 0 || std::prev(queue_.end())->first <= cls) {
      rejected_++;
      return absl::ResourceExhaustedError(absl::StrCat(
          "router overloaded: ", running_, " requests running and ", queue_.size(),
          " waiting (limits ", max_inflight_, " and ", max_queue_, "), none less urgent than ",
          PriorityName(priority)));
    }
    auto last = std::prev(queue_.end());
    displaced_tickets_.insert(last->second);
    tokens_.erase(last->second);
    queue_.erase(last);
  }
  const uint64_t ticket = next_ticket_++;
  const std::pair<int, uint64_t> me{cls, ticket};
  queue_.insert(me);
  tokens_[ticket] = tokens;
  auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return displaced_tickets_.contains(ticket) ||
           (*queue_.begin() == me && running_ < max_inflight_ && (!gate_ || gate_(in_transit_)));
  };
  // Wake at least this often to notice a cancelled caller, or a gate that opened unannounced.
  const absl::Duration poll = gate_ ? absl::Milliseconds(5) : absl::Milliseconds(50);
  absl::Status failure;
  while (!settled()) {
    const absl::Time wake = std::min({deadline, give_up, absl::Now() + poll});
    mu_.AwaitWithDeadline(absl::Condition(&settled), wake);
    if (settled()) break;
    if (cancelled && cancelled()) {
      failure = absl::CancelledError("request cancelled while queued at the router");
      break;
    }
    if (absl::Now() >= deadline) {
      failure = absl::DeadlineExceededError("deadline passed while queued at the router");
      break;
    }
    if (absl::Now() >= give_up) {
      gave_up_++;
      rejected_++;
      failure = absl::ResourceExhaustedError(
          "router overloaded: this request waited in the queue past the point where its time to "
          "first token target could still be met");
      break;
    }
  }
  if (displaced_tickets_.erase(ticket) > 0) {
    rejected_++;
    displaced_++;
    return absl::ResourceExhaustedError(absl::StrCat(
        "router overloaded: this ", PriorityName(priority),
        " request was displaced from the full queue by a more urgent one"));
  }
  queue_.erase(me);
  tokens_.erase(ticket);
  if (!failure.ok()) return failure;
  running_++;
  in_transit_++;
  return Slot(this);
}

void Admission::SetGate(std::function<bool(int)> open) {
  absl::MutexLock lock(&mu_);
  gate_ = std::move(open);
}

void Admission::Arrived() {
  absl::MutexLock lock(&mu_);
  in_transit_--;
}

void Admission::Kick() {
  // Releasing the lock makes the waiters' conditions be evaluated again.
  absl::MutexLock lock(&mu_);
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
  return static_cast<int>(queue_.size());
}

int Admission::waiting_ahead(Priority priority) const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [cls, ticket] : queue_) {
    if (cls > static_cast<int>(priority)) break;
    ++n;
  }
  return n;
}

int64_t Admission::tokens_ahead(Priority priority) const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [cls, ticket] : queue_) {
    if (cls > static_cast<int>(priority)) break;
    auto it = tokens_.find(ticket);
    if (it != tokens_.end()) n += it->second;
  }
  return n;
}

uint64_t Admission::displaced() const {
  absl::MutexLock lock(&mu_);
  return displaced_;
}

uint64_t Admission::gave_up() const {
  absl::MutexLock lock(&mu_);
  return gave_up_;
}

uint64_t Admission::rejected() const {
  absl::MutexLock lock(&mu_);
  return rejected_;
}

}  // namespace tandem::router
