// SPDX-License-Identifier: Apache-2.0
#include "moe/moe_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "flexpert/logging.h"
#include "kernels/cpu_ops.h"
#include "moe/moe_executor.h"

namespace flexpert {
namespace {

// Rows per compute task: enough to reuse a weight panel, few enough to balance.
constexpr int64_t kRowsPerTask = 64;

// Pair (t, k) uses replica (t + k) mod count of its expert.
void assign_replicas(const std::vector<std::vector<int>>& replicas, Routing* routing) {
  const int k = routing->top_k;
  for (int64_t t = 0; t < routing->num_tokens; ++t) {
    for (int j = 0; j < k; ++j) {
      const auto& reps = replicas[routing->expert[t * k + j]];
      FLEX_CHECK(!reps.empty()) << "expert " << routing->expert[t * k + j] << " has no replica";
      routing->slot[t * k + j] = reps[static_cast<size_t>(t + j) % reps.size()];
    }
  }
}

void resize_routing(int64_t num_tokens, int top_k, Routing* routing) {
  routing->num_tokens = num_tokens;
  routing->top_k = top_k;
  routing->expert.resize(static_cast<size_t>(num_tokens * top_k));
  routing->weight.resize(static_cast<size_t>(num_tokens * top_k));
  routing->slot.resize(static_cast<size_t>(num_tokens * top_k));
}

}  // namespace

void select_experts_grouped(const float* logits, int64_t num_tokens, const float* correction_bias,
                            const GroupedRouterParams& params, int32_t* ids, float* weights) {
  const int E = params.num_experts, K = params.top_k;
  const bool grouped = params.method != TopkMethod::kGreedy;
  const int G = grouped ? params.num_groups : 1;
  const int group_size = E / G;
  FLEX_CHECK(G >= 1 && E % G == 0 && params.topk_groups >= 1 && params.topk_groups <= G &&
             K <= (grouped ? params.topk_groups : G) * group_size)
      << "router shape E=" << E << " K=" << K << " G=" << G
      << " topk_groups=" << params.topk_groups;
  FLEX_CHECK(params.method != TopkMethod::kNoauxTc || correction_bias != nullptr);
  std::vector<float> score(E), choice(E), group_score(G);
  std::vector<int32_t> group_order(G), candidates;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* l = logits + t * E;
    if (params.scoring == ScoringFunc::kSoftmax) {
      const float mx = *std::max_element(l, l + E);
      double sum = 0.0;
      for (int e = 0; e < E; ++e) sum += score[e] = std::exp(l[e] - mx);
      for (int e = 0; e < E; ++e) score[e] = static_cast<float>(score[e] / sum);
    } else {
      for (int e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-l[e]));
    }
    for (int e = 0; e < E; ++e) {
      choice[e] = params.method == TopkMethod::kNoauxTc ? score[e] + correction_bias[e] : score[e];
    }
    auto by_choice = [&](int32_t a, int32_t b) {
      return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
    };
    candidates.clear();
    if (!grouped) {
      for (int e = 0; e < E; ++e) candidates.push_back(e);
    } else {
      for (int g = 0; g < G; ++g) {
        const float* c = choice.data() + g * group_size;
        if (params.method == TopkMethod::kGroupLimitedGreedy) {
          group_score[g] = *std::max_element(c, c + group_size);
        } else {  // Sum of the group's two highest (one when a group has one expert).
          float first = -INFINITY, second = -INFINITY;
          for (int i = 0; i < group_size; ++i) {
            if (c[i] > first) {
              second = first;
              first = c[i];
            } else if (c[i] > second) {
              second = c[i];
            }
          }
          group_score[g] = group_size > 1 ? first + second : first;
        }
      }
      std::iota(group_order.begin(), group_order.end(), 0);
      std::partial_sort(group_order.begin(), group_order.begin() + params.topk_groups,
                        group_order.end(), [&](int32_t a, int32_t b) {
                          return group_score[a] > group_score[b] ||
                                 (group_score[a] == group_score[b] && a < b);
                        });
      for (int i = 0; i < params.topk_groups; ++i) {
        for (int e = 0; e < group_size; ++e) candidates.push_back(group_order[i] * group_size + e);
      }
    }
    std::partial_sort(candidates.begin(), candidates.begin() + K, candidates.end(), by_choice);
    double sum = 0.0;
    for (int j = 0; j < K; ++j) sum += score[candidates[j]];
    const double norm = params.norm_topk_prob ? 1.0 / (sum + 1e-20) : 1.0;
    for (int j = 0; j < K; ++j) {
      ids[t * K + j] = candidates[j];
      weights[t * K + j] =
          static_cast<float>(score[candidates[j]] * norm * params.routed_scaling_factor);
    }
  }
}

