// SPDX-License-Identifier: Apache-2.0
#include "flexpert/thread_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace flexpert {
namespace {

using std::chrono::seconds;

// Runs `body` on its own thread and fails (then exits, since a deadlocked pool cannot be
// joined) when it does not finish within `limit`.
void run_with_deadline(const std::function<void()>& body, seconds limit, const char* what) {
  auto task = std::make_shared<std::packaged_task<void()>>(body);
  std::future<void> done = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (done.wait_for(limit) != std::future_status::ready) {
    ADD_FAILURE() << what << " did not finish within " << limit.count() << " s (deadlock?)";
    std::fflush(nullptr);
    std::_Exit(1);
  }
  done.get();
}

TEST(ThreadPoolTest, NumThreadsCountsTheCaller) {
  EXPECT_EQ(ThreadPool(1).num_threads(), 1);
  EXPECT_EQ(ThreadPool(4).num_threads(), 4);
  EXPECT_EQ(ThreadPool(0).num_threads(), 1);
  EXPECT_EQ(ThreadPool(-3).num_threads(), 1);
}

// Every index in [0, n) is visited exactly once; chunks are non-empty, in range, and at least
// `grain` long except the one ending at n.
TEST(ThreadPoolTest, VisitsEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 2, 7, 64, 100, 1000, 12345}) {
      for (int64_t grain : {0, 1, 3, 64, 5000}) {
        SCOPED_TRACE("threads=" + std::to_string(threads) + " n=" + std::to_string(n) +
                     " grain=" + std::to_string(grain));
        std::vector<std::atomic<int>> visits(static_cast<size_t>(n));
        std::mutex mu;
        std::vector<std::pair<int64_t, int64_t>> chunks;
        pool.parallel_for(n, grain, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) visits[i].fetch_add(1);
          std::lock_guard<std::mutex> lock(mu);
          chunks.emplace_back(begin, end);
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(visits[i].load(), 1) << "index " << i;
        if (n == 0) {
          EXPECT_TRUE(chunks.empty()) << "fn must not run for n == 0";
        }
        for (const auto& [begin, end] : chunks) {
          EXPECT_TRUE(0 <= begin && begin < end && end <= n) << begin << ".." << end;
          if (end != n) {
            EXPECT_GE(end - begin, std::max<int64_t>(grain, 1)) << begin << ".." << end;
          }
        }
      }
    }
  }
}

TEST(ThreadPoolTest, SingleThreadOrSmallLoopRunsInlineAsOneChunk) {
  ThreadPool one(1);
  std::vector<std::pair<int64_t, int64_t>> chunks;
  std::set<std::thread::id> ids;
  one.parallel_for(1000, 1, [&](int64_t b, int64_t e) {
    chunks.emplace_back(b, e);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 1000}}));
  EXPECT_EQ(ids, (std::set<std::thread::id>{std::this_thread::get_id()}));

  ThreadPool four(4);
  chunks.clear();
  ids.clear();
  four.parallel_for(10, 10, [&](int64_t b, int64_t e) {
    chunks.emplace_back(b, e);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 10}}));
  EXPECT_EQ(ids, (std::set<std::thread::id>{std::this_thread::get_id()}));
}

