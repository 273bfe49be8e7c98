// SPDX-License-Identifier: Apache-2.0
// release_later: the last reference is dropped on another thread, without holding the
// caller (a destructor that blocks does not block release_later), and every object handed
// over is released.
#include "core/release_later.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

namespace flexpert {
namespace {

struct Slow {
  std::shared_future<void> gate;
  std::atomic<int>* released;
  std::thread::id* where;
  ~Slow() {
    gate.wait();
    *where = std::this_thread::get_id();
    released->fetch_add(1);
  }
};

TEST(ReleaseLaterTest, DropsTheLastReferenceOnAnotherThreadWithoutWaitingForIt) {
  std::promise<void> open;
  std::shared_future<void> gate = open.get_future().share();
  std::atomic<int> released{0};
  std::thread::id where;
  constexpr int kObjects = 5;
  for (int i = 0; i < kObjects; ++i) {
    release_later(std::make_shared<Slow>(gate, &released, &where));
  }
  // The destructors wait at the gate: had release_later run them, we would not get here.
  EXPECT_EQ(released.load(), 0);
  open.set_value();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (released.load() < kObjects && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(released.load(), kObjects);
  EXPECT_NE(where, std::this_thread::get_id());
  release_later(nullptr);  // Nothing to do.
}

}  // namespace
}  // namespace flexpert
