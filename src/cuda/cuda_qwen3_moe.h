// SPDX-License-Identifier: Apache-2.0
// CudaQwen3MoeModel: the Qwen3-MoE forward pass on one GPU (see flexpert/model.h).
//
// All weights, the KV cache (max_sequences + 1 slots: the last one absorbs the
// padding rows of captured decode batches) and the step scratch live in device
// memory allocated at load, sized for a step of up to max_step_tokens() tokens;
// longer steps run as consecutive pieces (chunked prefill). Routing tables
// (logical expert -> replica slots) are device buffers sized for the placement's
// slot count: set_placement() rewrites them in place, so captured graphs stay
// valid. Decode steps (one token per sequence) replay a CUDA graph per batch
// bucket (1, 2, 4, ...), captured after the first eager step of that bucket.
// forward() blocks until the logits are on the host. One driver thread (as every
// Model), plus the weight mover calling load_expert / slots_written (own stream).
//
// Expert parallelism (this process holding only part of the slots; options.moe_executor
// set; cuda_qwen3_moe_ep.cc with DeviceEpMoe, ep_moe.h): attention, router and top-k
// with replica choice run on the device; per MoE layer the routed rows, slots and
// weights go to pinned host memory, the executor exchanges them with the peers and
// computes the rows this rank owns through a RowCompute that runs the grouped GEMMs
// over the device copy of the local slots; the combined result goes back up and is
// added on the device. A decode step is then a chain of segments, each replayed from a
// graph per (bucket, segment); map and epoch changes never recapture. With all slots
// local the executor is not used. With options.allocate_slots, the local slots have a
// host mirror there holding the device image (packed as pack_expert, not the CPU
// layout), so peers read it one-sidedly; local_slots() exposes it, slots_written()
// uploads a slot.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "cuda/blas.h"
#include "cuda/device.h"
#include "cuda/ep_moe.h"
#include "cuda/moe_layer.h"
#include "flexpert/checkpoint.h"
#include "flexpert/model.h"
#include "moe/expert_slots.h"
#include "moe/moe_executor.h"

namespace flexpert::cuda {

class CudaQwen3MoeModel final : public Model {
 public:
  static Result<std::unique_ptr<CudaQwen3MoeModel>> create(std::unique_ptr<Checkpoint> checkpoint,
                                                           ModelConfig config,
                                                           const ModelOptions& options, int device);
  ~CudaQwen3MoeModel() override;

  const ModelConfig& config() const override { return config_; }
  const ExpertPlacement& placement() const override { return placement_; }
  int max_sequences() const override { return max_sequences_; }
  int max_seq_len() const override { return max_seq_len_; }
  Status forward(const std::vector<SequenceChunk>& batch, Tensor* logits) override;
  Status forward_step(const std::vector<SequenceChunk>& batch, const std::vector<RowOutput>& rows,
                      Tensor* logits, std::vector<int32_t>* tokens) override;
  const std::vector<std::vector<int64_t>>& slot_counts() const override;
  void reset_slot_counts() override;
  ExpertSlots* local_slots(int layer) override;
  Status set_placement(ExpertPlacement placement) override;
  Status load_expert(int layer, int expert, int local_slot) override;
  Status slots_written(int layer, int local_slot) override;
  Status copy_slot(int layer, int local_slot, int src_rank, int src_slot) override;
  Status warm_up() override;
  int64_t num_graph_captures() const override {
    return graph_captures_ + (ep_moe_ ? ep_moe_->num_graph_captures() : 0);
  }

  DType dtype() const { return dtype_; }
  int max_step_tokens() const { return max_step_tokens_; }

