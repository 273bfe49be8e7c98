// SPDX-License-Identifier: Apache-2.0
// What every MoE model of flexpert shares around its routed experts: the expert
// placement and its replica lists, this process's slot range, the MoE executor, the
// per-slot row counters EPLB reads, the loading of experts into slots, and the check
// of a step's batch. Owned by one model; driven by the thread that drives it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flexpert/checkpoint.h"
#include "flexpert/model.h"
#include "moe/expert_slots.h"
#include "moe/moe_executor.h"
#include "moe/moe_layer.h"

namespace flexpert {

// InvalidArgument for a kv slot out of range or used twice, an empty chunk, positions
// past `max_seq_len` or a token id outside the vocabulary (see Model::forward).
Status validate_batch(const std::vector<SequenceChunk>& batch, int max_sequences, int max_seq_len,
                      int vocab_size);

// The cache length a model gets: options.max_seq_len, else min(max_position_embeddings, 4096).
int default_max_seq_len(const ModelConfig& config, const ModelOptions& options);

// The batch's token ids in order, and their positions (chunk start + offset).
void flatten_batch(const std::vector<SequenceChunk>& batch, std::vector<int32_t>* ids,
                   std::vector<int32_t>* positions);

// The logits of each chunk's last token: final RMSNorm of its row of x ([tokens, H]
// f32), then the LM head. `logits` becomes [batch, vocab] f32 (reused when it fits).
void last_token_logits(const Tensor& x, const std::vector<SequenceChunk>& batch,
                       const Tensor& final_norm, double eps, const Tensor& lm_head, int vocab_size,
                       ThreadPool& pool, Tensor* logits);

class RoutedExperts {
 public:
  // Takes options.expert_placement, or parses options.placement, over the config's layers
  // and experts; checks the local slot range and picks the executor (options.moe_executor
  // or an in-process one).
  Status init(const ModelConfig& config, const ModelOptions& options, ThreadPool* pool);

  // Allocates MoE layer `layer`'s slot storage (options.allocate_slots, else the heap)
  // and copies into every local slot the expert the placement gives it, read as
  // `prefix` + "E.{gate,up,down}_proj.weight" ([inter, hidden], [inter, hidden],
  // [hidden, inter]). Every expert's tensors must exist; FP8 experts are dequantized
  // to BF16 (block size from the config's quantization).
  Status load_layer(const Checkpoint& checkpoint, const ModelConfig& config, int layer,
                    const std::string& prefix, int64_t hidden, int64_t inter,
                    const ModelOptions& options, ExpertSlots* slots);

  // Copies logical expert `expert` into local slot `local_slot` of `slots` (Model::load_expert).
  Status load_expert(const Checkpoint& checkpoint, const ModelConfig& config, int expert,
                     int local_slot, const std::string& prefix, ExpertSlots* slots) const;

  // Runs routed rows through the executor, counting rows per slot.
  Status execute(int layer, const float* x, const Routing& routing, const ExpertSlots& slots,
                 float* out) {
    return executor_->execute(layer, x, routing, slots, first_slot_, out,
                              slot_counts_[layer].data());
  }

  Status set_placement(ExpertPlacement placement);
  const ExpertPlacement& placement() const { return placement_; }
  // [expert] -> global slots holding it, for `layer`.
  const std::vector<std::vector<int>>& replicas(int layer) const { return replicas_[layer]; }
  const std::vector<std::vector<int64_t>>& slot_counts() const { return slot_counts_; }
  void reset_slot_counts();

 private:
  void rebuild_replicas();

  ThreadPool* pool_ = nullptr;
  ExpertPlacement placement_;
  std::vector<std::vector<std::vector<int>>> replicas_;  // [layer][expert] -> global slots.
  std::vector<std::vector<int64_t>> slot_counts_;        // [layer][global slot]
  int first_slot_ = 0;
  int num_local_slots_ = 0;
  std::unique_ptr<MoeExecutor> own_executor_;  // When options give none.
  MoeExecutor* executor_ = nullptr;
};

}  // namespace flexpert
