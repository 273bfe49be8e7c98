// SPDX-License-Identifier: Apache-2.0
#include "flexpert/thread_pool.h"

#include <algorithm>
#include <cstdlib>

namespace flexpert {
namespace {

thread_local bool t_inside_pool = false;

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < std::max(1, num_threads); ++i) {
    workers_.emplace_back([this] { worker_loop(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool([] {
    if (const char* env = std::getenv("FLEXPERT_THREADS")) {
      int n = std::atoi(env);
      if (n > 0) return n;
    }
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }());
  return pool;
}

void ThreadPool::run_chunks() {
  for (;;) {
    int64_t begin = next_.fetch_add(chunk_);
    if (begin >= n_) return;
    (*fn_)(begin, std::min(n_, begin + chunk_));
  }
}

void ThreadPool::worker_loop() {
  t_inside_pool = true;
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_chunks();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_workers_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (workers_.empty() || t_inside_pool || n <= grain) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  // Aim for a few chunks per thread so uneven chunks balance out.
  const int64_t target_chunks = static_cast<int64_t>(num_threads()) * 4;
  chunk_ = std::max(grain, (n + target_chunks - 1) / target_chunks);
  n_ = n;
  fn_ = &fn;
  next_.store(0);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_workers_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  t_inside_pool = true;
  run_chunks();
  t_inside_pool = false;
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return pending_workers_ == 0; });
  fn_ = nullptr;
}

}  // namespace flexpert
