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

#include "flexpert/status.h"
#include "moe/expert_slots.h"
#include "moe/moe_layer.h"

namespace flexpert {

class MoeExecutor {
 public:
  virtual ~MoeExecutor() = default;
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