void route_grouped(const float* x, int64_t num_tokens, int64_t hidden, const Tensor& router_weight,
                   const float* correction_bias, const GroupedRouterParams& params,
                   const std::vector<std::vector<int>>& replicas, std::vector<float>* logits,
                   Routing* routing, ThreadPool& pool) {
  logits->resize(static_cast<size_t>(num_tokens * params.num_experts));
  kernels::matmul_nt(x, num_tokens, hidden, router_weight, logits->data(), pool);
  resize_routing(num_tokens, params.top_k, routing);
  select_experts_grouped(logits->data(), num_tokens, correction_bias, params,
                         routing->expert.data(), routing->weight.data());
  assign_replicas(replicas, routing);
}

void route(const float* x, int64_t num_tokens, int64_t hidden, const Tensor& router_weight,
           const RouterParams& params, const std::vector<std::vector<int>>& replicas,
           std::vector<float>* logits, Routing* routing, ThreadPool& pool) {
  const int k = params.top_k;
  logits->resize(static_cast<size_t>(num_tokens * params.num_experts));
  kernels::matmul_nt(x, num_tokens, hidden, router_weight, logits->data(), pool);
  resize_routing(num_tokens, k, routing);
  kernels::router_topk(logits->data(), num_tokens, params.num_experts, k, params.norm_topk_prob,
                       routing->expert.data(), routing->weight.data());
  assign_replicas(replicas, routing);
}

void group_by_slot(const Routing& routing, int num_slots, SlotGroups* groups) {
  const size_t pairs = routing.slot.size();
  groups->offsets.assign(static_cast<size_t>(num_slots) + 1, 0);
  for (int32_t s : routing.slot) {
    FLEX_CHECK(s >= 0 && s < num_slots) << "slot " << s;
    ++groups->offsets[s + 1];
  }
  for (int s = 0; s < num_slots; ++s) groups->offsets[s + 1] += groups->offsets[s];
  groups->row_of_pair.resize(pairs);
  groups->pair_of_row.resize(pairs);
  std::vector<int64_t> cursor(groups->offsets.begin(), groups->offsets.end() - 1);
  for (size_t p = 0; p < pairs; ++p) {
    const int64_t row = cursor[routing.slot[p]]++;
    groups->row_of_pair[p] = row;
    groups->pair_of_row[row] = static_cast<int32_t>(p);
  }
}

void compute_slots(const float* rows, const std::vector<int64_t>& offsets, const ExpertSlots& slots,
                   float* out_rows, ThreadPool& pool) {
  const int64_t hidden = slots.hidden();
  const int64_t inter = slots.intermediate();
  struct Task {
    int slot;
    int64_t begin, end;
  };
  std::vector<Task> tasks;
  const int num_slots = static_cast<int>(offsets.size()) - 1;
  FLEX_CHECK(num_slots <= slots.num_slots());
  for (int s = 0; s < num_slots; ++s) {
    for (int64_t r = offsets[s]; r < offsets[s + 1]; r += kRowsPerTask) {
      tasks.push_back({s, r, std::min(offsets[s + 1], r + kRowsPerTask)});
    }
  }
  auto run = [&](const Task& task, ThreadPool& inner) {
    const int64_t n = task.end - task.begin;
    std::vector<float> gate(static_cast<size_t>(n * inter)), up(gate.size());
    const float* in = rows + task.begin * hidden;
    kernels::matmul_nt(in, n, hidden, slots.gate(task.slot), gate.data(), inner);
    kernels::matmul_nt(in, n, hidden, slots.up(task.slot), up.data(), inner);
    kernels::silu_mul(gate.data(), up.data(), n * inter, gate.data());
    kernels::matmul_nt(gate.data(), n, inter, slots.down(task.slot), out_rows + task.begin * hidden,
                       inner);
  };
  // Few tasks (decode): parallelise inside each GEMM; many: one task per thread.
  if (static_cast<int64_t>(tasks.size()) < pool.num_threads()) {
    for (const Task& t : tasks) run(t, pool);
  } else {
    pool.parallel_for(static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) run(tasks[i], pool);
    });
  }
}

