// SPDX-License-Identifier: Apache-2.0
// The CPU model for a checkpoint (Qwen3MoeModel or DeepseekV3Model by model_type).
// Model::load (src/factory) calls it for device "cpu"; not an API.
#pragma once

#include <memory>
#include <string>

#include "flexpert/model.h"

namespace flexpert {

Result<std::unique_ptr<Model>> load_cpu_model(const std::string& dir, const ModelOptions& options);

}  // namespace flexpert
