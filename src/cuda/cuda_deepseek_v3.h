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
// dequantized at load (Checkpoint::get_weight), except the routed experts with
// ModelOptions::quantization "fp8": those stay e4m3 with their block scales in FP8 slots
// (fp8_experts.h; bf16 compute, a GPU of compute capability 8.9 or newer), in one
// process or expert parallel (the owner's rows through the same FP8 kernels, ep_moe.h;
// the host mirror and slot moves carry MoeDims::slot_bytes(), scales included).
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

#include <memory>
#include <string>
#include <vector>

#include "checkpoint/rope.h"
#include "cuda/cuda_moe_model.h"
#include "cuda/grouped_moe.h"
#include "cuda/head_gemm.h"

namespace flexpert::cuda {

// Loads a deepseek_v3 / deepseek_v2 checkpoint onto the GPU named by options.device.
// `rope` holds the config's RoPE frequencies and scales (checkpoint/rope.h rope_tables()
// for qk_rope_head_dim; the factory, src/factory, computes them). Errors as
// load_cuda_model (cuda_model.h).
Result<std::unique_ptr<Model>> load_cuda_deepseek_model(const std::string& dir,
                                                        const ModelOptions& options,
                                                        const RopeTables& rope);

class CudaDeepseekV3Model final : public CudaMoeModel {
 public:
  static Result<std::unique_ptr<CudaDeepseekV3Model>> create(std::unique_ptr<Checkpoint> checkpoint,
                                                             ModelConfig config,
                                                             const ModelOptions& options,
                                                             const RopeTables& rope, int device);
  ~CudaDeepseekV3Model() override;

 private:
  struct Layer : MoeLayer {
    DeviceBuffer input_norm, post_norm;  // f32 [H]
    DeviceBuffer w_a;         // [q_lora_rank (if any) + kv_lora_rank + rope, H]: (q_a; kv_a)
    DeviceBuffer q_a_norm;    // f32 [q_lora_rank]
    DeviceBuffer w_q;         // q_b [heads * (nope + rope), q_lora_rank], or q_proj [.., H]
    DeviceBuffer kv_a_norm;   // f32 [kv_lora_rank]
    DeviceBuffer w_uk_t;      // [heads, kv_lora_rank, nope]: kv_b's key part, transposed
    DeviceBuffer w_uv;        // [heads, v_head_dim, kv_lora_rank]: kv_b's value part
    DeviceBuffer w_o;         // [H, heads * v_head_dim]
    DeviceBuffer kv_cache;    // [max_sequences + 1, max_seq_len, kv_lora_rank + rope]
    DeviceBuffer score_bias;  // f32 [E] (noaux_tc), else empty
    // Dense MLP, or the shared experts of a MoE layer: [2I, H] (gate; up), [H, I].
    DeviceBuffer w_gu, w_down;
    int mlp_inter = 0;  // I above; 0: none.
  };
  CudaDeepseekV3Model(std::unique_ptr<Checkpoint> checkpoint, ModelConfig config,
                      const ModelOptions& options, int device)
      : CudaMoeModel(std::move(checkpoint), std::move(config), options, device) {}
  Status check_config();
  Status load_weights(const ModelOptions& options, const RopeTables& rope);
  Status allocate_scratch();
  // CudaMoeModel's hooks.
  Status load_layer(int index) override;
  MoeLayer& moe_layer(int layer) override { return layers_[layer]; }
  Status enqueue_step(int num_tokens, int num_rows) override;
  Status enqueue_segment(int seg, int n, int num_rows) override;  // cuda_deepseek_v3_ep.cc
  // x += attention(rms_norm(x)) of one layer.
  Status enqueue_attention(Layer& L, int n);
  // x += SwiGLU MLP of h_ (a dense layer's, or a MoE layer's shared experts).
  Status enqueue_swiglu(Layer& L, int n);
  // x += the MLP of rms_norm(x): routed and shared experts, or the dense MLP.
  Status enqueue_mlp(Layer& L, int n);

  // This step is mostly prompt tokens (attention_tiles_wanted): MLA blocks take four.
  bool mla_prompt_groups_ = false;
  float softmax_scale_ = 1.f;
  GroupedRouter router_;
  HeadGemm head_gemm_;  // Bound to stream_.
  std::vector<Layer> layers_;
  // Step scratch.
  DeviceBuffer a_, qa_, q_, q_latent_, latent_, attn_, gu_, act_;
  DeviceBuffer latent_split_;  // Partial softmaxes of split MLA attention (mla_kernels.h).
};

}  // namespace flexpert::cuda
