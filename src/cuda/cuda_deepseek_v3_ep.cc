// SPDX-License-Identifier: Apache-2.0
// CudaDeepseekV3Model, expert parallel (see cuda_deepseek_v3.h and ep_moe.h): the device
// segments between MoE layers (a segment after a MoE layer first adds its routed result,
// then its shared experts, as the single-process step does) and the step inputs.
#include <algorithm>
#include <cstring>
#include <string>

#include "cuda/cuda_deepseek_v3.h"
#include "cuda/kernels.h"

namespace flexpert::cuda {

Status CudaDeepseekV3Model::enqueue_segment(int seg, int n, int num_rows) {
  mla_prompt_groups_ = attention_tiles_wanted(n, num_rows);
  const ModelConfig& c = config_;
  cudaStream_t s = stream_.get();
  const int H = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int num_moe = static_cast<int>(moe_layer_ids_.size());
  float* x = x_.as<float>();
  int begin = 0;
  if (seg == 0) {
    FLEX_CUDA_TRY(embedding(dtype_, embed_.data(), in_.ids, n, H, x, s));
  } else {
    // The previous MoE layer: routed result, then its shared experts (h_ still holds
    // that layer's post-attention norm).
    Layer& prev = layers_[moe_layer_ids_[seg - 1]];
    FLEX_RETURN_IF_ERROR(ep_moe_->enqueue_add_output(x, n));
    if (prev.mlp_inter > 0) FLEX_RETURN_IF_ERROR(enqueue_swiglu(prev, n));
    begin = moe_layer_ids_[seg - 1] + 1;
  }
  const int end = seg < num_moe ? moe_layer_ids_[seg] : static_cast<int>(layers_.size());
  for (int l = begin; l <= end && l < static_cast<int>(layers_.size()); ++l) {
    Layer& L = layers_[l];
    FLEX_RETURN_IF_ERROR(enqueue_attention(L, n));
    if (l == end) {  // The MoE layer ending this segment: routed below.
      FLEX_CUDA_TRY(rms_norm(dtype_, x, nullptr, L.post_norm.as<float>(), n, H, eps, h_.data(), s));
      break;
    }
    FLEX_RETURN_IF_ERROR(enqueue_mlp(L, n));  // Dense.
  }
  if (seg == num_moe) return enqueue_head(num_rows);
  Layer& L = layers_[end];
  // DeepSeek's router only; the routed experts run wherever the slots are.
  FLEX_RETURN_IF_ERROR(route_grouped(moe_dims_, router_, L.score_bias.as<float>(), L.weights(),
                                     moe_, h_.data(), n, blas_, s));
  return ep_moe_->enqueue_route_out(n);
}

}  // namespace flexpert::cuda
