// SPDX-License-Identifier: Apache-2.0
#include "serve/sampling_fields.h"

#include <algorithm>
#include <charconv>
#include <limits>

namespace flexpert {
namespace {

using nlohmann::json;

// Floats beyond this fail as out of range here, before a conversion could be undefined;
// every sampling range is far inside it.
constexpr double kFloatBound = 1e6;

struct Reader {
  const json& body;
  std::string* error_param;

  Status fail(const std::string& field, const std::string& message) {
    *error_param = field;
    return invalid_argument(message);
  }
  // Absent and null (OpenAI clients send explicit nulls for "unset") are alike.
  const json* get(const char* field) {
    auto it = body.find(field);
    return it == body.end() || it->is_null() ? nullptr : &*it;
  }
  // An integer, saturated to int.
  Status integer(const char* field, int* out) {
    const json* v = get(field);
    if (v == nullptr) return Status();
    if (!v->is_number_integer()) return fail(field, std::string(field) + " must be an integer");
    if (v->is_number_unsigned()) {
      *out =
          static_cast<int>(std::min<uint64_t>(v->get<uint64_t>(), std::numeric_limits<int>::max()));
    } else {
      *out = static_cast<int>(std::clamp<int64_t>(
          v->get<int64_t>(), std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
    }
    return Status();
  }
  Status number(const char* field, float* out) {
    const json* v = get(field);
    if (v == nullptr) return Status();
    if (!v->is_number()) return fail(field, std::string(field) + " must be a number");
    const double d = v->get<double>();
    if (!(d >= -kFloatBound && d <= kFloatBound)) {
      return fail(field, std::string(field) + " is out of range");
    }
    *out = static_cast<float>(d);
    return Status();
  }
  Status boolean(const char* field, bool* out) {
    const json* v = get(field);
    if (v == nullptr) return Status();
    if (!v->is_boolean()) return fail(field, std::string(field) + " must be true or false");
    *out = v->get<bool>();
    return Status();
  }
};

// A token id as JSON, saturated to int32 (still outside any vocabulary, which
// validation reports).
int32_t to_id(const json& id) {
  if (id.is_number_unsigned()) {
    return static_cast<int32_t>(
        std::min<uint64_t>(id.get<uint64_t>(), std::numeric_limits<int32_t>::max()));
  }
  return static_cast<int32_t>(std::clamp<int64_t>(
      id.get<int64_t>(), std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()));
}

}  // namespace

const std::set<std::string>& sampling_field_names() {
  static const std::set<std::string> kNames = {"max_tokens",
                                               "max_completion_tokens",
                                               "temperature",
                                               "top_p",
                                               "top_k",
                                               "seed",
                                               "ignore_eos",
                                               "stop_token_ids",
                                               "presence_penalty",
                                               "frequency_penalty",
                                               "repetition_penalty",
                                               "logit_bias",
                                               "min_tokens"};
  return kNames;
}

Status parse_sampling_fields(const nlohmann::json& body, int vocab_size,
                             const SamplingDefaults& defaults, SamplingParams* out, bool* has_seed,
                             std::string* error_param) {
  Reader r{body, error_param};
  SamplingParams p;
  *has_seed = false;
  FLEX_RETURN_IF_ERROR(r.integer("max_tokens", &p.max_tokens));
  FLEX_RETURN_IF_ERROR(r.integer("max_completion_tokens", &p.max_tokens));

  p.temperature = defaults.temperature;
  FLEX_RETURN_IF_ERROR(r.number("temperature", &p.temperature));
  p.top_p = defaults.top_p;
  FLEX_RETURN_IF_ERROR(r.number("top_p", &p.top_p));
  // The sampler works in float: a top_p that rounds to 0 would silently mean "off".
  if (const json* v = r.get("top_p"); v != nullptr && v->get<double>() > 0 && !(p.top_p > 0.0f)) {
    return r.fail("top_p", "top_p must be in (0, 1] and at least 1e-38");
  }
  p.top_k = defaults.top_k;
  FLEX_RETURN_IF_ERROR(r.integer("top_k", &p.top_k));
  if (p.top_k < -1) return r.fail("top_k", "top_k must be >= 1, or 0 / -1 for no limit");
  p.top_k = p.top_k <= 0 ? 0 : std::min(p.top_k, std::max(vocab_size, 1));

  if (const json* seed = r.get("seed")) {
    if (!seed->is_number_integer()) return r.fail("seed", "seed must be an integer");
    // Negative seeds are fine: only the bits matter.
    p.seed = seed->is_number_unsigned() ? seed->get<uint64_t>()
                                        : static_cast<uint64_t>(seed->get<int64_t>());
    *has_seed = true;
  }
  FLEX_RETURN_IF_ERROR(r.boolean("ignore_eos", &p.ignore_eos));
  if (const json* stops = r.get("stop_token_ids")) {
    if (!stops->is_array()) {
      return r.fail("stop_token_ids", "stop_token_ids must be an array of token ids");
    }
    for (const json& id : *stops) {
      if (!id.is_number_integer()) {
        return r.fail("stop_token_ids", "stop_token_ids must contain only integer token ids");
      }
      p.stop_token_ids.push_back(to_id(id));
    }
  }

  FLEX_RETURN_IF_ERROR(r.number("presence_penalty", &p.presence_penalty));
  FLEX_RETURN_IF_ERROR(r.number("frequency_penalty", &p.frequency_penalty));
  p.repetition_penalty = defaults.repetition_penalty;
  FLEX_RETURN_IF_ERROR(r.number("repetition_penalty", &p.repetition_penalty));
  if (const json* bias = r.get("logit_bias")) {
    if (!bias->is_object()) {
      return r.fail("logit_bias", "logit_bias must be an object of token ids to numbers");
    }
    for (const auto& [key, value] : bias->items()) {
      int64_t id = -1;
      const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
      if (ec != std::errc() || end != key.data() + key.size()) {
        return r.fail("logit_bias",
                      "logit_bias keys must be token ids, got '" + key.substr(0, 32) + "'");
      }
      if (!value.is_number()) return r.fail("logit_bias", "logit_bias values must be numbers");
      const double v = value.get<double>();
      if (!(v >= -kFloatBound && v <= kFloatBound)) {
        return r.fail("logit_bias", "logit_bias values must be in [-100, 100]");
      }
      p.logit_bias.emplace_back(to_id(json(id)), static_cast<float>(v));
    }
  }
  FLEX_RETURN_IF_ERROR(r.integer("min_tokens", &p.min_tokens));
  *out = std::move(p);
  return Status();
}

}  // namespace flexpert
