// SPDX-License-Identifier: Apache-2.0
// MoeExecutor: runs the expert part of an MoE block once tokens are routed.
//
// The model routes (router GEMM, top-k, one replica slot per (token, k)); an
// executor gets the rows to the slots that hold them, runs the experts and
// combines the results with the router weights. LocalMoeExecutor does it in
// one process; EpMoeExecutor exchanges rows with the ranks that own the slots.
// An executor is driven by the thread that drives its model.
#pragma once

#include <cstdint>
#include <functional>

#include "flexpert/status.h"
#include "moe/expert_slots.h"
#include "moe/moe_layer.h"

namespace flexpert {

// Computes expert rows somewhere other than the CPU (e.g. a GPU model's device copy of
// its local slots): row i (`rows[i]`, [H] f32) goes through local slot `local_slot[i]`
// and its output lands in results[i * H, (i + 1) * H), f32, in the order given.
// Called on the executor's (the model's) thread, inside execute().
using RowCompute = std::function<Status(int layer, const int32_t* local_slot,
                                        const float* const* rows, int64_t count, float* results)>;

class MoeExecutor {
 public:
  virtual ~MoeExecutor() = default;
  // Delegates the expert computation to `compute` (nullptr: the CPU, from local_slots).
  // False when this executor always computes on the CPU.
  virtual bool set_row_compute(RowCompute compute) { return false; }
  // x: [routing.num_tokens, H] inputs; out: [num_tokens, H]. `local_slots` holds the
  // slots of this process starting at global slot `first_slot`. `slot_counts`
  // ([global slots]) accumulates rows computed per slot (by this process).
  // Executors that talk to peers run even for zero tokens (lockstep).
  virtual Status execute(int layer, const float* x, const Routing& routing,
                         const ExpertSlots& local_slots, int first_slot, float* out,
                         int64_t* slot_counts) = 0;
};

class LocalMoeExecutor final : public MoeExecutor {
 public:
  explicit LocalMoeExecutor(ThreadPool& pool) : pool_(pool) {}
  Status execute(int layer, const float* x, const Routing& routing, const ExpertSlots& local_slots,
                 int first_slot, float* out, int64_t* slot_counts) override;

 private:
  ThreadPool& pool_;
  MoeWorkspace ws_;
};

}  // namespace flexpert
