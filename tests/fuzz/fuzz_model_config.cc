// SPDX-License-Identifier: Apache-2.0
// config.json: any bytes give a config within the documented bounds, InvalidArgument,
// or Unimplemented. generation_config.json: any bytes give defaults that pass
// SamplingParams' ranges and EOS ids in the vocabulary, or InvalidArgument.
#include <cstddef>
#include <cstdint>
#include <string>

#include "flexpert/logging.h"
#include "flexpert/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  flexpert::ModelConfig base;
  base.vocab_size = 1000;
  const flexpert::Status gen = base.apply_generation_config(text);
  FLEX_CHECK(gen.ok() || gen.code() == flexpert::StatusCode::kInvalidArgument) << gen.to_string();
  const flexpert::SamplingDefaults& d = base.sampling_defaults;
  FLEX_CHECK(d.temperature >= 0 && d.top_p > 0 && d.top_p <= 1 && d.top_k >= 0 && d.top_k <= 1000 &&
             d.repetition_penalty > 0 && d.repetition_penalty <= 2);
  for (int id : base.eos_token_ids) FLEX_CHECK(id >= 0 && id < 1000);
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
