// SPDX-License-Identifier: Apache-2.0
// Moving one layer from its current placement to a planned one, one safe step
// at a time. Pure and deterministic; the front end executes the steps.
//
// Every step leaves a valid map (each logical expert keeps at least one
// replica). A fill step copies experts only into slots free in the map before
// it, from slots that hold them there; the map that points at the new copies is
// committed after the bytes landed. A free step only empties slots. Order of
// preference: fills the plan wants, frees of slots whose expert the plan moves
// (never a last replica), staging a misplaced last replica through a free slot,
// and, when every slot is taken, giving up one surplus replica.
#pragma once

#include <utility>
#include <vector>

#include "flexpert/status.h"

namespace flexpert::eplb {

struct TransitionStep {
  enum class Kind { kFill, kFree };
  Kind kind = Kind::kFill;
  std::vector<std::pair<int, int>> copies;  // kFill: (destination slot, source slot).
  std::vector<int> map;                     // The layer's slot -> expert map after the step.
};

// The next step from `current` towards `target` (same length; -1 = free slot;
// slot s on rank s / slots_per_rank). NotFound when current == target;
// ResourceExhausted when no step can make progress (no free slot to stage through).
Result<TransitionStep> next_transition_step(const std::vector<int>& current,
                                            const std::vector<int>& target, int slots_per_rank,
                                            int num_experts);

}  // namespace flexpert::eplb
