// SPDX-License-Identifier: Apache-2.0
#include "core/release_later.h"

#include <deque>
#include <thread>
#include <utility>

#include "core/mutex.h"
#include "core/thread_name.h"

namespace flexpert {
namespace {

struct Releaser {
  Mutex mu;
  CondVar cv;
  std::deque<std::shared_ptr<const void>> queue GUARDED_BY(mu);

  void run() {
    name_this_thread("fx-release");
    MutexLock lock(mu);
    for (;;) {
      cv.wait(lock, [&]() REQUIRES(mu) { return !queue.empty(); });
      std::shared_ptr<const void> next = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      next.reset();  // The slow part, outside the lock.
      lock.lock();
    }
  }
};

Releaser& releaser() {
  // Leaked on purpose: the thread may still run while static destructors do.
  static Releaser* r = [] {
    auto* created = new Releaser();
    std::thread([created] { created->run(); }).detach();
    return created;
  }();
  return *r;
}

}  // namespace

void release_later(std::shared_ptr<const void> object) {
  if (object == nullptr) return;
  Releaser& r = releaser();
  {
    MutexLock lock(r.mu);
    r.queue.push_back(std::move(object));
  }
  r.cv.notify_one();
}

}  // namespace flexpert
