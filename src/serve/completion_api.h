// SPDX-License-Identifier: Apache-2.0
// The OpenAI-style /v1/completions wire format: request parsing and validation,
// response and stream-chunk bodies, error bodies. Pure functions over JSON, no I/O,
// so that every rule is unit-testable without a server.
//
// Token ids in and out: the server has no tokenizer, so `prompt` must be token ids
// and `text` is always "". Defaults follow OpenAI (temperature 1.0, top_p 1.0,
// max_tokens 16); a request without `seed` samples from a server-chosen seed.
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

// Parses and validates a request body against the engine's limits. On failure the
// Status is InvalidArgument and `*error_param` names the offending field ("" when
// the body as a whole is wrong). A field this server does not know, or one it knows but
// cannot honour (a non-zero penalty, a non-empty logit_bias, best_of > 1, ...), is an
// error naming it, never silently ignored.
Status parse_completion_request(const std::string& body, int vocab_size, int max_context,
                                ParsedCompletion* out, std::string* error_param);

// Fields shared by a response and its stream chunks.
struct CompletionHeader {
  std::string id;  // "cmpl-<n>"
  int64_t created = 0;
  std::string model;
};

nlohmann::json usage_json(size_t prompt_tokens, size_t completion_tokens);

// A whole non-streaming response.
nlohmann::json completion_response(const CompletionHeader& header,
                                   const std::vector<int32_t>& tokens,
                                   const std::string& finish_reason, size_t prompt_tokens);

// One stream event body: the new tokens, and the finish reason on the last (null
// before). `error`, when not OK, is attached as an "error" object.
nlohmann::json completion_chunk(const CompletionHeader& header, const std::vector<int32_t>& tokens,
                                const std::optional<std::string>& finish_reason,
                                const Status& error = Status());

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
