// co_await for gRPC's callback API (common/util/task.h): unary calls, server-streaming reads,
// timers and a hop to another thread, each suspending the task instead of blocking a thread.
//
//   grpc::Status gs = co_await services::Unary([&](auto done) {
//     stub->async()->Reserve(cc.get(), &request, &response, std::move(done));
//   });
//
// Everything here resumes the task on a gRPC thread. Those threads are shared by every call of
// the process, so a task must not block between its awaits.
#pragma once

#include <coroutine>
#include <functional>
#include <utility>

#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/client_callback.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "services/common/grpc_status.h"

namespace tandem::services {

// Awaits a unary callback call: `start(done)` begins it, and gRPC calls done(status) when it
// ends. The request, response and ClientContext must outlive the co_await (locals of the task).
template <typename Start>
class UnaryAwaiter {
 public:
  explicit UnaryAwaiter(Start start) : start_(std::move(start)) {}
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) {
    // `done` may run on another thread before start_ returns: nothing here touches `this`
    // after it.
    start_(std::function<void(grpc::Status)>([this, h](grpc::Status s) {
      status_ = std::move(s);
      h.resume();
    }));
  }
  grpc::Status await_resume() { return std::move(status_); }

 private:
  Start start_;
  grpc::Status status_;
};

template <typename Start>
UnaryAwaiter<Start> Unary(Start start) {
  return UnaryAwaiter<Start>(std::move(start));
}

// Resumes the task at `t` (at once when it has passed), on a gRPC thread.
class SleepUntil {
 public:
  explicit SleepUntil(absl::Time t) : t_(t) {}
  bool await_ready() const { return absl::Now() >= t_; }
  void await_suspend(std::coroutine_handle<> h) {
    alarm_.Set(ToChronoDeadline(t_), [h](bool) { h.resume(); });
  }
  void await_resume() const noexcept {}

 private:
  absl::Time t_;
  grpc::Alarm alarm_;
};

// Moves the task to a gRPC thread now. For a task woken by a callback that runs under another
// task's feet (see router/admission.h): it continues there, not inside that callback.
class Hop {
 public:
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) {
    alarm_.Set(std::chrono::system_clock::now(), [h](bool) { h.resume(); });
  }
  void await_resume() const noexcept {}

 private:
  grpc::Alarm alarm_;
};

// A server-streaming call read by a task: one message at a time, so a stream holds at most one
// message in memory here, whatever the rate of either side.
//
//   StreamReader<Resp> r;
//   stub->async()->Decode(cc.get(), &request, &r);
//   while (co_await r.Read(&msg)) { ... }
//   grpc::Status gs = co_await r.Finish();
//
// Every stream must end with Finish() (after a Read returned false, or after
// ClientContext::TryCancel()), and the reader and its ClientContext must outlive it.
template <typename Resp>
class StreamReader final : public grpc::ClientReadReactor<Resp> {
 public:
  class ReadAwaiter {
   public:
    ReadAwaiter(StreamReader* r, Resp* msg) : r_(r), msg_(msg) {}
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) {
      r_->read_waiter_ = h;
      if (r_->started_) {
        r_->StartRead(msg_);  // nothing here touches the reader after this
        return;
      }
      // The task starts its reads from outside the reactor's own callbacks (after a write to
      // its client, say): a hold keeps the call from ending in between, until Finish().
      r_->started_ = true;
      r_->AddHold();
      // A read cannot complete before the call starts, so nothing resumes the task before
      // StartCall; afterwards nothing here touches the reader.
      r_->StartRead(msg_);
      r_->StartCall();
    }
    bool await_resume() const noexcept { return r_->read_ok_; }

   private:
    StreamReader* r_;
    Resp* msg_;
  };

  class FinishAwaiter {
   public:
    explicit FinishAwaiter(StreamReader* r) : r_(r) {}
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> h) {
      if (!r_->started_) {  // never read: start it so that it can end
        r_->started_ = true;
        r_->StartCall();
      } else {
        r_->RemoveHold();  // no more reads: the call may end (OnDone may run inside this)
      }
      absl::MutexLock l(&r_->mu_);
      if (r_->done_) return false;  // OnDone came first: go on without suspending
      r_->finish_waiter_ = h;
      return true;
    }
    grpc::Status await_resume() const { return r_->status_; }

   private:
    StreamReader* r_;
  };

  ReadAwaiter Read(Resp* msg) { return ReadAwaiter(this, msg); }
  FinishAwaiter Finish() { return FinishAwaiter(this); }

  void OnReadDone(bool ok) override {
    read_ok_ = ok;
    std::exchange(read_waiter_, {}).resume();
  }
  void OnDone(const grpc::Status& s) override {
    std::coroutine_handle<> waiter;
    {
      absl::MutexLock l(&mu_);
      status_ = s;
      done_ = true;
      waiter = std::exchange(finish_waiter_, {});
    }
    // The last use of the reader by gRPC: the task may free it once resumed.
    if (waiter) waiter.resume();
  }

 private:
  bool started_ = false;
  bool read_ok_ = false;
  std::coroutine_handle<> read_waiter_;
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::coroutine_handle<> finish_waiter_ ABSL_GUARDED_BY(mu_);
  grpc::Status status_;  // written before done_ is set, read after
};

}  // namespace tandem::services
