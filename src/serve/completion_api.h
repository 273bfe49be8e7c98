// SPDX-License-Identifier: Apache-2.0
// The OpenAI-style /v1/completions wire format: request parsing and validation,
// response and stream-chunk bodies, error bodies. Pure functions over JSON, no I/O,
// so that every rule is unit-testable without a server. The chat route's format
// (chat_api.h) shares the sampling fields and the stop strings read here.
//
// Prompts are token ids, or text when the server has a tokenizer (a string, or a list of
// strings: one choice per prompt, `n` choices each). Output is `text` (decoded, "" without a
// tokenizer) beside `token_ids`. Defaults follow OpenAI (temperature 1.0, top_p 1.0,
// max_tokens 16) unless the model's generation_config.json sets them (SamplingDefaults);
// a request without `seed` samples from a server-chosen seed.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "flexpert/status.h"
#include "flexpert/tokenizer.h"
#include "serve/serving_engine.h"
#include "serve/text_stream.h"

namespace flexpert {

// Choices (prompts x n) one request may ask for.
constexpr int kMaxChoices = 64;
// Stop strings per request, as OpenAI allows, and bytes per stop string: matching costs up
// to (bytes)^2 per token (TextStream::held_suffix), so a client cannot make it large.
constexpr int kMaxStopStrings = 4;
constexpr size_t kMaxStopStringBytes = 256;
// Most likely alternatives per token (`logprobs` / `top_logprobs`), as vLLM allows.
constexpr int kMaxTopLogprobs = SamplingParams::kMaxLogprobs;

struct ParsedCompletion {
  // The sampling parameters of every choice (seeds are per choice: see HttpServer); `prompt`
  // is the first prompt.
  CompletionRequest request;
  std::vector<std::vector<int32_t>> prompts;  // One or more; each runs `n` times.
  std::vector<std::string> echo_texts;        // With `echo`: each prompt's text.
  int n = 1;
  bool has_seed = false;  // False: the caller picks a seed.
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a final usage chunk.
  StopStrings stops;
  std::string model;  // "model" as sent ("" when absent); the server checks it.
};

// Parses and validates a request body against the engine's limits (the sampling fields
// through parse_sampling_fields, with `defaults` for the absent ones; `logprobs` an
// integer in [0, kMaxTopLogprobs]). On failure the Status is InvalidArgument and
// `*error_param` names the offending field ("" when the body as a whole is wrong). A field
// this server does not know, or one it knows but cannot honour (best_of > 1, ...), is an
// error naming it, never silently ignored. `tokenizer` may be null: text prompts, stop
// strings and echo are then refused.
Status parse_completion_request(const std::string& body, int vocab_size, int max_context,
                                ParsedCompletion* out, std::string* error_param,
                                const Tokenizer* tokenizer = nullptr,
                                const SamplingDefaults& defaults = SamplingDefaults());

// `stop` (a string or up to kMaxStopStrings strings; needs a tokenizer) and vLLM's
// `include_stop_str_in_output`.
Status read_stop_fields(const nlohmann::json& body, const Tokenizer* tokenizer, StopStrings* out,
                        std::string* error_param);
// `stream` and `stream_options.include_usage`.
Status read_stream_fields(const nlohmann::json& body, bool* stream, bool* include_usage,
                          std::string* error_param);
// max_tokens in [1, max_context - longest prompt]; `field` names it in errors.
Status check_max_tokens(int64_t max_tokens, const char* field, size_t longest_prompt,
                        int max_context, std::string* error_param);

// Fields shared by a response and its stream chunks.
struct CompletionHeader {
  std::string id;  // "cmpl-<n>" or "chatcmpl-<n>"
  int64_t created = 0;
  std::string model;
};

// One choice's output in a response, or its new output in a stream chunk.
struct ChoiceOutput {
  int index = 0;
  std::string text;
  std::vector<int32_t> tokens;
  // Parallel to `tokens` when the request asked for logprobs (`with_logprobs`).
  std::vector<TokenLogprob> logprobs;
  bool with_logprobs = false;
  // Legacy logprobs: where this piece's first token starts in the choice's text, in
  // Unicode code points (the sum of the lengths of the earlier tokens' strings).
  size_t text_offset = 0;
  std::optional<std::string> finish_reason;  // null in chunks before the last.
};

// A token as logprobs show it: its text (invalid UTF-8 as U+FFFD), or "token_id:N" without
// a tokenizer (vLLM's spelling).
std::string logprob_token_text(const Tokenizer* tokenizer, int32_t id);
// The bytes of a token (what chat logprobs' `bytes` lists); its id's decimal digits without a
// tokenizer.
std::string logprob_token_bytes(const Tokenizer* tokenizer, int32_t id);
// Legacy logprobs {tokens, token_logprobs, top_logprobs, text_offset}; null when the request
// asked for none.
nlohmann::json legacy_logprobs_json(const ChoiceOutput& choice, const Tokenizer* tokenizer);

nlohmann::json usage_json(size_t prompt_tokens, size_t completion_tokens);

// A whole non-streaming response.
nlohmann::json completion_response(const CompletionHeader& header,
                                   const std::vector<ChoiceOutput>& choices, size_t prompt_tokens,
                                   size_t completion_tokens, const Tokenizer* tokenizer = nullptr);

// One stream event body for one choice. `error`, when not OK, is attached as an "error"
// object (the choice then carries no tokens or text: they go in a chunk before).
nlohmann::json completion_chunk(const CompletionHeader& header, const ChoiceOutput& choice,
                                const Tokenizer* tokenizer = nullptr,
                                const Status& error = Status());

// {"error": {"message", "type", "param", "code"}}; `param` "" renders as null, and
// `code` is the Status code name for server-side errors (null for request errors).
nlohmann::json error_json(const std::string& message, const std::string& type,
                          const std::string& param = "", const std::string& code = "");

// The error body for a failed engine Status: invalid_request_error for InvalidArgument,
// else server_error with the code name.
nlohmann::json status_error_json(const Status& status);

// HTTP status for an engine Status: 400 InvalidArgument, 503 Unavailable, 429
// ResourceExhausted, 501 Unimplemented, 500 otherwise.
int http_status_for(const Status& status);

// JSON text that never throws: invalid UTF-8 (e.g. echoed from a bad request) is replaced.
std::string dump_json(const nlohmann::json& j);

// Seconds since the Unix epoch, for "created".
int64_t unix_seconds();

// "data: <json>\n\n": one server-sent event.
std::string sse_event(const std::string& data);

}  // namespace flexpert
