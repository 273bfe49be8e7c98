// SPDX-License-Identifier: Apache-2.0
// config.json: any bytes give a config within the documented bounds, InvalidArgument,
// or Unimplemented.
#include <cstddef>
#include <cstdint>
#include <string>

#include "flexpert/logging.h"
#include "flexpert/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = flexpert::ModelConfig::from_json(text);
  if (!config.ok()) {
    // Unimplemented: a well-formed feature flexpert does not support (a rope type).
    const flexpert::StatusCode code = config.status().code();
    FLEX_CHECK(code == flexpert::StatusCode::kInvalidArgument ||
               code == flexpert::StatusCode::kUnimplemented)
        << config.status().to_string();
    return 0;
  }
  FLEX_CHECK(config->num_hidden_layers > 0 && config->num_hidden_layers <= 1024);
  FLEX_CHECK(config->num_experts >= 0 && config->num_experts <= 16384);
  for (int layer = 0; layer < config->num_hidden_layers; ++layer) (void)config->is_moe_layer(layer);
  (void)config->to_json();
  return 0;
}