 private:
  friend struct StepDriver;  // Drives steps over these members (cuda/step_driver.h).
  struct Layer {
    DeviceBuffer input_norm, post_norm, q_norm, k_norm;  // f32
    DeviceBuffer w_qkv;                                  // [q_dim + 2 kv_dim, H]
    DeviceBuffer w_o;                                    // [H, q_dim]
    bool is_moe = false;
    DeviceBuffer router;                           // [E, H]
    DeviceBuffer slots;                            // [num_slots][slot_elems]
    DeviceBuffer rep_start, rep_count, rep_slots;  // i32 routing tables
    DeviceBuffer stats;                            // i64 [num_slots]
    DeviceBuffer w_gu, w_down;                     // Dense MLP: [2I, H] (gate; up), [H, I]
    DeviceBuffer k_cache, v_cache;                 // [max_sequences + 1, max_seq_len, nkv, D]
  };
  CudaQwen3MoeModel() = default;
  Status load_weights(const ModelOptions& options);
  Status load_layer(int index, Layer* layer);
  Status load_slots(int index, Layer* layer);
  Status allocate_scratch();
  // Enqueues the whole network for num_tokens tokens and num_rows logits rows.
  Status enqueue_step(int num_tokens, int num_rows);
  // Parts of enqueue_step: x += attention(x); x += the local MoE or dense MLP of
  // post-norm(x) (normalised into h_ unless a fused kernel takes x itself: the expert-
  // parallel path runs its own RMSNorm for the router); final norm + LM head.
  Status enqueue_attention(Layer& L, int n);
  Status enqueue_mlp(Layer& L, int n);
  Status enqueue_head(int num_rows);
  // Expert parallelism (cuda_qwen3_moe_ep.cc).
  Status enqueue_segment(int seg, int n, int num_rows);

  std::unique_ptr<Checkpoint> checkpoint_;
  ModelConfig config_;
  ExpertPlacement placement_;
  int device_ = 0;
  DType dtype_ = DType::kBF16;
  bool use_graphs_ = true;
  int max_sequences_ = 0;
  int max_seq_len_ = 0;
  int max_rows_ = 0;         // Logits rows per step: max_sequences rounded up to a bucket.
  int max_step_tokens_ = 0;  // Tokens per piece.
  MoeDims moe_dims_;

  Stream stream_;
  Blas blas_;  // Bound to stream_; destroyed before it.
  DeviceBuffer embed_, lm_head_, final_norm_, rope_cos_, rope_sin_;
  std::vector<Layer> layers_;
  // Step scratch.
  DeviceBuffer inputs_;
  StepInputs in_{};
  PinnedBuffer host_in_;  // Same layout as inputs_.
  DeviceBuffer x_, h_, qkv_, q_, attn_, gu_, act_, last_h_, logits_;
  DeviceBuffer attn_split_;  // Partial softmaxes of split decode attention (kernels.h).
  // The step being enqueued has chunks of many tokens (AttentionArgs::tiles).
  bool attention_tiles_ = false;
  PinnedBuffer host_logits_;
  DeviceBuffer greedy_keys_;  // argmax_rows' keys per logits row, and their host copy.
  PinnedBuffer host_greedy_keys_;
  DeviceBuffer sample_args_;  // sample_rows' arguments (StepDriver::SampleArgsLayout).
  PinnedBuffer host_sample_args_;
  DeviceBuffer sample_partials_;
  MoeScratch moe_;
  mutable std::vector<std::vector<int64_t>> slot_counts_;
  // Expert parallelism / host mirror of the local slots.
  bool ep_ = false;  // Exchanges through options.moe_executor (not all slots local).
  int first_slot_ = 0;
  int num_local_slots_ = 0;              // Slots in each MoE layer's device buffer.
  std::vector<ExpertSlots> mirrors_;     // [layer]; empty for dense layers or no mirror.
  Stream upload_stream_;                 // The mover thread's (slots_written).
  std::vector<int> moe_layer_ids_;       // Segment s ends at MoE layer moe_layer_ids_[s].
  std::unique_ptr<DeviceEpMoe> ep_moe_;  // Holds graphs: destroyed before the stream.
  std::map<int, GraphExec> graphs_;      // Decode bucket -> graph; destroyed first.
  int64_t graph_captures_ = 0;
};

}  // namespace flexpert::cuda
