// SPDX-License-Identifier: Apache-2.0
// The MoE block split into the phases expert parallelism needs:
//   route     router logits -> softmax -> top-k -> one replica slot per (token, k);
//   permute   (token, k) pairs sorted by slot, rows gathered;
//   compute   grouped GEMMs over the rows of each slot (SwiGLU expert);
//   combine   out[t] = sum_k weight[t, k] * result of (t, k), summed in k order.
// moe_forward_local() chains them in one process. Results do not depend on
// which replica a token uses, nor on the order of slots. Stateless functions;
// scratch lives in the caller's MoeWorkspace (one per thread of model state).
#pragma once

#include <cstdint>
#include <vector>

#include "flexpert/tensor.h"
#include "flexpert/thread_pool.h"
#include "moe/expert_slots.h"

namespace flexpert {

struct RouterParams {
  int num_experts = 0;
  int top_k = 0;
  bool norm_topk_prob = false;
};

// DeepSeek-V2/V3 routers (config: scoring_func, topk_method).
enum class ScoringFunc { kSoftmax, kSigmoid };
enum class TopkMethod {
  kGreedy,              // Top-k of the scores.
  kGroupLimitedGreedy,  // Within the topk_groups groups of highest max score (V2).
  kNoauxTc,             // Scores + correction bias pick; groups ranked by their top-2 sum (V3).
};

struct GroupedRouterParams {
  int num_experts = 0;
  int top_k = 0;
  ScoringFunc scoring = ScoringFunc::kSigmoid;
  TopkMethod method = TopkMethod::kNoauxTc;
  int num_groups = 1;   // Experts [g * E/G, (g + 1) * E/G) form group g.
  int topk_groups = 1;  // Groups kept per token (group-limited methods).
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
};

// Per (token, k), in the router's descending-weight order.
struct Routing {
  int64_t num_tokens = 0;
  int top_k = 0;
  std::vector<int32_t> expert;  // [T * K] logical expert.
  std::vector<float> weight;    // [T * K]
  std::vector<int32_t> slot;    // [T * K] the replica slot chosen.
};

// Rows grouped by slot: rows [offsets[s], offsets[s + 1]) go to slot s.
struct SlotGroups {
  std::vector<int64_t> offsets;      // [num_slots + 1]
  std::vector<int64_t> row_of_pair;  // [T * K] position of pair (t, k) among the sorted rows.
  std::vector<int32_t> pair_of_row;  // [T * K] inverse: which (t * K + k) each sorted row is.
};

struct MoeWorkspace {
  Routing routing;
  SlotGroups groups;
  std::vector<float> logits;  // [T, E]
  Tensor rows;                // [T * K, H] inputs sorted by slot.
  Tensor results;             // [T * K, H] expert outputs, same order.
};

// `replicas[e]` lists the slots holding expert e. A pair (t, k) uses replica
// (t + k) mod count, which spreads a hot expert's tokens over its replicas.
void route(const float* x, int64_t num_tokens, int64_t hidden, const Tensor& router_weight,
           const RouterParams& params, const std::vector<std::vector<int>>& replicas,
           std::vector<float>* logits, Routing* routing, ThreadPool& pool);

// The expert choice of DeepSeek's routers, a pure function of the router logits [T, E]:
// scores = softmax or sigmoid of the logits; choice = scores + correction_bias[e] for
// noaux_tc (bias [E], used for selection only), else scores. Group-limited methods keep
// the topk_groups groups ranked highest (group_limited_greedy: by the group's max choice;
// noaux_tc: by the sum of its two highest) and pick the top_k experts among theirs; greedy
// picks among all. Ties go to the lower index. Weights are the chosen experts' unbiased
// scores, divided by their sum (+1e-20) when norm_topk_prob, times routed_scaling_factor.
// ids/weights: [T, top_k] in descending choice order.
// NOTE: transformers masks the dropped groups' experts to 0 rather than -inf; the two
// differ only when fewer than top_k kept experts have a positive choice. Here dropped
// groups are never picked, as in DeepSeek's and vLLM's implementations.
void select_experts_grouped(const float* logits, int64_t num_tokens, const float* correction_bias,
                            const GroupedRouterParams& params, int32_t* ids, float* weights);

// route() for DeepSeek's routers: router GEMM, select_experts_grouped, replica slots.
void route_grouped(const float* x, int64_t num_tokens, int64_t hidden, const Tensor& router_weight,
                   const float* correction_bias, const GroupedRouterParams& params,
                   const std::vector<std::vector<int>>& replicas, std::vector<float>* logits,
                   Routing* routing, ThreadPool& pool);

void group_by_slot(const Routing& routing, int num_slots, SlotGroups* groups);

// out_rows[r] = down(silu(gate(rows[r])) * up(rows[r])) with the weights of the slot
// owning row r. Rows of slots outside [0, slots.num_slots()) must not exist.
void compute_slots(const float* rows, const std::vector<int64_t>& offsets, const ExpertSlots& slots,
                   float* out_rows, ThreadPool& pool);

// rows[r] = x[token of the pair sorted at r].
void gather_rows(const float* x, int64_t hidden, const SlotGroups& groups, int top_k, float* rows);

void combine(const Routing& routing, const SlotGroups& groups, const float* results, int64_t hidden,
             float* out);

// The whole block in one process; `slot_counts` (if given, [num_slots]) accumulates
// the number of rows each slot computed: the load statistics EPLB reads.
void moe_forward_local(const float* x, int64_t num_tokens, const Tensor& router_weight,
                       const RouterParams& params, const std::vector<std::vector<int>>& replicas,
                       const ExpertSlots& slots, float* out, MoeWorkspace* ws, int64_t* slot_counts,
                       ThreadPool& pool);

}  // namespace flexpert
