// SPDX-License-Identifier: Apache-2.0
// The MoE block over physical slots against a float64 reference of the logical
// experts, for random placements with replicas and free slots.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "flexpert/placement.h"
#include "moe/moe_layer.h"

namespace flexpert {
namespace {

struct Experts {
  int num_experts, hidden, inter;
  std::vector<std::vector<float>> gate, up, down;  // [E][I*H], [E][I*H], [E][H*I]
};

Experts random_experts(std::mt19937& rng, int num_experts, int hidden, int inter) {
  std::normal_distribution<float> dist(0.f, 0.3f);
  Experts ex{num_experts, hidden, inter, {}, {}, {}};
  for (int e = 0; e < num_experts; ++e) {
    for (auto* v : {&ex.gate, &ex.up, &ex.down}) {
      v->emplace_back(static_cast<size_t>(hidden) * inter);
      for (float& x : v->back()) x = dist(rng);
    }
  }
  return ex;
}

// Naive float64 MoE: softmax, top-k, renormalise, SwiGLU experts, weighted sum.
std::vector<double> reference(const std::vector<float>& x, int tokens,
                              const std::vector<float>& router, const Experts& ex, int k,
                              bool norm) {
  const int H = ex.hidden, I = ex.inter, E = ex.num_experts;
  std::vector<double> out(static_cast<size_t>(tokens) * H, 0.0);
  for (int t = 0; t < tokens; ++t) {
    std::vector<double> logit(E), prob(E);
    for (int e = 0; e < E; ++e) {
      for (int h = 0; h < H; ++h) logit[e] += static_cast<double>(router[e * H + h]) * x[t * H + h];
    }
    const double mx = *std::max_element(logit.begin(), logit.end());
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += prob[e] = std::exp(logit[e] - mx);
    for (double& p : prob) p /= sum;
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return prob[a] > prob[b]; });
    double top = 0;
    for (int j = 0; j < k; ++j) top += prob[order[j]];
    for (int j = 0; j < k; ++j) {
      const int e = order[j];
      const double w = norm ? prob[e] / top : prob[e];
      std::vector<double> act(I);
      for (int i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int h = 0; h < H; ++h) {
          g += static_cast<double>(ex.gate[e][i * H + h]) * x[t * H + h];
          u += static_cast<double>(ex.up[e][i * H + h]) * x[t * H + h];
        }
        act[i] = g / (1 + std::exp(-g)) * u;
      }
      for (int h = 0; h < H; ++h) {
        double y = 0;
        for (int i = 0; i < I; ++i) y += static_cast<double>(ex.down[e][h * I + i]) * act[i];
        out[t * H + h] += w * y;
      }
    }
  }
  return out;
}

