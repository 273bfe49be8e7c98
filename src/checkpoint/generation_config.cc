// SPDX-License-Identifier: Apache-2.0
// generation_config.json: extra EOS ids and the sampling defaults (ModelConfig).
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "flexpert/model_config.h"

namespace flexpert {
namespace {

using nlohmann::json;

Status bad(const char* field, const std::string& what) {
  return invalid_argument("generation_config.json: field '" + std::string(field) + "' " + what);
}

// A number field in [lo, hi] (lo excluded when `open_lo`); absent or null leaves *out.
Status read_number(const json& j, const char* field, double lo, double hi, bool open_lo,
                   float* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return Status();
  if (!it->is_number()) return bad(field, "must be a number");
  const double v = it->get<double>();
  if (!(open_lo ? v > lo : v >= lo) || !(v <= hi)) {
    return bad(field, "must be in " + std::string(open_lo ? "(" : "[") + std::to_string(lo) + ", " +
                          std::to_string(hi) + "]");
  }
  *out = static_cast<float>(v);
  return Status();
}

}  // namespace

Status ModelConfig::apply_generation_config(const std::string& text) {
  FLEX_RETURN_IF_ERROR(check_json_nesting(text, "generation_config.json"));
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return invalid_argument("generation_config.json is not a JSON object");
  }
  SamplingDefaults d = sampling_defaults;
  // The sampling parameters' own ranges (SamplingParams::validate), so that a default
  // never makes a request invalid.
  FLEX_RETURN_IF_ERROR(read_number(j, "temperature", 0.0, 1e6, false, &d.temperature));
  FLEX_RETURN_IF_ERROR(read_number(j, "top_p", 0.0, 1.0, true, &d.top_p));
  FLEX_RETURN_IF_ERROR(read_number(j, "repetition_penalty", 0.0, 2.0, true, &d.repetition_penalty));
  if (auto it = j.find("top_k"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer()) return bad("top_k", "must be an integer");
    const int64_t k = it->get<int64_t>();
    if (k < -1) return bad("top_k", "must be >= 0 (or -1: no limit)");
    d.top_k = static_cast<int>(std::clamp<int64_t>(k, 0, std::max(vocab_size, 0)));
  }
  std::vector<int> eos;
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    const json list = it->is_array() ? *it : json::array({*it});
    for (const json& id : list) {
      if (!id.is_number_integer())
        return bad("eos_token_id", "must be an integer or a list of them");
      const int64_t v = id.get<int64_t>();
      if (v < 0 || v >= vocab_size) {
        return bad("eos_token_id", "holds " + std::to_string(v) + ", outside the vocabulary of " +
                                       std::to_string(vocab_size));
      }
      eos.push_back(static_cast<int>(v));
    }
  }
  for (int id : eos) {
    if (std::find(eos_token_ids.begin(), eos_token_ids.end(), id) == eos_token_ids.end()) {
      eos_token_ids.push_back(id);
    }
  }
  sampling_defaults = d;
  return Status();
}

}  // namespace flexpert
