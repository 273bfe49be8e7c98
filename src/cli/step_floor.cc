// SPDX-License-Identifier: Apache-2.0
#include "cli/step_floor.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "flexpert/checkpoint.h"
#ifdef FLEXPERT_WITH_CUDA
#include "cuda/device.h"
#endif

namespace flexpert::cli {

Result<StepBytes> step_bytes(const std::string& dir, const ModelConfig& config,
                             const std::string& device, DType device_dtype, bool fp8_experts) {
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::open(dir));
  const bool gpu = device != "cpu";
  StepBytes out;
  out.weights_dtype = !gpu          ? std::string("as stored")
                      : fp8_experts ? std::string(dtype_name(device_dtype)) + ", fp8 experts"
                                    : std::string(dtype_name(device_dtype));
  double expert_total = 0;
  for (const std::string& name : ckpt->names()) {
    FLEX_ASSIGN_OR_RETURN(Tensor t, ckpt->get(name));
    if (name.find("embed_tokens") != std::string::npos) continue;  // Only the batch's rows.
    const bool expert = name.find(".mlp.experts.") != std::string::npos;
    const bool as_stored = !gpu || (expert && fp8_experts);
    if (name.find("_scale_inv") != std::string::npos && !as_stored) continue;  // Dequantized.
    const double bytes = static_cast<double>(t.numel()) *
                         static_cast<double>(dtype_size(as_stored ? t.dtype() : device_dtype));
    if (expert) {
      expert_total += bytes;
    } else {
      out.dense += bytes;
    }
  }
  const int64_t moe_layers = [&] {
    int64_t n = 0;
    for (int l = 0; l < config.num_hidden_layers; ++l) n += config.is_moe_layer(l) ? 1 : 0;
    return n;
  }();
  if (moe_layers > 0 && config.num_experts > 0) {
    out.expert = expert_total / static_cast<double>(moe_layers * config.num_experts);
  }
  // The KV cache in the compute dtype: K and V per head (GQA), or MLA's latent and rope key.
  const double kv_elems = config.is_deepseek()
                              ? static_cast<double>(config.kv_lora_rank + config.qk_rope_head_dim)
                              : 2.0 * config.num_key_value_heads * config.head_dim;
  out.kv_per_token = kv_elems * config.num_hidden_layers *
                     static_cast<double>(dtype_size(gpu ? device_dtype : DType::kF32));
  return out;
}

Result<double> copy_bytes_per_s(const std::string& device) {
  if (device != "cpu") {
#ifdef FLEXPERT_WITH_CUDA
    FLEX_ASSIGN_OR_RETURN(int id, cuda::parse_device(device));
    FLEX_RETURN_IF_ERROR(cuda::set_device(id));
    return cuda::copy_bytes_per_s(size_t{1} << 31);
#else
    return unimplemented("device '" + device + "': this build has no CUDA support");
#endif
  }
  const size_t n = size_t{256} << 20;
  std::vector<char> a(n, 1), b(n, 0);
  double best = 0;
  for (int i = 0; i < 4; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * static_cast<double>(n) / s);
    std::swap(a, b);
  }
  return best;
}

}  // namespace flexpert::cli
