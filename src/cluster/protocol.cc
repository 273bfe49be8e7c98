// SPDX-License-Identifier: Apache-2.0
#include "cluster/protocol.h"

#include <cstdint>
#include <string>

namespace flexpert::proto {

Status Placement::check() const {
  if (empty()) return Status();
  if (num_experts < 1) {
    return invalid_argument("placement of " + std::to_string(slot_to_expert.size()) +
                            " layers names " + std::to_string(num_experts) + " experts");
  }
  const size_t num_slots = slot_to_expert[0].size();
  for (size_t l = 0; l < slot_to_expert.size(); ++l) {
    const std::vector<int>& map = slot_to_expert[l];
    if (map.size() != num_slots) {
      return invalid_argument("placement layer " + std::to_string(l) + " has " +
                              std::to_string(map.size()) + " slots, layer 0 has " +
                              std::to_string(num_slots));
    }
    for (size_t s = 0; s < map.size(); ++s) {
      if (map[s] != kFreeSlot && (map[s] < 0 || map[s] >= num_experts)) {
        return invalid_argument("placement layer " + std::to_string(l) + " slot " +
                                std::to_string(s) + " names expert " + std::to_string(map[s]) +
                                ", outside [0, " + std::to_string(num_experts) + ")");
      }
    }
  }
  return Status();
}

Status WorkerConfig::check() const {
  if (placement.empty()) return invalid_argument("no placement");
  FLEX_RETURN_IF_ERROR(placement.check());
  const int64_t want = static_cast<int64_t>(max_ranks) * slots_per_rank;
  if (max_ranks < 1 || slots_per_rank < 1 || placement.num_slots() != want) {
    return invalid_argument("placement has " + std::to_string(placement.num_slots()) +
                            " slots, max_ranks " + std::to_string(max_ranks) +
                            " x slots_per_rank " + std::to_string(slots_per_rank) + " is " +
                            std::to_string(want));
  }
  return Status();
}

Status EpochCommand::check() const { return placement.check(); }

Status MapCommand::check() const {
  if (placement.empty()) return invalid_argument("no placement");
  return placement.check();
}

}  // namespace flexpert::proto
