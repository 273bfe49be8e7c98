// SPDX-License-Identifier: Apache-2.0
// DeepSeek's grouped routers (select_experts_grouped) against a float64 reference
// written here from the rules alone, for the V3 (sigmoid, noaux_tc), V2
// (softmax, group_limited_greedy) and V2-Lite (softmax, greedy) settings.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <random>
#include <set>

#include "moe/moe_layer.h"

namespace flexpert {
namespace {

struct RefChoice {
  std::vector<int> ids;
  std::vector<double> weights;
  double margin;  // Smallest gap that decided the choice (groups or experts).
};

RefChoice reference(const float* logits, const float* bias, const GroupedRouterParams& p) {
  const int E = p.num_experts;
  std::vector<double> score(E), choice(E);
  if (p.scoring == ScoringFunc::kSoftmax) {
    double mx = -INFINITY, sum = 0;
    for (int e = 0; e < E; ++e) mx = std::max(mx, static_cast<double>(logits[e]));
    for (int e = 0; e < E; ++e) sum += score[e] = std::exp(logits[e] - mx);
    for (double& s : score) s /= sum;
  } else {
    for (int e = 0; e < E; ++e) score[e] = 1 / (1 + std::exp(-static_cast<double>(logits[e])));
  }
  for (int e = 0; e < E; ++e) {
    choice[e] = score[e] + (p.method == TopkMethod::kNoauxTc ? static_cast<double>(bias[e]) : 0.0);
  }
  double margin = INFINITY;
  std::vector<int> allowed(E);
  std::iota(allowed.begin(), allowed.end(), 0);
  if (p.method != TopkMethod::kGreedy) {
    const int size = E / p.num_groups;
    std::vector<std::pair<double, int>> groups;
    for (int g = 0; g < p.num_groups; ++g) {
      std::vector<double> c(choice.begin() + g * size, choice.begin() + (g + 1) * size);
      std::sort(c.rbegin(), c.rend());
      groups.push_back({p.method == TopkMethod::kNoauxTc ? c[0] + c[1] : c[0], g});
    }
    std::sort(groups.begin(), groups.end(), [](auto a, auto b) { return a.first > b.first; });
    if (p.topk_groups < p.num_groups) {
      margin = groups[p.topk_groups - 1].first - groups[p.topk_groups].first;
    }
    allowed.clear();
    for (int i = 0; i < p.topk_groups; ++i) {
      for (int e = 0; e < size; ++e) allowed.push_back(groups[i].second * size + e);
    }
  }
  std::sort(allowed.begin(), allowed.end(), [&](int a, int b) { return choice[a] > choice[b]; });
  if (static_cast<int>(allowed.size()) > p.top_k) {
    margin = std::min(margin, choice[allowed[p.top_k - 1]] - choice[allowed[p.top_k]]);
  }
  RefChoice r{{allowed.begin(), allowed.begin() + p.top_k}, {}, margin};
  double sum = 0;
  for (int e : r.ids) sum += score[e];
  for (int e : r.ids) {
    r.weights.push_back(score[e] / (p.norm_topk_prob ? sum : 1.0) * p.routed_scaling_factor);
  }
  return r;
}

void check_router(const GroupedRouterParams& p, std::mt19937& rng, int num_tokens) {
  std::normal_distribution<float> logit_dist(0.f, 2.f), bias_dist(0.f, 0.1f);
  std::vector<float> logits(static_cast<size_t>(num_tokens) * p.num_experts);
  std::vector<float> bias(p.num_experts);
  for (float& v : logits) v = logit_dist(rng);
  for (float& v : bias) v = bias_dist(rng);
  std::vector<int32_t> ids(static_cast<size_t>(num_tokens) * p.top_k);
  std::vector<float> weights(ids.size());
  select_experts_grouped(logits.data(), num_tokens, bias.data(), p, ids.data(), weights.data());
  int near_ties = 0;
  for (int t = 0; t < num_tokens; ++t) {
    const RefChoice want = reference(logits.data() + t * p.num_experts, bias.data(), p);
    const std::vector<int> got(ids.begin() + t * p.top_k, ids.begin() + (t + 1) * p.top_k);
    // The order among the chosen may differ where two of them nearly tie; the set may
    // differ only where the choice itself nearly ties (float32 vs float64).
    std::vector<int> got_set = got, want_set = want.ids;
    std::sort(got_set.begin(), got_set.end());
    std::sort(want_set.begin(), want_set.end());
    if (got_set != want_set) {
      ASSERT_LT(want.margin, 1e-5) << "token " << t;
      ++near_ties;
      continue;
    }
    for (int j = 0; j < p.top_k; ++j) {
      const int k =
          static_cast<int>(std::find(want.ids.begin(), want.ids.end(), got[j]) - want.ids.begin());
      ASSERT_NEAR(weights[t * p.top_k + j], want.weights[k], 1e-6 * (1 + want.weights[k]))
          << "token " << t << " k " << j;
    }
    if (p.method != TopkMethod::kGreedy) {
      std::set<int> groups;
      for (int e : got) groups.insert(e / (p.num_experts / p.num_groups));
      EXPECT_LE(static_cast<int>(groups.size()), p.topk_groups);
    }
  }
  EXPECT_LT(near_ties, num_tokens / 100 + 1);
}

TEST(GroupedRouterTest, MatchesFloat64ReferenceForEachFamily) {
  const char* env = std::getenv("FLEXPERT_TEST_SEED");
  const unsigned seed =
      env ? static_cast<unsigned>(std::strtoul(env, nullptr, 10)) : std::random_device()();
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with FLEXPERT_TEST_SEED)");
  std::mt19937 rng(seed);
  // DeepSeek-V3: sigmoid scores, bias-corrected choice, 8 groups ranked by top-2 sums.
  check_router({256, 8, ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, 8, 4, true, 2.5f}, rng, 300);
  // Small groups and no normalisation.
  check_router({32, 4, ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, 4, 2, false, 1.0f}, rng, 300);
  // DeepSeek-V2: softmax, groups ranked by their max, weights scaled.
  check_router({160, 6, ScoringFunc::kSoftmax, TopkMethod::kGroupLimitedGreedy, 8, 3, false, 16.f},
               rng, 300);
  // DeepSeek-V2-Lite: softmax top-k over all experts.
  check_router({64, 6, ScoringFunc::kSoftmax, TopkMethod::kGreedy, 1, 1, false, 1.0f}, rng, 300);
  check_router({64, 6, ScoringFunc::kSigmoid, TopkMethod::kGreedy, 1, 1, true, 1.0f}, rng, 300);
}

TEST(GroupedRouterTest, BiasPicksButDoesNotWeigh) {
  // Expert 3 scores lowest but its correction bias makes it the pick; its weight is
  // still its own sigmoid score (times the scaling factor).
  const float logits[4] = {1.0f, 0.5f, 0.0f, -0.5f};
  const float bias[4] = {0.0f, 0.0f, 0.0f, 1.0f};
  int32_t id = -1;
  float w = 0;
  select_experts_grouped(logits, 1, bias,
                         {4, 1, ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, 1, 1, false, 2.0f},
                         &id, &w);
  EXPECT_EQ(id, 3);
  EXPECT_FLOAT_EQ(w, 2.0f / (1.0f + std::exp(0.5f)));
}

TEST(GroupedRouterTest, DroppedGroupsAreNeverPicked) {
  // Group 1 (experts 2, 3) wins on its top-2 sum although expert 0 has the top choice;
  // with one group kept, expert 0 is out even where the kept experts score below zero.
  const float logits[4] = {0, 0, 0, 0};
  const float bias[4] = {1.0f, -3.0f, -0.6f, -0.65f};  // Sums: group 0 -1.0, group 1 -0.25.
  int32_t ids[2];
  float w[2];
  select_experts_grouped(logits, 1, bias,
                         {4, 2, ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, 2, 1, true, 1.0f}, ids,
                         w);
  EXPECT_EQ(ids[0], 2);
  EXPECT_EQ(ids[1], 3);
  EXPECT_FLOAT_EQ(w[0] + w[1], 1.0f);
}

TEST(GroupedRouterTest, RouteGroupedAssignsReplicaSlots) {
  const int E = 8, H = 4, T = 5;
  std::vector<float> x(T * H, 1.0f), router(E * H, 0.0f), bias(E, 0.0f);
  for (int e = 0; e < E; ++e) router[e * H] = static_cast<float>(e);  // Expert 7 wins.
  std::vector<std::vector<int>> replicas(E);
  for (int e = 0; e < E; ++e) replicas[e] = {e};
  replicas[7] = {7, 9, 11};
  std::vector<float> logits;
  Routing routing;
  ThreadPool pool(2);
  route_grouped(x.data(), T, H, Tensor::borrow(router.data(), DType::kF32, {E, H}), bias.data(),
                {E, 1, ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, 2, 1, true, 1.0f}, replicas,
                &logits, &routing, pool);
  ASSERT_EQ(routing.num_tokens, T);
  for (int t = 0; t < T; ++t) {
    EXPECT_EQ(routing.expert[t], 7);
    EXPECT_EQ(routing.slot[t], replicas[7][t % 3]);
    EXPECT_FLOAT_EQ(routing.weight[t], 1.0f);
  }
}

}  // namespace
}  // namespace flexpert
