// SPDX-License-Identifier: Apache-2.0
// RoPE frequencies and scales of a config, as transformers computes them: plain
// theta^(-2i/d), or YaRN (`rope_scaling.type == "yarn"`: frequencies blended between
// interpolation and extrapolation by a linear ramp over the dimensions, cos/sin scaled
// by the attention factor, and for DeepSeek's MLA the softmax scale multiplied by
// mscale(factor, mscale_all_dim)^2). Pure functions.
#pragma once

#include <vector>

#include "flexpert/model_config.h"

namespace flexpert {

struct RopeTables {
  std::vector<double> inv_freq;   // [rotary_dim / 2]
  double attention_factor = 1.0;  // Multiplies cos and sin.
  double softmax_mscale = 1.0;    // Multiplies MLA's softmax scale (1 without YaRN).
};

RopeTables rope_tables(const ModelConfig& config, int rotary_dim);

}  // namespace flexpert
