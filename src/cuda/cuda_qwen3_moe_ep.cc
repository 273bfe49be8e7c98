// SPDX-License-Identifier: Apache-2.0
// CudaQwen3MoeModel, expert parallel (see cuda_qwen3_moe.h and ep_moe.h): the device
// segments between MoE layers and the step inputs; DeviceEpMoe does the rest.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "core/clock.h"
#include "cuda/cuda_qwen3_moe.h"
#include "cuda/kernels.h"
#include "cuda/knobs.h"
#include "flexpert/logging.h"

namespace flexpert::cuda {

void CudaQwen3MoeModel::host_mark(const char* what) {
  if (knobs().step_log_ms < 0) return;
  host_marks_.emplace_back(what, now_ns());
}

Status CudaQwen3MoeModel::enqueue_segment(int seg, int n, int num_rows) {
  host_marks_.clear();
  host_mark("start");
  Status s = enqueue_segment_parts(seg, n, num_rows);
  if (host_marks_.size() > 1) {
    const double ms = (host_marks_.back().second - host_marks_.front().second) / 1e6;
    if (ms > knobs().step_log_ms) {
      std::string parts;
      for (size_t i = 1; i < host_marks_.size(); ++i) {
        char buf[64];
        std::snprintf(buf, sizeof(buf), " %s %.2f", host_marks_[i].first,
                      (host_marks_[i].second - host_marks_[i - 1].second) / 1e6);
        parts += buf;
      }
      FLEX_LOG(INFO) << "segment " << seg << " of " << n << " tokens in " << num_rows
                     << " rows enqueued in " << ms << " ms on the host:" << parts;
    }
  }
  return s;
}

Status CudaQwen3MoeModel::enqueue_segment_parts(int seg, int n, int num_rows) {
  const int num_moe = static_cast<int>(moe_layer_ids_.size());
  float* x = x_.as<float>();
  attention_tiles_ = attention_tiles_wanted(n, num_rows);
  int begin = 0;
  if (seg == 0) {
    FLEX_CUDA_TRY(
        embedding(dtype_, embed_.data(), in_.ids, n, config_.hidden_size, x, stream_.get()));
    host_mark("embedding");
  } else {
    FLEX_RETURN_IF_ERROR(ep_moe_->enqueue_add_output(x, n));  // The previous MoE layer's.
    host_mark("add output");
    begin = moe_layer_ids_[seg - 1] + 1;
  }
  const int end = seg < num_moe ? moe_layer_ids_[seg] : static_cast<int>(layers_.size());
  for (int l = begin; l < end; ++l) {
    FLEX_RETURN_IF_ERROR(enqueue_attention(layers_[l], n));
    FLEX_RETURN_IF_ERROR(enqueue_mlp(layers_[l], n));
    host_mark("mlp");
  }
  if (seg == num_moe) {
    FLEX_RETURN_IF_ERROR(enqueue_head(num_rows));
    host_mark("head");
    return Status();
  }
  Layer& L = layers_[end];
  FLEX_RETURN_IF_ERROR(enqueue_attention(L, n));
  FLEX_CUDA_TRY(rms_norm(dtype_, x, nullptr, L.post_norm.as<float>(), n, config_.hidden_size,
                         static_cast<float>(config_.rms_norm_eps), h_.data(), stream_.get()));
  host_mark("norm");
  // Router and top-k with replica choice only; the experts run wherever the slots are.
  // run_moe with FP8 slots runs the whole block whatever the stages (moe_layer.h), so the
  // routing goes through the bf16 path, which reads no slot in these stages.
  MoeDims route_dims = moe_dims_;
  route_dims.fp8 = false;
  FLEX_RETURN_IF_ERROR(run_moe(route_dims, L.weights(), moe_, h_.data(), n, nullptr, x,
                               /*accumulate=*/true, blas_, stream_.get(), -1,
                               kMoeRouter | kMoeTopk));
  host_mark("router");
  FLEX_RETURN_IF_ERROR(ep_moe_->enqueue_route_out(n));
  host_mark("route out");
  return Status();
}

}  // namespace flexpert::cuda