void combine(const Routing& routing, const SlotGroups& groups, const float* results, int64_t hidden,
             float* out) {
  const int k = routing.top_k;
  for (int64_t t = 0; t < routing.num_tokens; ++t) {
    float* o = out + t * hidden;
    std::fill(o, o + hidden, 0.f);
    for (int j = 0; j < k; ++j) {
      const float w = routing.weight[t * k + j];
      const float* r = results + groups.row_of_pair[t * k + j] * hidden;
      for (int64_t h = 0; h < hidden; ++h) o[h] += w * r[h];
    }
  }
}

void gather_rows(const float* x, int64_t hidden, const SlotGroups& groups, int top_k, float* rows) {
  const int64_t pairs = static_cast<int64_t>(groups.pair_of_row.size());
  for (int64_t r = 0; r < pairs; ++r) {
    const int64_t t = groups.pair_of_row[r] / top_k;
    std::memcpy(rows + r * hidden, x + t * hidden, hidden * sizeof(float));
  }
}

void moe_forward_local(const float* x, int64_t num_tokens, const Tensor& router_weight,
                       const RouterParams& params, const std::vector<std::vector<int>>& replicas,
                       const ExpertSlots& slots, float* out, MoeWorkspace* ws, int64_t* slot_counts,
                       ThreadPool& pool) {
  const int64_t hidden = slots.hidden();
  route(x, num_tokens, hidden, router_weight, params, replicas, &ws->logits, &ws->routing, pool);
  Status s = LocalMoeExecutor(pool).execute(0, x, ws->routing, slots, 0, out, slot_counts);
  FLEX_CHECK(s.ok()) << s.to_string();
}

Status LocalMoeExecutor::execute(int layer, const float* x, const Routing& routing,
                                 const ExpertSlots& local_slots, int first_slot, float* out,
                                 int64_t* slot_counts) {
  const int64_t hidden = local_slots.hidden();
  const int num_slots = local_slots.num_slots();
  // Local slots only: shift global slot ids to the local range.
  Routing& shifted = ws_.routing;
  shifted = routing;
  for (int32_t& s : shifted.slot) {
    s -= first_slot;
    if (s < 0 || s >= num_slots) {
      return failed_precondition("slot " + std::to_string(s + first_slot) +
                                 " is not held by this process");
    }
  }
  group_by_slot(shifted, num_slots, &ws_.groups);
  const int64_t pairs = routing.num_tokens * routing.top_k;
  ensure_f32_rows(&ws_.rows, pairs, hidden);
  ensure_f32_rows(&ws_.results, pairs, hidden);
  gather_rows(x, hidden, ws_.groups, routing.top_k, ws_.rows.data<float>());
  compute_slots(ws_.rows.data<float>(), ws_.groups.offsets, local_slots, ws_.results.data<float>(),
                pool_);
  combine(shifted, ws_.groups, ws_.results.data<float>(), hidden, out);
  if (slot_counts != nullptr) {
    for (int s = 0; s < num_slots; ++s) {
      slot_counts[first_slot + s] += ws_.groups.offsets[s + 1] - ws_.groups.offsets[s];
    }
  }
  return Status();
}

}  // namespace flexpert
