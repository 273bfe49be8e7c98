// SPDX-License-Identifier: Apache-2.0
// ThreadPool: a fixed set of workers that run parallel loops.
//
// parallel_for splits [0, n) into contiguous chunks, runs them on the workers
// and the calling thread, and returns when all are done. One parallel_for at a
// time per pool: concurrent callers are serialised by a mutex; a nested call
// from inside a chunk runs inline on the calling worker. The destructor joins
// the workers.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace flexpert {

class ThreadPool {
 public:
  // num_threads counts the caller: 1 means everything runs inline.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(begin, end) over chunks covering [0, n), each at least `grain` long
  // (except possibly the last).
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  // The process-wide pool: FLEXPERT_THREADS threads, else one per core.
  static ThreadPool& global();

 private:
  void worker_loop();
  void run_chunks();

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // Serialises parallel_for callers.
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  // Guarded by mutex_:
  uint64_t generation_ = 0;
  int pending_workers_ = 0;
  bool stop_ = false;
  // The current loop, valid while a generation runs.
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 0;
  std::atomic<int64_t> next_{0};
};

}  // namespace flexpert
