// SPDX-License-Identifier: Apache-2.0
// CudaDeepseekV3Model: the DeepSeek-V3 / V2 forward pass (model/deepseek_v3.h) on one
// GPU, for model_type deepseek_v3 and deepseek_v2 (see flexpert/model.h).
//
// Attention is MLA in the absorbed form at every step (prefill and decode): the KV
// cache holds per token only the normalised latent and the rotated rope key
// (kv_lora_rank + qk_rope_head_dim values in the compute dtype, max_sequences + 1 slots:
// the last one absorbs the padding rows of captured decode batches). q_nope is mapped
// into the latent space through kv_b's key part and the weighted latent out through its
// value part (per-head batched GEMMs). RoPE is plain or interleaved, with YaRN, as the
// CPU model. Layers below first_k_dense_replace run a dense SwiGLU MLP; MoE layers run
// DeepSeek's grouped router, the grouped expert GEMMs of the Qwen3 path, and the shared
// experts as one dense SwiGLU added to the routed output. FP8 checkpoints are
// dequantized at load (Checkpoint::get_weight).
//
// As CudaQwen3MoeModel: weights, cache and step scratch are allocated at load for
// steps of up to max_step_tokens() tokens (longer steps run as consecutive pieces);
// routing tables are device buffers that set_placement() rewrites in place; decode
// steps replay a CUDA graph per batch bucket (1, 2, 4, ...), captured after the
// bucket's first eager step. forward() blocks until the logits are on the host. One
// driver thread, plus the weight mover calling load_expert / slots_written (own stream).
// Expert parallelism, the host slot mirror and local_slots() as CudaQwen3MoeModel
// (cuda_deepseek_v3_ep.cc, ep_moe.h); the shared experts of a MoE layer run on every
// rank, added after the routed result as in one process.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/rope.h"
#include "cuda/blas.h"
#include "cuda/device.h"
#include "cuda/ep_moe.h"
#include "cuda/grouped_moe.h"
#include "cuda/head_gemm.h"
#include "cuda/moe_layer.h"
#include "flexpert/checkpoint.h"
#include "flexpert/model.h"

namespace flexpert::cuda {

// Loads a deepseek_v3 / deepseek_v2 checkpoint onto the GPU named by options.device.
// `rope` holds the config's RoPE frequencies and scales (checkpoint/rope.h rope_tables()
// for qk_rope_head_dim; the factory, src/factory, computes them). Errors as
// load_cuda_model (cuda_model.h).
Result<std::unique_ptr<Model>> load_cuda_deepseek_model(const std::string& dir,
                                                        const ModelOptions& options,
                                                        const RopeTables& rope);

class CudaDeepseekV3Model final : public Model {
 public:
  static Result<std::unique_ptr<CudaDeepseekV3Model>> create(std::unique_ptr<Checkpoint> checkpoint,
                                                             ModelConfig config,
                                                             const ModelOptions& options,
                                                             const RopeTables& rope, int device);
  ~CudaDeepseekV3Model() override;

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
    DeviceBuffer input_norm, post_norm;  // f32 [H]
    DeviceBuffer w_a;        // [q_lora_rank (if any) + kv_lora_rank + rope, H]: (q_a; kv_a)
    DeviceBuffer q_a_norm;   // f32 [q_lora_rank]
    DeviceBuffer w_q;        // q_b [heads * (nope + rope), q_lora_rank], or q_proj [.., H]
    DeviceBuffer kv_a_norm;  // f32 [kv_lora_rank]
    DeviceBuffer w_uk_t;     // [heads, kv_lora_rank, nope]: kv_b's key part, transposed
    DeviceBuffer w_uv;       // [heads, v_head_dim, kv_lora_rank]: kv_b's value part
    DeviceBuffer w_o;        // [H, heads * v_head_dim]
    DeviceBuffer kv_cache;   // [max_sequences + 1, max_seq_len, kv_lora_rank + rope]
    bool is_moe = false;
    DeviceBuffer router;                           // [E, H]
    DeviceBuffer score_bias;                       // f32 [E] (noaux_tc), else empty
    DeviceBuffer slots;                            // [num_slots][slot_elems]
    DeviceBuffer rep_start, rep_count, rep_slots;  // i32 routing tables
    DeviceBuffer stats;                            // i64 [num_slots]
    // Dense MLP, or the shared experts of a MoE layer: [2I, H] (gate; up), [H, I].
    DeviceBuffer w_gu, w_down;
    int mlp_inter = 0;  // I above; 0: none.
  };
  CudaDeepseekV3Model() = default;
  Status check_config(const ModelOptions& options);
  Status load_weights(const ModelOptions& options, const RopeTables& rope);
  Status load_layer(int index, Layer* layer);
  Status load_slots(int index, Layer* layer);
  // Expert `expert` of layer `layer` packed into a slot image (pack_expert's layout).
  Status pack_slot(int layer, int expert, uint8_t* image) const;
  Result<Tensor> weight(const std::string& name, const Shape& shape) const;
  Status allocate_scratch();
  // x += attention(rms_norm(x)) of one layer.
  Status enqueue_attention(Layer& L, int n);
  // x += SwiGLU MLP of h_ (a dense layer's, or a MoE layer's shared experts).
  Status enqueue_swiglu(Layer& L, int n);
  // x += the MLP of rms_norm(x): routed and shared experts, or the dense MLP.
  Status enqueue_mlp(Layer& L, int n);
  Status enqueue_step(int num_tokens, int num_rows);
  // Expert parallelism (cuda_deepseek_v3_ep.cc).
  Status enqueue_segment(int seg, int n, int num_rows);

  std::unique_ptr<Checkpoint> checkpoint_;
  ModelConfig config_;
  ExpertPlacement placement_;
  int device_ = 0;
  DType dtype_ = DType::kBF16;
  bool use_graphs_ = true;
  // This step is mostly prompt tokens (attention_tiles_wanted): MLA blocks take four.
  bool mla_prompt_groups_ = false;
  int max_sequences_ = 0;
  int max_seq_len_ = 0;
  int max_rows_ = 0;         // Logits rows per step: max_sequences rounded up to a bucket.
  int max_step_tokens_ = 0;  // Tokens per piece.
  float softmax_scale_ = 1.f;
  MoeDims moe_dims_;
  GroupedRouter router_;

  Stream stream_;
  Blas blas_;           // Bound to stream_; destroyed before it.
  HeadGemm head_gemm_;  // Likewise.
  DeviceBuffer embed_, lm_head_, final_norm_, rope_cos_, rope_sin_;
  std::vector<Layer> layers_;
  // Step scratch.
  DeviceBuffer inputs_;
  StepInputs in_{};
  PinnedBuffer host_in_;  // Same layout as inputs_.
  DeviceBuffer x_, h_, a_, qa_, q_, q_latent_, latent_, attn_, gu_, act_, last_h_, logits_;
  DeviceBuffer latent_split_;  // Partial softmaxes of split MLA attention (mla_kernels.h).
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
