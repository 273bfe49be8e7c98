// SPDX-License-Identifier: Apache-2.0
// ExpertPlacement through its wire form (src/engine/placement_wire.h) and a control message:
// the same slot maps come back, and a placement that is not the model's, or that leaves an
// expert without a replica, is refused at the worker with InvalidArgument.
#include "engine/placement_wire.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace flexpert {
namespace {

TEST(PlacementWireTest, ThroughAMapCommandTheSlotMapsComeBack) {
  auto placement = ExpertPlacement::parse("replicate:5:3", 4, 8);
  ASSERT_TRUE(placement.ok()) << placement.status().to_string();
  auto msg =
      proto::decode<proto::MapCommand>(proto::encode(proto::MapCommand{2, to_wire(*placement)}));
  ASSERT_TRUE(msg.ok()) << msg.status().to_string();
  auto back = from_wire(msg->placement, 4, 8);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->num_layers(), 4);
  EXPECT_EQ(back->num_experts(), 8);
  EXPECT_EQ(back->num_slots(), 13);
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(back->slot_map(l), placement->slot_map(l)) << "layer " << l;
    for (int e = 0; e < 8; ++e) EXPECT_EQ(back->replicas(l, e), placement->replicas(l, e));
  }
}

TEST(PlacementWireTest, APlacementThatIsNotTheModelsIsRefused) {
  const proto::Placement wire = to_wire(ExpertPlacement::identity(2, 4, 6));
  ASSERT_TRUE(from_wire(wire, 2, 4).ok());
  auto layers = from_wire(wire, 3, 4);
  EXPECT_EQ(layers.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(layers.status().message(),
            "placement has 2 layers over 4 experts, the model has 3 layers over 4 experts");
  EXPECT_EQ(from_wire(wire, 2, 5).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(from_wire(proto::Placement{}, 2, 4).status().code(), StatusCode::kInvalidArgument);
  // Well formed on the wire, but expert 3 of layer 1 has no replica.
  proto::Placement orphan = wire;
  orphan.slot_to_expert[1][3] = proto::Placement::kFreeSlot;
  ASSERT_TRUE(orphan.check().ok());
  auto no_replica = from_wire(orphan, 2, 4);
  EXPECT_EQ(no_replica.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(no_replica.status().message(), "placement layer 1 has no replica of expert 3");
  // Out of range (what decode() refuses) is refused here too.
  proto::Placement out_of_range = wire;
  out_of_range.slot_to_expert[0][4] = 4;
  EXPECT_EQ(from_wire(out_of_range, 2, 4).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flexpert