// Each chunk waits until some other thread has run a chunk too, so the loop finishes only if
// the workers really take part.
TEST(ThreadPoolTest, WorkersTakePart) {
  run_with_deadline(
      [] {
        ThreadPool pool(3);
        std::mutex mu;
        std::set<std::thread::id> ids;
        pool.parallel_for(8, 1, [&](int64_t, int64_t) {
          {
            std::lock_guard<std::mutex> lock(mu);
            ids.insert(std::this_thread::get_id());
          }
          for (;;) {
            {
              std::lock_guard<std::mutex> lock(mu);
              if (ids.size() >= 2) return;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
        });
        EXPECT_GE(ids.size(), 2u);
      },
      seconds(60), "a loop needing two threads");
}

TEST(ThreadPoolTest, NestedParallelForRunsInline) {
  run_with_deadline(
      [] {
        ThreadPool pool(3);
        constexpr int64_t kOuter = 16, kInner = 50;
        std::vector<std::atomic<int>> visits(kOuter * kInner);
        std::atomic<int> inner_on_other_thread{0};
        pool.parallel_for(kOuter, 1, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            const std::thread::id outer_thread = std::this_thread::get_id();
            std::atomic<int> inner_calls{0};
            pool.parallel_for(kInner, 1, [&](int64_t ib, int64_t ie) {
              ++inner_calls;
              if (std::this_thread::get_id() != outer_thread) ++inner_on_other_thread;
              for (int64_t j = ib; j < ie; ++j) visits[i * kInner + j].fetch_add(1);
            });
            EXPECT_EQ(inner_calls.load(), 1) << "an inline nested loop is one chunk";
          }
        });
        EXPECT_EQ(inner_on_other_thread.load(), 0);
        for (size_t i = 0; i < visits.size(); ++i) ASSERT_EQ(visits[i].load(), 1) << i;
      },
      seconds(60), "nested parallel_for");
}

// A loop on another pool from inside a chunk must also complete (and cover its range).
TEST(ThreadPoolTest, LoopOnAnotherPoolFromInsideAChunk) {
  run_with_deadline(
      [] {
        ThreadPool outer(3), inner(2);
        std::atomic<int64_t> sum{0};
        outer.parallel_for(12, 1, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            inner.parallel_for(100, 1, [&](int64_t ib, int64_t ie) {
              for (int64_t j = ib; j < ie; ++j) sum += j;
            });
          }
        });
        EXPECT_EQ(sum.load(), 12 * 4950);
      },
      seconds(60), "parallel_for on a second pool");
}

TEST(ThreadPoolTest, ConcurrentCallersFromTwoThreads) {
  run_with_deadline(
      [] {
        ThreadPool pool(3);
        constexpr int kLoops = 200;
        auto caller = [&pool](int64_t n, int64_t grain, int* failures) {
          for (int loop = 0; loop < kLoops; ++loop) {
            std::vector<std::atomic<int>> visits(static_cast<size_t>(n));
            pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
              for (int64_t i = b; i < e; ++i) visits[i].fetch_add(1);
            });
            for (auto& v : visits) {
              if (v.load() != 1) ++*failures;
            }
          }
        };
        int failures_a = 0, failures_b = 0;
        std::thread a(caller, 1000, 1, &failures_a);
        std::thread b(caller, 777, 5, &failures_b);
        a.join();
        b.join();
        EXPECT_EQ(failures_a, 0);
        EXPECT_EQ(failures_b, 0);
      },
      seconds(120), "two concurrent callers");
}

TEST(ThreadPoolTest, ManyShortLivedPools) {
  run_with_deadline(
      [] {
        for (int i = 0; i < 100; ++i) {
          ThreadPool pool(1 + i % 5);
          if (i % 2 == 0) {
            std::atomic<int64_t> count{0};
            pool.parallel_for(37, 1, [&](int64_t b, int64_t e) { count += e - b; });
            ASSERT_EQ(count.load(), 37);
          }
        }
      },
      seconds(60), "creating and destroying pools");
}

TEST(ThreadPoolTest, GlobalPoolHonoursEnvironment) {
  // The global pool is created on first use; nothing else in this binary touches it.
  ::setenv("FLEXPERT_THREADS", "3", 1);
  ThreadPool& pool = ThreadPool::global();
  EXPECT_EQ(&pool, &ThreadPool::global());
  EXPECT_EQ(pool.num_threads(), 3);
  std::atomic<int64_t> count{0};
  pool.parallel_for(1000, 1, [&](int64_t b, int64_t e) { count += e - b; });
  EXPECT_EQ(count.load(), 1000);
}

}  // namespace
}  // namespace flexpert
