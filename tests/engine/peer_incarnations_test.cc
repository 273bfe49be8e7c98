// SPDX-License-Identifier: Apache-2.0
// A worker's record of its peers' incarnations (src/engine/peer_incarnations.h), fed with
// the front end's commands as they come over the wire: a PeerLost naming an earlier
// incarnation of a rank id than the one attached (sent before the id's next incarnation
// joined, delivered after its attach) is stale; one for the attached incarnation, or a later
// one, applies; and a front end that sends no incarnations keeps every PeerLost applying.
#include "engine/peer_incarnations.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace flexpert {
namespace {

template <typename T>
T through_the_wire(const T& msg) {
  auto back = proto::decode<T>(proto::encode(msg));
  EXPECT_TRUE(back.ok()) << back.status().to_string();
  return back.ok() ? *back : T{};
}

proto::EpochCommand epoch(uint64_t e, std::vector<int> members, std::vector<uint64_t> incs) {
  proto::EpochCommand cmd;
  cmd.epoch = e;
  cmd.addresses.assign(4, "");
  cmd.incarnations.assign(4, 0);
  for (size_t i = 0; i < members.size(); ++i) {
    cmd.addresses[members[i]] = "shm:" + std::to_string(members[i]);
    cmd.incarnations[members[i]] = incs[i];
  }
  cmd.members = std::move(members);
  return through_the_wire(cmd);
}

TEST(PeerIncarnationsTest, AStaleLossAfterTheNextIncarnationJoinedIsIgnored) {
  PeerIncarnations peers;
  peers.attach(epoch(1, {0, 1, 2}, {1, 1, 1}));
  EXPECT_EQ(peers.attached(2), 1u);
  // Rank 2 (incarnation 1) is lost; a replacement, incarnation 2, joins at its id
  // (ConnectCommand, then the recovery's epoch).
  const proto::PeerLost lost{2, 1, "no heartbeat for 2000 ms"};
  EXPECT_TRUE(peers.applies(through_the_wire(lost))) << "before the replacement: it applies";
  proto::ConnectCommand connect;
  connect.ranks = {2};
  connect.addresses = {"shm:2b"};
  connect.incarnations = {2};
  peers.attach(through_the_wire(connect));
  EXPECT_EQ(peers.attached(2), 2u);
  EXPECT_FALSE(peers.applies(through_the_wire(lost))) << "late: it must not mark incarnation 2";
  peers.attach(epoch(2, {0, 1, 2}, {1, 1, 2}));
  EXPECT_FALSE(peers.applies(lost));
  // The replacement's own loss, or a later incarnation's, applies.
  EXPECT_TRUE(peers.applies(proto::PeerLost{2, 2, "killed by signal 9"}));
  EXPECT_TRUE(peers.applies(proto::PeerLost{2, 3, "killed by signal 9"}));
  // Other ranks are unaffected.
  EXPECT_TRUE(peers.applies(proto::PeerLost{1, 1, "killed by signal 9"}));
}

TEST(PeerIncarnationsTest, IncarnationsOnlyGrowAndDetachesTeachNothing) {
  PeerIncarnations peers;
  peers.attach(3, 5);
  peers.attach(3, 4);  // An older command applied late.
  EXPECT_EQ(peers.attached(3), 5u);
  proto::ConnectCommand detach;  // After a rollback: "" addresses detach.
  detach.ranks = {3};
  detach.addresses = {""};
  detach.incarnations = {9};
  peers.attach(detach);
  EXPECT_EQ(peers.attached(3), 5u);
  EXPECT_FALSE(peers.applies(proto::PeerLost{3, 4, "stale"}));
  EXPECT_TRUE(peers.applies(proto::PeerLost{3, 5, "lost"}));
}

// An EpochCommand as a front end without incarnations encodes it.
struct EpochWithoutIncarnations {
  uint64_t epoch = 0;
  std::vector<int> members;
  std::vector<std::string> addresses;
  MSGPACK_DEFINE_MAP(epoch, members, addresses);
};

TEST(PeerIncarnationsTest, WithoutIncarnationsEveryLossApplies) {
  // A command from a front end that does not send incarnations (the field absent on the
  // wire) teaches nothing; a PeerLost without one (0) applies whatever is attached.
  auto old = proto::decode<proto::EpochCommand>(
      proto::encode(EpochWithoutIncarnations{1, {0, 1}, {"a", "b"}}));
  ASSERT_TRUE(old.ok()) << old.status().to_string();
  EXPECT_TRUE(old->incarnations.empty());
  PeerIncarnations peers;
  peers.attach(*old);
  EXPECT_EQ(peers.attached(1), 0u);
  EXPECT_TRUE(peers.applies(proto::PeerLost{1, 1, "lost"}));
  peers.attach(1, 2);
  EXPECT_TRUE(peers.applies(proto::PeerLost{1, 0, "lost"}));
  EXPECT_FALSE(peers.applies(proto::PeerLost{1, 1, "lost"}));
}

}  // namespace
}  // namespace flexpert
