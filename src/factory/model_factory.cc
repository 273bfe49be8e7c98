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
#include "cuda/fp8_experts.h"
#include "flexpert/logging.h"
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

#ifdef FLEXPERT_WITH_CUDA
namespace {

// No --quantization: the checkpoint's default on a GPU (FP8 experts for a block-FP8 checkpoint),
// where it can run; else bf16, saying why (asking for fp8 there fails the load instead).
std::string default_gpu_quantization(const ModelConfig& config, const ModelOptions& options) {
  if (config.default_gpu_quantization() != "fp8") return "bf16";
  std::string why;
  Result<int> device = cuda::parse_device(options.device);
  if (options.device_dtype != DType::kBF16) {
    why = "--cuda-dtype is not bf16";
  } else if (!device.ok() || !cuda::fp8_device_supported(device.value())) {
    why = "the GPU is below compute capability 8.9";
  }
  if (!why.empty()) {
    FLEX_LOG(INFO) << "block-FP8 checkpoint: routed experts dequantized to bf16 (" << why << ")";
    return "bf16";
  }
  return "fp8";
}

}  // namespace
#endif

Result<std::unique_ptr<Model>> Model::load(const std::string& dir, const ModelOptions& options) {
  const std::string& q = options.quantization;
  FLEX_RETURN_IF_ERROR(check_quantization(options.device, q));
  if (options.device == "cpu") return load_cpu_model(dir, options);
#ifdef FLEXPERT_WITH_CUDA
  FLEX_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::load(dir));
  ModelOptions resolved = options;
  if (q.empty()) resolved.quantization = default_gpu_quantization(config, options);
  if (config.is_deepseek()) {
    return cuda::load_cuda_deepseek_model(dir, resolved,
                                          rope_tables(config, config.qk_rope_head_dim));
  }
  return cuda::load_cuda_model(dir, resolved);
#else
  return unimplemented("device '" + options.device + "': this build has no CUDA support");
#endif
}

}  // namespace flexpert
