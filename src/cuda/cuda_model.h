// SPDX-License-Identifier: Apache-2.0
// The entry point Model::load uses for options.device = "cuda" / "cuda:N".
#pragma once

#include <memory>
#include <string>

#include "flexpert/model.h"

namespace flexpert::cuda {

// Loads the checkpoint in DIR onto the GPU named by options.device. InvalidArgument
// for a bad device string or a missing GPU; Unimplemented for model types or shapes
// the CUDA path does not support. Expert parallelism (part of the slots local) needs
// options.moe_executor (InvalidArgument otherwise).
Result<std::unique_ptr<Model>> load_cuda_model(const std::string& dir, const ModelOptions& options);

}  // namespace flexpert::cuda
