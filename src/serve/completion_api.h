// SPDX-License-Identifier: Apache-2.0
// The OpenAI-style /v1/completions wire format: request parsing and validation,
// response and stream-chunk bodies, error bodies. Pure functions over JSON, no I/O,
// so that every rule is unit-testable without a server.
//
// Token ids in and out: the server has no tokenizer, so `prompt` must be token ids
// and `text` is always "". Defaults follow OpenAI (temperature 1.0, top_p 1.0,
// max_tokens 16) unless the model's generation_config.json sets them (SamplingDefaults);
// a request without `seed` samples from a server-chosen seed.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "flexpert/status.h"
#include "serve/serving_engine.h"

namespace flexpert {

struct ParsedCompletion {
  CompletionRequest request;
  bool has_seed = false;  // False: the caller picks a seed.
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a final usage chunk.
  std::string model;           // "model" as sent ("" when absent); the server checks it.
};

// Parses and validates a request body against the engine's limits (the sampling fields
// through parse_sampling_fields, with `defaults` for the absent ones; `logprobs` an
// integer in [0, 20]). On failure the Status is InvalidArgument and `*error_param` names
// the offending field ("" when the body as a whole is wrong). A field this server does
// not know, or one it knows but cannot honour (best_of > 1, ...), is an error naming it,
// never silently ignored.
Status parse_completion_request(const std::string& body, int vocab_size, int max_context,
                                ParsedCompletion* out, std::string* error_param,
                                const SamplingDefaults& defaults = SamplingDefaults());

// Fields shared by a response and its stream chunks.
struct CompletionHeader {
  std::string id;  // "cmpl-<n>"
  int64_t created = 0;
  std::string model;
};

nlohmann::json usage_json(size_t prompt_tokens, size_t completion_tokens);

// A choice's "logprobs" in the legacy completions shape: {"tokens", "token_logprobs",
// "top_logprobs" (per token an object of the top entries plus the sampled token, as vLLM
// returns it), "text_offset"}. Without a tokenizer a token's text is "token_id:<id>"
// (vLLM's spelling then) and every text_offset is 0.
nlohmann::json completion_logprobs_json(const std::vector<TokenLogprob>& logprobs);

// A whole non-streaming response. `logprobs` (when the request asked for them: one per
// token) is rendered by completion_logprobs_json, else "logprobs" is null.
nlohmann::json completion_response(const CompletionHeader& header,
                                   const std::vector<int32_t>& tokens,
                                   const std::string& finish_reason, size_t prompt_tokens,
                                   const std::vector<TokenLogprob>* logprobs = nullptr);

// One stream event body: the new tokens, and the finish reason on the last (null
// before). `error`, when not OK, is attached as an "error" object. `logprobs` as in
// completion_response, for this chunk's tokens.
nlohmann::json completion_chunk(const CompletionHeader& header, const std::vector<int32_t>& tokens,
                                const std::optional<std::string>& finish_reason,
                                const Status& error = Status(),
                                const std::vector<TokenLogprob>* logprobs = nullptr);

// {"error": {"message", "type", "param", "code"}}; `param` "" renders as null, and
// `code` is the Status code name for server-side errors (null for request errors).
nlohmann::json error_json(const std::string& message, const std::string& type,
                          const std::string& param = "", const std::string& code = "");

// The error body for a failed engine Status: invalid_request_error for InvalidArgument,
// else server_error with the code name.
nlohmann::json status_error_json(const Status& status);

// HTTP status for an engine Status: 400 InvalidArgument, 503 Unavailable, 429
// ResourceExhausted, 500 otherwise.
int http_status_for(const Status& status);

// JSON text that never throws: invalid UTF-8 (e.g. echoed from a bad request) is replaced.
std::string dump_json(const nlohmann::json& j);

// Seconds since the Unix epoch, for "created".
int64_t unix_seconds();

// "data: <json>\n\n": one server-sent event.
std::string sse_event(const std::string& data);

}  // namespace flexpert