TEST(MoeLayerTest, MatchesReferenceForRandomPlacements) {
  const unsigned seed = std::random_device()();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int E = 12, H = 24, I = 20, K = 3, T = 37;
  Experts ex = random_experts(rng, E, H, I);
  std::vector<float> router(static_cast<size_t>(E) * H), x(static_cast<size_t>(T) * H);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (float& v : router) v = dist(rng);
  for (float& v : x) v = dist(rng);
  ThreadPool pool(3);
  for (bool norm : {true, false}) {
    const std::vector<double> want = reference(x, T, router, ex, K, norm);
    for (int trial = 0; trial < 4; ++trial) {
      // Every expert once, up to 10 extra replicas, a few free slots, shuffled.
      std::vector<int> map(E);
      std::iota(map.begin(), map.end(), 0);
      const int extra = static_cast<int>(rng() % 11);
      for (int r = 0; r < extra; ++r) map.push_back(static_cast<int>(rng() % E));
      for (int f = 0; f < trial; ++f) map.push_back(ExpertPlacement::kFreeSlot);
      std::shuffle(map.begin(), map.end(), rng);
      auto placement = ExpertPlacement::from_slot_maps(E, {map});
      ASSERT_TRUE(placement.ok());
      ExpertSlots slots(DType::kF32, static_cast<int>(map.size()), H, I);
      for (size_t s = 0; s < map.size(); ++s) {
        if (map[s] < 0) continue;
        const int e = map[s];
        ASSERT_TRUE(slots
                        .load(static_cast<int>(s),
                              Tensor::borrow(ex.gate[e].data(), DType::kF32, {I, H}),
                              Tensor::borrow(ex.up[e].data(), DType::kF32, {I, H}),
                              Tensor::borrow(ex.down[e].data(), DType::kF32, {H, I}))
                        .ok());
      }
      std::vector<std::vector<int>> replicas(E);
      for (int e = 0; e < E; ++e) replicas[e] = placement.value().replicas(0, e);
      std::vector<float> out(x.size(), NAN);
      std::vector<int64_t> counts(map.size(), 0);
      MoeWorkspace ws;
      moe_forward_local(x.data(), T, Tensor::borrow(router.data(), DType::kF32, {E, H}),
                        RouterParams{E, K, norm}, replicas, slots, out.data(), &ws, counts.data(),
                        pool);
      double num = 0, den = 0;
      for (size_t i = 0; i < out.size(); ++i) {
        num += (out[i] - want[i]) * (out[i] - want[i]);
        den += want[i] * want[i];
      }
      EXPECT_LT(std::sqrt(num / den), 1e-5) << "trial " << trial << " norm " << norm;
      EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t{0}), int64_t{T} * K);
      for (size_t s = 0; s < map.size(); ++s) {
        if (map[s] < 0) {
          EXPECT_EQ(counts[s], 0);
        }
      }
    }
  }
}

TEST(MoeLayerTest, ReplicasShareTheLoadOfAHotExpert) {
  // Expert 0 in three slots: the rows routed to it spread over all three.
  Routing routing;
  routing.num_tokens = 30;
  routing.top_k = 1;
  routing.slot.resize(30);
  const std::vector<int> reps = {1, 3, 4};
  for (int t = 0; t < 30; ++t) routing.slot[t] = reps[t % 3];
  SlotGroups groups;
  group_by_slot(routing, 5, &groups);
  EXPECT_EQ(groups.offsets, (std::vector<int64_t>{0, 0, 10, 10, 20, 30}));
  for (int p = 0; p < 30; ++p) EXPECT_EQ(groups.pair_of_row[groups.row_of_pair[p]], p);
}

TEST(PlacementTest, ParsesAndValidates) {
  auto id = ExpertPlacement::parse("identity", 3, 8);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(id.value().num_slots(), 8);
  EXPECT_EQ(id.value().replicas(2, 5), std::vector<int>{5});
  auto rep = ExpertPlacement::parse("replicate:4:9", 2, 8);
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ(rep.value().num_slots(), 12);
  for (int l = 0; l < 2; ++l) {
    int total = 0;
    for (int e = 0; e < 8; ++e) total += static_cast<int>(rep.value().replicas(l, e).size());
    EXPECT_EQ(total, 12);
  }
  EXPECT_EQ(ExpertPlacement::parse("replicate:-1", 2, 8).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpertPlacement::parse("/no/such/file.json", 2, 8).status().code(),
            StatusCode::kInvalidArgument);
  // An expert without any replica, an expert id out of range, ragged layers.
  EXPECT_FALSE(ExpertPlacement::from_slot_maps(3, {{0, 1, 1}}).ok());
  EXPECT_FALSE(ExpertPlacement::from_slot_maps(3, {{0, 1, 2, 3}}).ok());
  EXPECT_FALSE(ExpertPlacement::from_slot_maps(3, {{0, 1, 2}, {0, 1, 2, -1}}).ok());
  auto ok = ExpertPlacement::from_slot_maps(3, {{2, -1, 0, 1, 2}});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok.value().replicas(0, 2), (std::vector<int>{0, 4}));
}

}  // namespace
}  // namespace flexpert
