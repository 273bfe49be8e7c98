// SPDX-License-Identifier: Apache-2.0
// ZmqSocket's waits under a signal: a worker's SIGTERM (asking it to leave) lands while its
// control loop waits for a command; the wait must end as "nothing received", not as a lost
// front end.
#include "cluster/zmq_socket.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <zmq.h>

#include <chrono>
#include <thread>

namespace flexpert {
namespace {

void on_signal(int) {}

// Sends SIGUSR1 (no SA_RESTART) to `target` after 100 ms, while it waits.
std::thread interrupt_later(pthread_t target) {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGUSR1, &sa, nullptr);
  return std::thread([target] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    pthread_kill(target, SIGUSR1);
  });
}

TEST(ZmqSocketTest, ASignalEndsAWaitAsNothingReceived) {
  ZmqContext ctx;
  ZmqSocket a(ctx, ZMQ_PAIR), b(ctx, ZMQ_PAIR);
  ASSERT_TRUE(a.bind("inproc://zmq-socket-test").ok());
  ASSERT_TRUE(b.connect("inproc://zmq-socket-test").ok());

  std::thread t = interrupt_later(pthread_self());
  auto got = a.recv(30000);
  t.join();
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kDeadlineExceeded) << got.status().to_string();

  t = interrupt_later(pthread_self());
  auto ready = zmq_poll_readable({&a}, 30000);
  t.join();
  ASSERT_TRUE(ready.ok()) << ready.status().to_string();
  EXPECT_TRUE(ready->empty());

  // And a message still arrives afterwards.
  ASSERT_TRUE(b.send({"type", "body"}).ok());
  auto msg = a.recv(5000);
  ASSERT_TRUE(msg.ok()) << msg.status().to_string();
  EXPECT_EQ(msg->size(), 2u);
}

}  // namespace
}  // namespace flexpert
