// SPDX-License-Identifier: Apache-2.0
// UcxTransport's input errors in one process (UCX running, no peers): what create() and
// connect() refuse, and that a create() that fails half way tears down cleanly.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "transport/transport.h"
#include "transport/ucx/ucx_wire.h"

namespace flexpert {
namespace {

TransportOptions options(int rank) {
  TransportOptions o;
  o.session = "ucxunit" + std::to_string(::getpid());
  o.rank = rank;
  o.max_ranks = 4;
  o.timeout_ms = 1000;
  return o;
}

TEST(UcxTransportTest, CreateRefusesBadOptions) {
  TransportOptions o = options(0);
  o.listen_host = "not-an-ip";
  auto bad_host = create_transport("ucx", o);
  ASSERT_FALSE(bad_host.ok());
  EXPECT_EQ(bad_host.status().code(), StatusCode::kInvalidArgument)
      << bad_host.status().to_string();
  o = options(4);
  EXPECT_EQ(create_transport("ucx", o).status().code(), StatusCode::kInvalidArgument);
  o = options(0);
  o.timeout_ms = 0;
  EXPECT_EQ(create_transport("ucx", o).status().code(), StatusCode::kInvalidArgument);
}

TEST(UcxTransportTest, AddressesAndConnectErrors) {
  auto created = create_transport("ucx", options(1));
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  Transport& t = **created;
  auto parsed = ucx::Address::parse(t.address());
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->rank, 1);
  EXPECT_EQ(parsed->pid, ::getpid());
  EXPECT_FALSE(parsed->worker.empty());  // Worker-address mode by default.
  EXPECT_TRUE(t.capabilities().cross_host && t.capabilities().one_sided_read);

  EXPECT_TRUE(t.connect(1, t.address()).ok());  // Itself: a no-op.
  EXPECT_EQ(t.connect(1, "ucx:///r1/i9/p1/t1/wAAAA").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.connect(2, t.address()).code(), StatusCode::kInvalidArgument);  // Rank 1's.
  EXPECT_EQ(t.connect(2, "/flexpert-s-r2-i0").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.connect(7, t.address()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.mark_peer_lost(1, "x").code(), StatusCode::kInvalidArgument);  // Itself.
  EXPECT_TRUE(t.mark_peer_lost(2, "never connected").ok());
  EXPECT_TRUE(t.peer_status(2).ok());
  Group alone{1, {1}};
  EXPECT_TRUE(t.barrier(alone).ok());
  EXPECT_EQ(t.barrier(Group{1, {1, 2}}).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(t.shutdown().ok());
  EXPECT_TRUE(t.shutdown().ok());
  EXPECT_EQ(t.barrier(alone).code(), StatusCode::kFailedPrecondition);
}

TEST(UcxTransportTest, ListenerModeAddress) {
  TransportOptions o = options(3);
  o.listen_host = "127.0.0.1";
  auto created = create_transport("ucx", o);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  auto parsed = ucx::Address::parse((*created)->address());
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->host, "127.0.0.1");
  EXPECT_NE(parsed->port, 0);
  EXPECT_TRUE(parsed->worker.empty());
  EXPECT_TRUE((*created)->shutdown().ok());
}

}  // namespace
}  // namespace flexpert
