// SPDX-License-Identifier: Apache-2.0
// The byte floor of a decode step (`flexpert bench generate --floor`): the bytes a step
// must read at least (every weight but the embedding table and the experts; each expert
// slot the batch routed to; the KV cache of every sequence) over the copy bandwidth
// (read + write counted) measured on the same device in the same run.
#pragma once

#include <string>

#include "flexpert/model.h"

namespace flexpert::cli {

struct StepBytes {
  double dense = 0;         // Read by every step: attention, norms, routers, shared experts, head.
  double expert = 0;        // One expert of one layer (all its projections).
  double kv_per_token = 0;  // KV cache of one token, all layers.
  std::string weights_dtype;  // What the byte counts assume per element.
};

// From the checkpoint's tensors, counted in `device_dtype` on a GPU (weights are
// converted at load) or in their stored dtype on the CPU. `fp8_experts`: the routed
// experts stay as stored, e4m3 with their block scales (`--quantization fp8`).
Result<StepBytes> step_bytes(const std::string& dir, const ModelConfig& config,
                             const std::string& device, DType device_dtype,
                             bool fp8_experts = false);

// Read plus written bytes per second of a large device-to-device copy (the GPU) or
// memcpy (the CPU); the best of a few.
Result<double> copy_bytes_per_s(const std::string& device);

}  // namespace flexpert::cli
