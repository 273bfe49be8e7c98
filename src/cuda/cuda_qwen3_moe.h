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
// A block-FP8 checkpoint (Qwen3-*-FP8) has attention and dense MLP weights dequantized to
// bf16 at load; its routed experts too, or with ModelOptions::quantization "fp8" kept e4m3
// with their block scales in FP8 slots (CudaMoeModel, docs/cuda.md "FP8 experts").
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

#include <memory>
#include <vector>

#include "cuda/cuda_moe_model.h"

namespace flexpert::cuda {

class CudaQwen3MoeModel final : public CudaMoeModel {
 public:
  static Result<std::unique_ptr<CudaQwen3MoeModel>> create(std::unique_ptr<Checkpoint> checkpoint,
                                                           ModelConfig config,
                                                           const ModelOptions& options, int device);
  ~CudaQwen3MoeModel() override;

 private:
  struct Layer : MoeLayer {
    DeviceBuffer input_norm, post_norm, q_norm, k_norm;  // f32
    DeviceBuffer w_qkv;                                  // [q_dim + 2 kv_dim, H]
    DeviceBuffer w_o;                                    // [H, q_dim]
    DeviceBuffer w_gu, w_down;                           // Dense MLP: [2I, H] (gate; up), [H, I]
    DeviceBuffer k_cache, v_cache;                       // [max_sequences + 1, max_seq_len, nkv, D]
  };
  CudaQwen3MoeModel(std::unique_ptr<Checkpoint> checkpoint, ModelConfig config,
                    const ModelOptions& options, int device)
      : CudaMoeModel(std::move(checkpoint), std::move(config), options, device) {}
  Status check_config() const;
  Status load_weights(const ModelOptions& options);
  Status allocate_scratch();
  // CudaMoeModel's hooks.
  Status load_layer(int index) override;
  MoeLayer& moe_layer(int layer) override { return layers_[layer]; }
  Status enqueue_step(int num_tokens, int num_rows) override;
  Status enqueue_segment(int seg, int n, int num_rows) override;  // cuda_qwen3_moe_ep.cc
  Status enqueue_segment_parts(int seg, int n, int num_rows);
  // Parts of enqueue_step: x += attention(x); x += the local MoE or dense MLP of
  // post-norm(x) (normalised into h_ unless a fused kernel takes x itself: the expert-
  // parallel path runs its own RMSNorm for the router).
  Status enqueue_attention(Layer& L, int n);
  Status enqueue_mlp(Layer& L, int n);

  std::vector<Layer> layers_;
  // Step scratch.
  DeviceBuffer qkv_, q_, attn_, gu_, act_;
  DeviceBuffer attn_split_;  // Partial softmaxes of split decode attention (kernels.h).
  // The step being enqueued has chunks of many tokens (AttentionArgs::tiles).
  bool attention_tiles_ = false;
  // With FLEXPERT_STEP_LOG_MS: the host's time in each call of a segment's enqueue, logged
  // when the segment took longer than that to enqueue (where a slow step's host time goes).
  void host_mark(const char* what);
  std::vector<std::pair<const char*, int64_t>> host_marks_;
};

}  // namespace flexpert::cuda
