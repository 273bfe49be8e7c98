// SPDX-License-Identifier: Apache-2.0
#include "checkpoint/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace flexpert {
namespace {

// YaRN's magnitude correction (transformers' get_mscale / DeepSeek's yarn_get_mscale).
double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// The dimension whose wavelength fits `num_rotations` times into `max_positions`.
double correction_dim(double num_rotations, int dim, double base, double max_positions) {
  return dim * std::log(max_positions / (num_rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(base));
}

}  // namespace

RopeTables rope_tables(const ModelConfig& c, int rotary_dim) {
  RopeTables t;
  const int half = rotary_dim / 2;
  const double base = c.rope_theta;
  t.inv_freq.resize(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) t.inv_freq[i] = std::pow(base, -2.0 * i / rotary_dim);
  const RopeScaling& r = c.rope_scaling;
  if (r.type != "yarn") return t;

  const double factor = r.factor;
  const double original = r.original_max_position_embeddings > 0
                              ? r.original_max_position_embeddings
                              : c.max_position_embeddings;
  if (r.attention_factor > 0) {
    t.attention_factor = r.attention_factor;
  } else if (r.mscale != 0 && r.mscale_all_dim != 0) {
    t.attention_factor = yarn_mscale(factor, r.mscale) / yarn_mscale(factor, r.mscale_all_dim);
  } else {
    t.attention_factor = yarn_mscale(factor, 1.0);
  }
  double low = correction_dim(r.beta_fast, rotary_dim, base, original);
  double high = correction_dim(r.beta_slow, rotary_dim, base, original);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(rotary_dim - 1));
  if (low == high) high += 0.001;  // As transformers: no division by zero.
  for (int i = 0; i < half; ++i) {
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double extrapolation = 1.0 - ramp;  // Weight of the unscaled frequency.
    t.inv_freq[i] = t.inv_freq[i] / factor * (1.0 - extrapolation) + t.inv_freq[i] * extrapolation;
  }
  if (r.mscale_all_dim != 0) {
    const double m = yarn_mscale(factor, r.mscale_all_dim);
    t.softmax_mscale = m * m;
  }
  return t;
}

}  // namespace flexpert
