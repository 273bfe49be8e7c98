// SPDX-License-Identifier: Apache-2.0
// EpMoeExecutor: expert-parallel MoE over a Transport.
//
// Global slot s lives on rank s / slots_per_rank. Each rank sends every routed
// (token, k) row to the rank holding its chosen replica (dispatch), computes the
// rows it received grouped by local slot, sends the results back in the order
// received (combine), and sums them per token in k order with the router
// weights. Rows for this rank's own slots never touch the transport. Every
// member runs both exchanges on every MoE layer, with or without tokens. The rows
// a rank computes run on the CPU, or through a RowCompute its model installed (GPU).
// Driven by the model's thread; set_group() between steps. With set_timing(true) it sums
// the time spent exchanging with peers (exchange_ms()); a device exchange adds its own.
#pragma once

#include <functional>
#include <vector>

#include "moe/moe_executor.h"
#include "transport/transport.h"

namespace flexpert {

class EpMoeExecutor final : public MoeExecutor {
 public:
  EpMoeExecutor(Transport& transport, int slots_per_rank, ThreadPool& pool);

  // The members and epoch the next execute() calls exchange with.
  void set_group(Group group) { group_ = std::move(group); }
  const Group& group() const { return group_; }
  // Real tokens of the whole group in the coming step (the sum of the step headers), or 0
  // when unknown: a bound on the rows one rank may receive, for device exchanges.
  void set_step_tokens(int64_t tokens) { step_tokens_ = tokens; }
  int64_t step_tokens() const { return step_tokens_; }
  Transport& transport() const { return transport_; }
  int slots_per_rank() const { return slots_per_rank_; }

  // A device exchange between GPU ranks needs every member's buffers mapped, which takes
  // milliseconds per peer across GPUs. A model that has one installs a probe: whether this
  // rank has mapped every member of the group (if not, it maps a slice of what is missing
  // and answers no). A worker puts device_ready() into its step header and hands the group's
  // answer (every member's yes) to set_group_device_ready(): steps before it run the host
  // exchange, so a membership change never waits for the mapping. Without a worker (the
  // tests that drive models directly) the group counts as ready, and the model maps
  // synchronously at its first device step.
  void set_device_probe(std::function<bool(const Group&)> probe) { probe_ = std::move(probe); }
  bool device_ready() const { return probe_ && probe_(group_); }
  void set_group_device_ready(bool ready) { group_device_ready_ = ready; }
  bool group_device_ready() const { return group_device_ready_; }

  // Bytes one rank may send another in one exchange for `max_tokens` tokens per
  // rank and step: the capacity a transport must be created with.
  static size_t max_exchange_bytes(int64_t max_tokens, int top_k, int64_t hidden);

  // Step timing (`serve --step-timing`, docs/benchmarks.md "Serving with GPU ranks"): when on,
  // every exchange of a group with more than one member adds its wall time to exchange_ms():
  // here from the dispatch's bucketing to the dispatch exchange's return, plus from the
  // combine's packing to its return (the waits for peers included; the rows' compute and
  // the per-token sum excluded). A device exchange adds what its events measured
  // (add_exchange_ms). Alone, a rank exchanges nothing and adds nothing. Off: no clock read.
  void set_timing(bool on) { timing_ = on; }
  bool timing() const { return timing_; }
  void add_exchange_ms(double ms) { exchange_ms_ += ms; }
  double exchange_ms() const { return exchange_ms_; }  // Summed since creation.

  Status execute(int layer, const float* x, const Routing& routing, const ExpertSlots& local_slots,
                 int first_slot, float* out, int64_t* slot_counts) override;
  bool set_row_compute(RowCompute compute) override {
    compute_ = std::move(compute);
    return true;
  }

 private:
  Transport& transport_;
  const int slots_per_rank_;
  ThreadPool& pool_;
  Group group_;
  int64_t step_tokens_ = 0;
  std::function<bool(const Group&)> probe_;
  bool group_device_ready_ = true;
  RowCompute compute_;  // Empty: compute_slots() on the CPU.
  bool timing_ = false;
  double exchange_ms_ = 0;

  // Scratch, reused across calls.
  std::vector<std::vector<int32_t>> pairs_to_;  // [rank] pair indices sent there, in order.
  std::vector<std::vector<char>> send_;         // [rank] dispatch / combine payloads.
  std::vector<int32_t> recv_slot_;              // Local slot of each received row.
  std::vector<const float*> recv_row_;          // Where each received row lives.
  std::vector<int> recv_first_;                 // [rank] index of its first received row.
  std::vector<int> recv_count_;                 // [rank]
  Routing local_routing_;                       // Received rows as pairs for grouping.
  SlotGroups groups_;
  Tensor rows_, results_;
};

}  // namespace flexpert
