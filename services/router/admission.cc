#include "services/router/admission.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"

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
    : max_inflight_(std::max(1, max_inflight)), max_queue_(std::max(0, max_queue)) {
  timer_ = std::thread([this] { TimerLoop(); });
}

Admission::~Admission() {
  std::vector<Outcome> out;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    for (auto& [ticket, w] : waiters_) {
      out.emplace_back(std::move(w.done),
                       absl::CancelledError("the router is shutting down"));
    }
    waiters_.clear();
    queue_.clear();
  }
  timer_.join();
  Deliver(out);
}

bool Admission::CanStart() const {
  return running_ < max_inflight_ && (!gate_ || gate_(in_transit_));
}

void Admission::Deliver(std::vector<Outcome>& out) {
  for (auto& [done, result] : out) done(std::move(result));
  out.clear();
}

std::optional<absl::StatusOr<Slot>> Admission::AcquireAsync(Request r, Done done) {
  std::vector<Outcome> out;
  std::optional<absl::StatusOr<Slot>> now = [&] {
    absl::MutexLock lock(&mu_);
    return Enqueue(std::move(r), std::move(done), &out);
  }();
  Deliver(out);  // a displaced waiter's, outside the lock
  return now;
}

std::optional<absl::StatusOr<Slot>> Admission::Enqueue(Request r, Done done,
                                                       std::vector<Outcome>* out) {
  // Fast path: a free slot, an open gate and nobody ahead in the queue.
  if (queue_.empty() && CanStart()) {
    running_++;
    in_transit_++;
    return absl::StatusOr<Slot>(Slot(this));
  }
  if (absl::Now() >= r.deadline) {
    return absl::StatusOr<Slot>(
        absl::DeadlineExceededError("deadline passed before the router could admit the request"));
  }
  const int cls = static_cast<int>(r.priority);
  if (static_cast<int>(queue_.size()) >= max_queue_) {
    // Full: push out the newest waiter of a less urgent class, or refuse this one.
    if (max_queue_ == 0 || std::prev(queue_.end())->first <= cls) {
      rejected_++;
      return absl::StatusOr<Slot>(absl::ResourceExhaustedError(absl::StrCat(
          "router overloaded: ", running_, " requests running and ", queue_.size(),
          " waiting (limits ", max_inflight_, " and ", max_queue_, "), none less urgent than ",
          PriorityName(r.priority))));
    }
    auto last = std::prev(queue_.end());
    auto it = waiters_.find(last->second);
    rejected_++;
    displaced_++;
    out->emplace_back(std::move(it->second.done),
                      absl::ResourceExhaustedError(absl::StrCat(
                          "router overloaded: this ",
                          PriorityName(static_cast<Priority>(last->first)),
                          " request was displaced from the full queue by a more urgent one")));
    waiters_.erase(it);
    queue_.erase(last);
  }
  const uint64_t ticket = next_ticket_++;
  queue_.insert({cls, ticket});
  waiters_.emplace(ticket, Waiter{cls, std::move(r), std::move(done)});
  return std::nullopt;
}

void Admission::Settle(std::vector<Outcome>* out) {
  if (queue_.empty()) return;
  const absl::Time now = absl::Now();
  for (auto q = queue_.begin(); q != queue_.end();) {
    auto it = waiters_.find(q->second);
    Waiter& w = it->second;
    absl::Status failure;
    if (w.r.cancelled && w.r.cancelled()) {
      failure = absl::CancelledError("request cancelled while queued at the router");
    } else if (now >= w.r.deadline) {
      failure = absl::DeadlineExceededError("deadline passed while queued at the router");
    } else if (now >= w.r.give_up) {
      gave_up_++;
      rejected_++;
      failure = absl::ResourceExhaustedError(
          "router overloaded: this request waited in the queue past the point where its time to "
          "first token target could still be met");
    }
    if (failure.ok()) {
      ++q;
      continue;
    }
    out->emplace_back(std::move(w.done), std::move(failure));
    waiters_.erase(it);
    q = queue_.erase(q);
  }
  while (!queue_.empty() && CanStart()) {
    auto it = waiters_.find(queue_.begin()->second);
    running_++;
    in_transit_++;
    out->emplace_back(std::move(it->second.done), Slot(this));
    waiters_.erase(it);
    queue_.erase(queue_.begin());
  }
}

void Admission::TimerLoop() {
  std::vector<Outcome> out;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto busy = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&busy));
      if (stop_) return;
      // Look again at least this often for a cancelled caller or a gate that opened unannounced,
      // and at each waiter's deadline and give-up time.
      absl::Time wake = absl::Now() + (gate_ ? absl::Milliseconds(5) : absl::Milliseconds(50));
      for (const auto& [ticket, w] : waiters_) {
        wake = std::min({wake, w.r.deadline, w.r.give_up});
      }
      mu_.AwaitWithDeadline(absl::Condition(&stop_), wake);
      if (stop_) return;
      Settle(&out);
    }
    Deliver(out);
  }
}

absl::StatusOr<Slot> Admission::Acquire(absl::Time deadline,
                                        const std::function<bool()>& cancelled,
                                        Priority priority, int64_t tokens, absl::Time give_up) {
  absl::Notification settled;
  std::optional<absl::StatusOr<Slot>> result;
  Request r{deadline, cancelled, priority, tokens, give_up};
  if (auto now = AcquireAsync(std::move(r),
                              [&](absl::StatusOr<Slot> s) {
                                result.emplace(std::move(s));
                                settled.Notify();
                              });
      now.has_value()) {
    return std::move(*now);
  }
  settled.WaitForNotification();
  return std::move(*result);
}

void Admission::SetGate(std::function<bool(int)> open) {
  absl::MutexLock lock(&mu_);
  gate_ = std::move(open);
}

void Admission::Arrived() {
  std::vector<Outcome> out;
  {
    absl::MutexLock lock(&mu_);
    in_transit_--;
    Settle(&out);
  }
  Deliver(out);
}

void Admission::Kick() {
  std::vector<Outcome> out;
  {
    absl::MutexLock lock(&mu_);
    Settle(&out);
  }
  Deliver(out);
}

void Admission::Release() {
  std::vector<Outcome> out;
  {
    absl::MutexLock lock(&mu_);
    running_--;
    Settle(&out);
  }
  Deliver(out);
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
    auto it = waiters_.find(ticket);
    if (it != waiters_.end()) n += it->second.r.tokens;
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
