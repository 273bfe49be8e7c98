// SPDX-License-Identifier: Apache-2.0
#include "cuda/cuda_model.h"

#include "cuda/cuda_qwen3_moe.h"
#include "cuda/device.h"
#include "flexpert/checkpoint.h"

namespace flexpert::cuda {

Result<std::unique_ptr<Model>> load_cuda_model(const std::string& dir,
                                               const ModelOptions& options) {
  FLEX_ASSIGN_OR_RETURN(int device, parse_device(options.device));
  FLEX_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::load(dir));
  if (config.model_type != "qwen3_moe") {
    return unimplemented("model_type '" + config.model_type + "' has no CUDA implementation");
  }
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::open(dir));
  FLEX_ASSIGN_OR_RETURN(
      auto model, CudaQwen3MoeModel::create(std::move(ckpt), std::move(config), options, device));
  return std::unique_ptr<Model>(std::move(model));
}

}  // namespace flexpert::cuda
