// SPDX-License-Identifier: Apache-2.0
// The sampling fields of an OpenAI-style request body (/v1/completions, and any other
// endpoint that generates): one parser, so that every endpoint reads them alike.
// Pure function over JSON, no I/O.
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "flexpert/generate.h"
#include "flexpert/model_config.h"
#include "flexpert/status.h"

namespace flexpert {

// The body fields parse_sampling_fields reads (for a caller's list of known fields).
const std::set<std::string>& sampling_field_names();

// Reads into *out the fields of sampling_field_names() present in `body` (an object);
// absent or null fields take `defaults` (generation_config.json's, else OpenAI's) or
// SamplingParams' defaults. Fields: max_tokens (max_completion_tokens wins when both are
// present; default 16), temperature, top_p, top_k (vLLM's -1 or 0: no limit; capped at
// vocab_size), seed (*has_seed says whether it was sent), ignore_eos, stop_token_ids,
// presence_penalty, frequency_penalty, repetition_penalty, logit_bias (OpenAI's shape:
// an object of token-id strings to numbers), min_tokens. `logprobs` is the caller's: its
// shape differs between endpoints. Checks types and what a conversion needs; ranges
// are validate_request()'s, which the caller runs once the prompt is known.
// InvalidArgument with `*error_param` naming the field.
Status parse_sampling_fields(const nlohmann::json& body, int vocab_size,
                             const SamplingDefaults& defaults, SamplingParams* out, bool* has_seed,
                             std::string* error_param);

}  // namespace flexpert
