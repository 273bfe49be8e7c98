// SPDX-License-Identifier: Apache-2.0
// ExpertPlacement <-> proto::Placement, the msgpack structure control messages carry
// (src/cluster/protocol.h). The front end sends its placement with to_wire; a worker
// takes a received one with from_wire. Pure functions.
#pragma once

#include "cluster/protocol.h"
#include "flexpert/placement.h"
#include "flexpert/status.h"

namespace flexpert {

proto::Placement to_wire(const ExpertPlacement& placement);

// The placement of a received message for a model of `num_layers` layers over
// `num_experts` logical experts: InvalidArgument when its shape is not the model's or
// it leaves an expert without a replica (ExpertPlacement::from_slot_maps).
Result<ExpertPlacement> from_wire(const proto::Placement& placement, int num_layers,
                                  int num_experts);

}  // namespace flexpert
