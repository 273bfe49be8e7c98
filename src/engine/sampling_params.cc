// SPDX-License-Identifier: Apache-2.0
// SamplingParams' rules and the one validation of a request (include/flexpert/generate.h).
// Depends on core only, so that the request parsers' fuzz targets link it alone.
#include <cmath>
#include <string>

#include "flexpert/generate.h"

namespace flexpert {
namespace {

Status field_error(std::string* field, const char* name, const std::string& message) {
  if (field != nullptr) *field = name;
  return invalid_argument(message);
}

bool in_vocab(int32_t id, int vocab_size) {
  return id >= 0 && (vocab_size <= 0 || id < vocab_size);
}

std::string vocab_range(int vocab_size) {
  return vocab_size > 0 ? "[0, " + std::to_string(vocab_size) + ")" : "[0, ...)";
}

}  // namespace

Status SamplingParams::validate(int vocab_size, std::string* field) const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    return field_error(field, "temperature", "temperature must be a finite number >= 0");
  }
  if (top_k < 0) return field_error(field, "top_k", "top_k must be >= 0");
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return field_error(field, "top_p", "top_p must be in (0, 1]");
  }
  if (max_tokens < 1) return field_error(field, "max_tokens", "max_tokens must be >= 1");
  for (int32_t id : stop_token_ids) {
    if (!in_vocab(id, vocab_size)) {
      return field_error(field, "stop_token_ids",
                         "stop_token_ids contains token id " + std::to_string(id) +
                             " outside the vocabulary " + vocab_range(vocab_size));
    }
  }
  if (!(repetition_penalty > 0.0f && repetition_penalty <= 2.0f)) {
    return field_error(field, "repetition_penalty", "repetition_penalty must be in (0, 2]");
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    return field_error(field, "presence_penalty", "presence_penalty must be in [-2, 2]");
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    return field_error(field, "frequency_penalty", "frequency_penalty must be in [-2, 2]");
  }
  for (const auto& [id, bias] : logit_bias) {
    if (!in_vocab(id, vocab_size)) {
      return field_error(field, "logit_bias",
                         "logit_bias names token id " + std::to_string(id) +
                             " outside the vocabulary " + vocab_range(vocab_size));
    }
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      return field_error(
          field, "logit_bias",
          "logit_bias values must be in [-100, 100] (token " + std::to_string(id) + ")");
    }
  }
  if (min_tokens < 0 || min_tokens > max_tokens) {
    return field_error(
        field, "min_tokens",
        "min_tokens must be in [0, max_tokens (" + std::to_string(max_tokens) + ")]");
  }
  if (logprobs < -1 || logprobs > kMaxLogprobs) {
    return field_error(field, "logprobs",
                       "logprobs must be in [0, " + std::to_string(kMaxLogprobs) + "]");
  }
  return Status();
}

bool SamplingParams::needs_logits() const {
  return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f ||
         !logit_bias.empty() || min_tokens > 0 || logprobs >= 0;
}

Status validate_request(const std::vector<int32_t>& prompt, const SamplingParams& params,
                        int vocab_size, int max_context, std::string* field) {
  if (prompt.empty()) return field_error(field, "prompt", "prompt must not be empty");
  for (int32_t id : prompt) {
    if (!in_vocab(id, vocab_size)) {
      return field_error(field, "prompt",
                         "prompt contains token id " + std::to_string(id) +
                             " outside the vocabulary " + vocab_range(vocab_size));
    }
  }
  FLEX_RETURN_IF_ERROR(params.validate(vocab_size, field));
  // Not a sum: max_tokens may be near INT_MAX.
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  if (params.max_tokens > static_cast<int64_t>(max_context) - prompt_len) {
    return field_error(field, "max_tokens",
                       "prompt (" + std::to_string(prompt_len) + " tokens) + max_tokens (" +
                           std::to_string(params.max_tokens) + ") exceeds the context length " +
                           std::to_string(max_context));
  }
  return Status();
}

}  // namespace flexpert
