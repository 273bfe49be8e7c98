// SPDX-License-Identifier: Apache-2.0
// Model::load: the model class for a checkpoint and a device. It sits above both
// backends (docs/ARCHITECTURE.md, "Modules"): the CPU models of src/model and the
// CUDA models of src/cuda, neither of which includes the other.
#include "flexpert/model.h"

#include "model/cpu_model.h"
#ifdef FLEXPERT_WITH_CUDA
#include "checkpoint/rope.h"
#include "cuda/cuda_deepseek_v3.h"
#include "cuda/cuda_model.h"
#endif

namespace flexpert {

Status check_quantization(const std::string& device, const std::string& quantization) {
  const std::string& q = quantization;
  if (!q.empty() && q != "bf16" && q != "fp8") {
    return invalid_argument("--quantization must be bf16 or fp8, got '" + q + "'");
  }
  if (device == "cpu" && q == "fp8") {
    return invalid_argument(
        "--quantization fp8 on --device cpu: the CPU path dequantizes FP8 weights to bf16 at "
        "load; use --quantization bf16, or --device cuda");
  }
  return Status();
}

Result<std::unique_ptr<Model>> Model::load(const std::string& dir, const ModelOptions& options) {
  const std::string& q = options.quantization;
  FLEX_RETURN_IF_ERROR(check_quantization(options.device, q));
  if (options.device == "cpu") return load_cpu_model(dir, options);
#ifdef FLEXPERT_WITH_CUDA
  auto config = ModelConfig::load(dir);
  if (config.ok() && config->is_deepseek()) {
    return cuda::load_cuda_deepseek_model(dir, options,
                                          rope_tables(*config, config->qk_rope_head_dim));
  }
  if (q == "fp8") {
    return unimplemented(
        "--quantization fp8: FP8 experts on the GPU are implemented for deepseek models only; "
        "use --quantization bf16");
  }
  return cuda::load_cuda_model(dir, options);
#else
  return unimplemented("device '" + options.device + "': this build has no CUDA support");
#endif
}

}  // namespace flexpert
