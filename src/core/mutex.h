// SPDX-License-Identifier: Apache-2.0
// Mutex, MutexLock and CondVar with clang's thread-safety annotations (the attributes of
// https://clang.llvm.org/docs/ThreadSafetyAnalysis.html, as LevelDB's
// thread_annotations.h). Shared state names its lock with GUARDED_BY(mu_); a function
// that expects a lock held says REQUIRES(mu_). Clang checks them (-Wthread-safety, on in
// every clang build; scripts/check_thread_safety.sh fails CI on a violation); GCC
// ignores them. The classes are std::mutex and std::condition_variable_any underneath.
#pragma once

#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define FLEX_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define FLEX_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) FLEX_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY FLEX_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) FLEX_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) FLEX_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) FLEX_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) FLEX_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) FLEX_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) FLEX_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) FLEX_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define NO_THREAD_SAFETY_ANALYSIS FLEX_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace flexpert {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  std::mutex mu_;
};

// Holds a Mutex for its scope; unlock()/lock() let a scope drop it for a while (and
// CondVar::wait does the same inside).
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() RELEASE() {
    if (held_) mu_.unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void lock() ACQUIRE() {
    mu_.lock();
    held_ = true;
  }
  void unlock() RELEASE() {
    held_ = false;
    mu_.unlock();
  }

 private:
  Mutex& mu_;
  bool held_ = true;
};

// A condition variable over a MutexLock, or over a Mutex the caller holds (a function
// marked REQUIRES(mu) that waits has no MutexLock of its own: the analysis cannot tie a
// MutexLock passed by reference to the mutex it holds). The wait functions release and
// re-acquire the lock inside; to the analysis the lock stays held across them, as it is
// on return. A predicate that reads guarded state says so: [&]() REQUIRES(mu) { ... }.
class CondVar {
 public:
  void wait(MutexLock& lock) { cv_.wait(lock); }
  template <class Predicate>
  void wait(MutexLock& lock, Predicate pred) {
    cv_.wait(lock, pred);
  }
  template <class Rep, class Period, class Predicate>
  bool wait_for(MutexLock& lock, const std::chrono::duration<Rep, Period>& d, Predicate pred) {
    return cv_.wait_for(lock, d, pred);
  }
  template <class Clock, class Duration, class Predicate>
  bool wait_until(MutexLock& lock, const std::chrono::time_point<Clock, Duration>& t,
                  Predicate pred) {
    return cv_.wait_until(lock, t, pred);
  }
  void wait(Mutex& mu) REQUIRES(mu) { cv_.wait(mu); }
  template <class Predicate>
  void wait(Mutex& mu, Predicate pred) REQUIRES(mu) {
    cv_.wait(mu, pred);
  }
  template <class Rep, class Period, class Predicate>
  bool wait_for(Mutex& mu, const std::chrono::duration<Rep, Period>& d, Predicate pred)
      REQUIRES(mu) {
    return cv_.wait_for(mu, d, pred);
  }
  template <class Clock, class Duration, class Predicate>
  bool wait_until(Mutex& mu, const std::chrono::time_point<Clock, Duration>& t, Predicate pred)
      REQUIRES(mu) {
    return cv_.wait_until(mu, t, pred);
  }
  void notify_one() { cv_.notify_one(); }
  void notify_all() { cv_.notify_all(); }

 private:
  std::condition_variable_any cv_;
};

}  // namespace flexpert
