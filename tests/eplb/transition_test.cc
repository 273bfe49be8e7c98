// SPDX-License-Identifier: Apache-2.0
// The step-by-step move from a placement to a planned one: every intermediate
// map valid, fills only into free slots from holders, and the target reached.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "eplb/transition.h"

namespace flexpert::eplb {
namespace {

// A valid map: every expert at least once, never twice on a rank, the rest free.
std::vector<int> random_map(std::mt19937& rng, int experts, int ranks, int slots) {
  for (;;) {
    std::vector<int> map(static_cast<size_t>(ranks) * slots, -1);
    std::vector<int> order(experts);
    for (int e = 0; e < experts; ++e) order[e] = e;
    const int extra = static_cast<int>(rng() % (ranks * slots - experts + 1));
    for (int i = 0; i < extra; ++i) order.push_back(static_cast<int>(rng() % experts));
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int> free_slots(map.size());
    for (size_t i = 0; i < map.size(); ++i) free_slots[i] = static_cast<int>(i);
    std::shuffle(free_slots.begin(), free_slots.end(), rng);
    bool ok = true;
    for (int e : order) {
      auto it = std::find_if(free_slots.begin(), free_slots.end(), [&](int s) {
        const int r = s / slots;
        return std::find(map.begin() + r * slots, map.begin() + (r + 1) * slots, e) ==
               map.begin() + (r + 1) * slots;
      });
      if (it == free_slots.end()) {
        ok = !(std::count(map.begin(), map.end(), e) == 0);
        if (!ok) break;
        continue;
      }
      map[*it] = e;
      free_slots.erase(it);
    }
    if (ok) return map;
  }
}

TEST(TransitionTest, ReachesTheTargetThroughValidMaps) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  int total_steps = 0;
  for (int trial = 0; trial < 500; ++trial) {
    const int experts = 4 + static_cast<int>(rng() % 13);
    const int ranks = 2 + static_cast<int>(rng() % 4);
    const int slots = (experts + ranks - 1) / ranks + 1 + static_cast<int>(rng() % 3);
    std::vector<int> current = random_map(rng, experts, ranks, slots);
    const std::vector<int> target = random_map(rng, experts, ranks, slots);
    int steps = 0;
    for (; steps < 200; ++steps) {
      auto step = next_transition_step(current, target, slots, experts);
      if (!step.ok()) {
        ASSERT_EQ(step.status().code(), StatusCode::kNotFound) << step.status().to_string();
        break;
      }
      for (const auto& [dst, src] : step->copies) {
        EXPECT_EQ(current[dst], -1) << "fill into a used slot";
        EXPECT_EQ(step->map[dst], current[src]) << "copy from a slot not holding the expert";
      }
      for (size_t s = 0; s < current.size(); ++s) {
        const bool copied =
            std::any_of(step->copies.begin(), step->copies.end(),
                        [&](const auto& c) { return c.first == static_cast<int>(s); });
        if (step->map[s] != current[s]) {
          EXPECT_TRUE(copied || step->map[s] == -1);
        }
      }
      for (int e = 0; e < experts; ++e) {
        ASSERT_GE(std::count(step->map.begin(), step->map.end(), e), 1)
            << "expert " << e << " lost";
      }
      current = step->map;
    }
    ASSERT_EQ(current, target) << "trial " << trial << " stuck after " << steps << " steps";
    total_steps += steps;
  }
  std::printf("  500 transitions, %.1f steps on average\n", total_steps / 500.0);
}

TEST(TransitionTest, NothingToDoAndBadShapes) {
  EXPECT_EQ(next_transition_step({0, 1, -1}, {0, 1, -1}, 3, 2).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(next_transition_step({0, 1}, {0, 1, -1}, 3, 2).status().code(),
            StatusCode::kInvalidArgument);
  // No free slot and no surplus replica: a swap needs staging room.
  EXPECT_EQ(next_transition_step({0, 1}, {1, 0}, 1, 2).status().code(),
            StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace flexpert::eplb
