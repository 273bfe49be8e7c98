// SPDX-License-Identifier: Apache-2.0
// CudaQwen3MoeModel, expert parallel (see cuda_qwen3_moe.h and ep_moe.h): the device
// segments between MoE layers and the step inputs; DeviceEpMoe does the rest.
#include <algorithm>
#include <cstring>
#include <string>

#include "cuda/cuda_qwen3_moe.h"
#include "cuda/kernels.h"

namespace flexpert::cuda {

Status CudaQwen3MoeModel::enqueue_segment(int seg, int n, int num_rows) {
  const int num_moe = static_cast<int>(moe_layer_ids_.size());
  float* x = x_.as<float>();
  attention_tiles_ = attention_tiles_wanted(n, num_rows);
  int begin = 0;
  if (seg == 0) {
    FLEX_CUDA_TRY(
        embedding(dtype_, embed_.data(), in_.ids, n, config_.hidden_size, x, stream_.get()));
  } else {
    FLEX_RETURN_IF_ERROR(ep_moe_->enqueue_add_output(x, n));  // The previous MoE layer's.
    begin = moe_layer_ids_[seg - 1] + 1;
  }
  const int end = seg < num_moe ? moe_layer_ids_[seg] : static_cast<int>(layers_.size());
  for (int l = begin; l < end; ++l) {
    FLEX_RETURN_IF_ERROR(enqueue_attention(layers_[l], n));
    FLEX_RETURN_IF_ERROR(enqueue_mlp(layers_[l], n));
  }
  if (seg == num_moe) return enqueue_head(num_rows);
  Layer& L = layers_[end];
  FLEX_RETURN_IF_ERROR(enqueue_attention(L, n));
  FLEX_CUDA_TRY(rms_norm(dtype_, x, nullptr, L.post_norm.as<float>(), n, config_.hidden_size,
                         static_cast<float>(config_.rms_norm_eps), h_.data(), stream_.get()));
  // Router and top-k with replica choice only; the experts run wherever the slots are.
  // run_moe with FP8 slots runs the whole block whatever the stages (moe_layer.h), so the
  // routing goes through the bf16 path, which reads no slot in these stages.
  MoeDims route_dims = moe_dims_;
  route_dims.fp8 = false;
  FLEX_RETURN_IF_ERROR(run_moe(route_dims, L.weights(), moe_, h_.data(), n, nullptr, x,
                               /*accumulate=*/true, blas_, stream_.get(), -1,
                               kMoeRouter | kMoeTopk));
  return ep_moe_->enqueue_route_out(n);
}

}  // namespace flexpert::cuda
