// Task<T>: a C++20 coroutine that returns a T to the coroutine awaiting it.
//
// Asynchronous request handling (the router's data path) is written as straight-line code that
// co_awaits each step (an RPC, a timer, an admission slot) instead of a chain of callbacks or a
// thread blocked per request. A Task starts when it is awaited and resumes its awaiter when it
// returns (symmetric transfer: a chain of tasks does not grow the stack). Spawn() starts one
// that nobody awaits; it frees itself when done.
//
// Threading: a task runs on whatever thread resumes it (the thread that completed the operation
// it awaited); it is never resumed twice at once. Exceptions are not used: one escaping a task
// terminates the process.
#pragma once

#include <coroutine>
#include <exception>
#include <optional>
#include <utility>

namespace tandem {

template <typename T = void>
class Task;

namespace task_internal {

struct PromiseBase {
  // Resumed when the task returns; a no-op for a task nobody awaits (yet).
  std::coroutine_handle<> continuation = std::noop_coroutine();

  struct FinalAwaiter {
    bool await_ready() const noexcept { return false; }
    template <typename Promise>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<Promise> h) const noexcept {
      return h.promise().continuation;
    }
    void await_resume() const noexcept {}
  };

  std::suspend_always initial_suspend() const noexcept { return {}; }
  FinalAwaiter final_suspend() const noexcept { return {}; }
  void unhandled_exception() const noexcept { std::terminate(); }
};

template <typename T>
struct Promise : PromiseBase {
  std::optional<T> value;
  Task<T> get_return_object() noexcept;
  template <typename U>
  void return_value(U&& v) {
    value.emplace(std::forward<U>(v));
  }
  T Take() { return std::move(*value); }
};

template <>
struct Promise<void> : PromiseBase {
  Task<void> get_return_object() noexcept;
  void return_void() const noexcept {}
  void Take() const noexcept {}
};

}  // namespace task_internal

template <typename T>
class [[nodiscard]] Task {
 public:
  using promise_type = task_internal::Promise<T>;

  Task(Task&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  Task& operator=(Task&&) = delete;
  Task(const Task&) = delete;
  ~Task() {
    if (h_) h_.destroy();
  }

  // Awaiting a task starts it; the awaiter resumes with its result once it returns.
  bool await_ready() const noexcept { return false; }
  std::coroutine_handle<> await_suspend(std::coroutine_handle<> awaiter) noexcept {
    h_.promise().continuation = awaiter;
    return h_;
  }
  T await_resume() { return h_.promise().Take(); }

 private:
  friend struct task_internal::Promise<T>;
  explicit Task(std::coroutine_handle<promise_type> h) : h_(h) {}
  std::coroutine_handle<promise_type> h_;
};

namespace task_internal {

template <typename T>
Task<T> Promise<T>::get_return_object() noexcept {
  return Task<T>(std::coroutine_handle<Promise<T>>::from_promise(*this));
}

inline Task<void> Promise<void>::get_return_object() noexcept {
  return Task<void>(std::coroutine_handle<Promise<void>>::from_promise(*this));
}

// A coroutine that runs at once and frees itself at its end.
struct Detached {
  struct promise_type {
    Detached get_return_object() const noexcept { return {}; }
    std::suspend_never initial_suspend() const noexcept { return {}; }
    std::suspend_never final_suspend() const noexcept { return {}; }
    void return_void() const noexcept {}
    void unhandled_exception() const noexcept { std::terminate(); }
  };
};

inline Detached RunDetached(Task<void> t) { co_await std::move(t); }

}  // namespace task_internal

// Starts `t` on the calling thread; it runs until its first suspension before Spawn returns,
// and frees itself when it ends.
inline void Spawn(Task<void> t) { task_internal::RunDetached(std::move(t)); }

}  // namespace tandem
