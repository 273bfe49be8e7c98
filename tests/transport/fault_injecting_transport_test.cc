// SPDX-License-Identifier: Apache-2.0
// FaultInjectingTransport on a one-rank shm transport: which call fails, with what, whether
// the inner call ran, delays, read faults, and plain forwarding.
#include "transport/fault_injecting_transport.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>

namespace flexpert {
namespace {

std::unique_ptr<FaultInjectingTransport> make_wrapped() {
  static std::atomic<int> counter{0};
  TransportOptions o;
  o.session = "fit" + std::to_string(::getpid()) + "x" + std::to_string(counter.fetch_add(1));
  o.max_ranks = 2;
  o.timeout_ms = 1000;
  auto inner = create_transport("shm", o);
  EXPECT_TRUE(inner.ok()) << inner.status().to_string();
  return std::make_unique<FaultInjectingTransport>(std::move(inner).value());
}

TEST(FaultInjectingTransportTest, FailsExactlyTheChosenCollectives) {
  auto t = make_wrapped();
  const Group g{1, {0}};
  t->fail_collective(2, unavailable("boom"));
  t->fail_collective(4, deadline_exceeded("late"), /*run_inner=*/true);
  uint32_t value = 0;
  for (int i = 0; i < 6; ++i) {
    value = static_cast<uint32_t>(i);
    Status st;
    if (i % 3 == 0) {
      st = t->barrier(g);
    } else if (i % 3 == 1) {
      st = t->all_gather(g, ByteSpan{&value, sizeof(value)}).status();
    } else {
      std::vector<ByteSpan> send(2);
      send[0] = ByteSpan{&value, sizeof(value)};
      st = t->exchange(g, send).status();
    }
    if (i == 2) {
      EXPECT_EQ(st.code(), StatusCode::kUnavailable);
      EXPECT_EQ(st.message(), "boom");
    } else if (i == 4) {
      EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
    } else {
      EXPECT_TRUE(st.ok()) << i << ": " << st.to_string();
    }
  }
  EXPECT_EQ(t->num_collectives(), 6);
  // Faults are one-shot: collective 2 does not fail again when... there is no second 2.
  EXPECT_TRUE(t->barrier(g).ok());
}

TEST(FaultInjectingTransportTest, DelayAndReadFaultAndForwarding) {
  auto t = make_wrapped();
  EXPECT_EQ(t->rank(), 0);
  EXPECT_EQ(t->max_ranks(), 2);
  EXPECT_EQ(t->address(), t->inner().address());
  EXPECT_TRUE(t->capabilities().one_sided_read);
  const Group g{1, {0}};
  t->set_collective_delay_ms(25);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(t->barrier(g).ok());
  ASSERT_TRUE(t->barrier(g).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(50));

  auto region = t->allocate_region(0, 16);
  ASSERT_TRUE(region.ok());
  std::memset(region->data, 7, 16);
  char buf[16] = {};
  ASSERT_TRUE(t->read(0, 0, 0, buf, 16).ok());
  EXPECT_EQ(buf[15], 7);
  t->set_read_fault(unavailable("no reads today"));
  EXPECT_EQ(t->read(0, 0, 0, buf, 16).code(), StatusCode::kUnavailable);
  t->clear_faults();
  EXPECT_TRUE(t->read(0, 0, 0, buf, 16).ok());
  EXPECT_TRUE(t->shutdown().ok());
}

}  // namespace
}  // namespace flexpert
