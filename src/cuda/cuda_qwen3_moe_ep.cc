// SPDX-License-Identifier: Apache-2.0
// CudaQwen3MoeModel, expert parallel (see cuda_qwen3_moe.h and ep_moe.h): the device
// segments between MoE layers and the step inputs; DeviceEpMoe does the rest.
#include <algorithm>
#include <cstring>
#include <string>

#include "cuda/cuda_qwen3_moe.h"
#include "cuda/kernels.h"
#include "cuda/step_driver.h"

namespace flexpert::cuda {

Status CudaQwen3MoeModel::init_ep(const ModelOptions& options) {
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (layers_[l].is_moe) moe_layer_ids_.push_back(static_cast<int>(l));
  }
  DeviceEpMoe::Config ep;
  ep.dims = moe_dims_;
  ep.first_slot = first_slot_;
  ep.num_local_slots = num_local_slots_;
  ep.max_tokens = max_step_tokens_;
  ep.moe_layers = moe_layer_ids_;
  ep.layer_slots = [this](int layer) -> const void* {
    if (layer < 0 || layer >= static_cast<int>(layers_.size()) || !layers_[layer].is_moe) {
      return nullptr;
    }
    return layers_[layer].slots.data();
  };
  ep.executor = options.moe_executor;
  ep.mirrors = &mirrors_;
  ep.counts = &slot_counts_;
  FLEX_ASSIGN_OR_RETURN(ep_moe_, DeviceEpMoe::create(std::move(ep), blas_, stream_.get()));
  return Status();
}

Status CudaQwen3MoeModel::enqueue_segment(int seg, int n, int num_rows) {
  const int num_moe = static_cast<int>(moe_layer_ids_.size());
  float* x = x_.as<float>();
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
  // Router and top-k with replica choice only; the experts run wherever the slots are.
  FLEX_RETURN_IF_ERROR(run_moe(moe_dims_, moe_weights(L), moe_, h_.data(), n, nullptr, x,
                               /*accumulate=*/true, blas_, stream_.get(), -1,
                               kMoeRouter | kMoeTopk));
  return ep_moe_->enqueue_route_out(h_.data(), moe_, n);
}

Status CudaQwen3MoeModel::run_ep(const std::vector<SequenceChunk>& batch, float* logits) {
  const int B = static_cast<int>(batch.size());
  const size_t V = static_cast<size_t>(config_.vocab_size);
  const bool decode = B > 0 && std::all_of(batch.begin(), batch.end(), [](const SequenceChunk& c) {
                        return c.tokens.size() == 1;
                      });
  const int bucket = decode && use_graphs_ && !ep_moe_->graphs_failed() ? next_pow2(B) : 0;
  FLEX_ASSIGN_OR_RETURN(EpStepRows rows,
                        fill_step_inputs(batch, bucket, max_step_tokens_, max_rows_, max_sequences_,
                                         host_in_.as<int32_t>()));
  const int n = rows.num_tokens, num_rows = rows.num_rows;
  if (n > 0) FLEX_RETURN_IF_ERROR(upload_inputs(n, num_rows));
  FLEX_RETURN_IF_ERROR(ep_moe_->run_step(
      n, rows.num_real, bucket, use_graphs_,
      [this, n, num_rows](int seg) { return enqueue_segment(seg, n, num_rows); }));
  if (B == 0) return Status();
  FLEX_CUDA_TRY(cudaMemcpyAsync(host_logits_.data(), logits_.data(), B * V * sizeof(float),
                                cudaMemcpyDeviceToHost, stream_.get()));
  FLEX_RETURN_IF_ERROR(stream_.synchronize());
  std::memcpy(logits, host_logits_.data(), B * V * sizeof(float));
  return Status();
}

}  // namespace flexpert::cuda
