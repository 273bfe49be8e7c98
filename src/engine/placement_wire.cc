// SPDX-License-Identifier: Apache-2.0
#include "engine/placement_wire.h"

#include <cstdint>
#include <string>

namespace flexpert {

proto::Placement to_wire(const ExpertPlacement& placement) {
  return proto::Placement{placement.num_experts(), placement.slot_maps()};
}

Result<ExpertPlacement> from_wire(const proto::Placement& placement, int num_layers,
                                  int num_experts) {
  FLEX_RETURN_IF_ERROR(placement.check());
  const auto layers = static_cast<int64_t>(placement.slot_to_expert.size());
  if (layers != num_layers || placement.num_experts != num_experts) {
    return invalid_argument("placement has " + std::to_string(layers) + " layers over " +
                            std::to_string(placement.num_experts) + " experts, the model has " +
                            std::to_string(num_layers) + " layers over " +
                            std::to_string(num_experts) + " experts");
  }
  return ExpertPlacement::from_slot_maps(placement.num_experts, placement.slot_to_expert);
}

}  // namespace flexpert
