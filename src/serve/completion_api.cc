// SPDX-License-Identifier: Apache-2.0
#include "serve/completion_api.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <set>

#include "core/json_limits.h"
#include "serve/field_reader.h"
#include "serve/sampling_fields.h"
#include "tokenizer/utf8.h"

namespace flexpert {
namespace {

using nlohmann::json;

}  // namespace

Status read_stop_fields(const json& body, const Tokenizer* tokenizer, StopStrings* out,
                        std::string* error_param) {
  FieldReader r{body, error_param};
  *out = StopStrings();
  if (const json* stop = r.get("stop")) {
    std::vector<std::string> stops;
    if (stop->is_string()) {
      stops.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (stop->size() > static_cast<size_t>(kMaxStopStrings)) {
        return r.fail("stop", "stop holds at most " + std::to_string(kMaxStopStrings) + " strings");
      }
      for (const json& s : *stop) {
        if (!s.is_string()) return r.fail("stop", "stop must be a string or a list of strings");
        stops.push_back(s.get<std::string>());
      }
    } else {
      return r.fail("stop", "stop must be a string or a list of strings");
    }
    for (const std::string& s : stops) {
      if (s.empty()) return r.fail("stop", "stop strings must not be empty");
      if (s.size() > kMaxStopStringBytes) {
        return r.fail("stop", "stop strings must be at most " +
                                  std::to_string(kMaxStopStringBytes) + " bytes");
      }
    }
    if (!stops.empty() && tokenizer == nullptr) {
      return r.fail("stop",
                    "stop strings need a tokenizer (serve --tokenizer DIR); use stop_token_ids");
    }
    out->stop = std::move(stops);
  }
  return r.boolean("include_stop_str_in_output", &out->include_stop_str_in_output);
}

Status read_stream_fields(const json& body, bool* stream, bool* include_usage,
                          std::string* error_param) {
  FieldReader r{body, error_param};
  FLEX_RETURN_IF_ERROR(r.boolean("stream", stream));
  if (const json* opts = r.get("stream_options")) {
    if (!opts->is_object()) return r.fail("stream_options", "stream_options must be an object");
    for (const auto& [key, value] : opts->items()) {
      if (key != "include_usage") {
        return r.fail("stream_options",
                      "unsupported field 'stream_options." + key.substr(0, 64) + "'");
      }
    }
    FieldReader o{*opts, error_param};
    FLEX_RETURN_IF_ERROR(o.boolean("include_usage", include_usage));
  }
  return Status();
}

Status check_max_tokens(int64_t max_tokens, const char* field, size_t longest_prompt,
                        int max_context, std::string* error_param) {
  const int64_t prompt_len = static_cast<int64_t>(longest_prompt);
  if (max_tokens < 1) {
    *error_param = field;
    return invalid_argument(std::string(field) + " must be >= 1");
  }
  if (max_tokens > max_context - prompt_len) {  // Not a sum: max_tokens may be near INT64_MAX.
    *error_param = field;
    return invalid_argument("prompt (" + std::to_string(prompt_len) + " tokens) + " + field + " (" +
                            std::to_string(max_tokens) + ") exceeds the context length " +
                            std::to_string(max_context));
  }
  return Status();
}

Status parse_completion_request(const std::string& body, int vocab_size, int max_context,
                                ParsedCompletion* out, std::string* error_param,
                                const Tokenizer* tokenizer, const SamplingDefaults& defaults) {
  error_param->clear();
  FLEX_RETURN_IF_ERROR(check_json_nesting(body, "the request body"));
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("the request body is not valid JSON");
  if (!j.is_object()) return invalid_argument("the request body must be a JSON object");
  FieldReader r{j, error_param};
  *out = ParsedCompletion();
  // Every field is read below; anything else is refused by name.
  static const std::set<std::string> kKnown = [] {
    std::set<std::string> known = sampling_field_names();
    known.erase("max_completion_tokens");  // Chat's name.
    known.insert({"prompt", "stream", "stream_options", "n", "stop", "echo", "logprobs", "model",
                  "user", "best_of", "include_stop_str_in_output"});
    return known;
  }();
  for (const auto& [key, value] : j.items()) {
    if (!kKnown.count(key)) {
      return r.fail(key.substr(0, 64), "unsupported field '" + key.substr(0, 64) + "'");
    }
  }
  if (const json* model = r.get("model")) {
    if (!model->is_string()) return r.fail("model", "model must be a string");
    out->model = model->get<std::string>();
  }
  if (const json* user = r.get("user"); user != nullptr && !user->is_string()) {
    return r.fail("user", "user must be a string");  // An end-user id: metadata only.
  }
  SamplingParams& p = out->request.params;

  // prompt: "text", ["text", ...], [ids] or [[ids], ...].
  const json* prompt = r.get("prompt");
  if (prompt == nullptr) return r.fail("prompt", "prompt is required");
  bool echo = false;
  FLEX_RETURN_IF_ERROR(r.boolean("echo", &echo));
  const bool text =
      prompt->is_string() || (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_string());
  if (text && tokenizer == nullptr) {
    return r.fail("prompt",
                  "prompt must be token ids: this server has no tokenizer (serve --tokenizer DIR)");
  }
  if (!text && !prompt->is_array()) {
    return r.fail("prompt", "prompt must be a string, a list of strings or token ids");
  }
  std::vector<const json*> items;  // One per prompt.
  if (prompt->is_string() || (prompt->is_array() && !prompt->empty() && !(*prompt)[0].is_array() &&
                              !(*prompt)[0].is_string())) {
    items.push_back(prompt);
  } else {
    if (prompt->empty()) return r.fail("prompt", "prompt must not be empty");
    for (const json& item : *prompt) items.push_back(&item);
  }
  if (items.size() > static_cast<size_t>(kMaxChoices)) {
    return r.fail("prompt", "at most " + std::to_string(kMaxChoices) + " prompts per request");
  }
  size_t longest = 0;
  for (const json* item : items) {
    std::vector<int32_t> ids;
    if (text) {
      if (!item->is_string()) return r.fail("prompt", "a list of prompts must be all strings");
      EncodeOptions options;  // Special tokens added (none for Qwen3 / DeepSeek-V3) and parsed.
      Result<std::vector<int32_t>> encoded = tokenizer->encode(item->get<std::string>(), options);
      if (!encoded.ok()) return r.fail("prompt", encoded.status().message());
      ids = std::move(encoded.value());
      for (int32_t id : ids) {
        if (id >= vocab_size) {
          return r.fail("prompt", "the prompt encodes to token " + std::to_string(id) +
                                      ", outside the model's vocabulary");
        }
      }
      if (echo) out->echo_texts.push_back(item->get<std::string>());
    } else {
      if (!item->is_array()) {
        return r.fail("prompt", "prompt as a list of lists must hold only lists of token ids");
      }
      FLEX_RETURN_IF_ERROR(r.token_ids("prompt", *item, vocab_size, &ids));
      if (echo && tokenizer != nullptr) {
        Result<std::string> decoded = tokenizer->decode(ids);
        if (!decoded.ok()) return r.fail("prompt", decoded.status().message());
        out->echo_texts.push_back(std::move(decoded.value()));
      }
    }
    if (ids.empty()) return r.fail("prompt", "prompt must not be empty");
    longest = std::max(longest, ids.size());
    out->prompts.push_back(std::move(ids));
  }
  out->request.prompt = out->prompts[0];
  if (echo && tokenizer == nullptr) return r.fail("echo", "echo needs a tokenizer");

  FLEX_RETURN_IF_ERROR(
      parse_sampling_fields(j, vocab_size, defaults, &p, &out->has_seed, error_param));
  // validate_request below sees the first prompt only; every prompt must fit.
  FLEX_RETURN_IF_ERROR(
      check_max_tokens(p.max_tokens, "max_tokens", longest, max_context, error_param));
  FLEX_RETURN_IF_ERROR(read_stream_fields(j, &out->stream, &out->include_usage, error_param));
  FLEX_RETURN_IF_ERROR(read_stop_fields(j, tokenizer, &out->stops, error_param));

  int64_t n = 1;
  FLEX_RETURN_IF_ERROR(r.integer("n", &n));
  if (n < 1 || n > kMaxChoices) {
    return r.fail("n", "n must be in [1, " + std::to_string(kMaxChoices) + "]");
  }
  if (n * static_cast<int64_t>(out->prompts.size()) > kMaxChoices) {
    return r.fail("n", "prompts x n must be at most " + std::to_string(kMaxChoices));
  }
  out->n = static_cast<int>(n);
  // OpenAI's legacy integer: the sampled token's logprob and the k most likely.
  if (r.get("logprobs") != nullptr) {
    int64_t k = 0;  // FieldReader saturates a huge unsigned value, so no narrowing wraps.
    FLEX_RETURN_IF_ERROR(r.integer("logprobs", &k));
    if (k < 0 || k > kMaxTopLogprobs) {
      return r.fail("logprobs", "logprobs must be in [0, " + std::to_string(kMaxTopLogprobs) + "]");
    }
    if (echo) {
      return r.fail("echo",
                    "echo with logprobs needs the prompt's logprobs, which this server "
                    "does not compute");
    }
    p.logprobs = static_cast<int>(k);
  }
  int64_t best_of = 1;
  FLEX_RETURN_IF_ERROR(r.integer("best_of", &best_of));
  if (best_of != 1) return r.fail("best_of", "only best_of = 1 is supported");
  return validate_request(out->request.prompt, p, vocab_size, max_context, error_param);
}

std::string logprob_token_text(const Tokenizer* tokenizer, int32_t id) {
  if (tokenizer == nullptr || id < 0 || id >= tokenizer->vocab_size()) {
    return "token_id:" + std::to_string(id);
  }
  std::string out;
  tok::append_lossy(tokenizer->token_bytes(id), &out);
  return out;
}

std::string logprob_token_bytes(const Tokenizer* tokenizer, int32_t id) {
  if (tokenizer == nullptr || id < 0 || id >= tokenizer->vocab_size()) return std::to_string(id);
  return std::string(tokenizer->token_bytes(id));
}

json legacy_logprobs_json(const ChoiceOutput& choice, const Tokenizer* tokenizer) {
  if (!choice.with_logprobs) return nullptr;
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  size_t offset = choice.text_offset;
  for (const TokenLogprob& lp : choice.logprobs) {
    const std::string text = logprob_token_text(tokenizer, lp.token);
    tokens.push_back(text);
    token_logprobs.push_back(lp.logprob);
    json alternatives = json::object();
    for (const auto& [id, logprob] : lp.top) {
      alternatives[logprob_token_text(tokenizer, id)] = logprob;
    }
    alternatives[text] = lp.logprob;  // The sampled token too, as vLLM returns it.
    top.push_back(std::move(alternatives));
    offsets.push_back(offset);
    size_t pos = 0;
    while (pos < text.size()) {
      (void)tok::next_code_point(text, &pos);
      ++offset;
    }
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", top},
          {"text_offset", offsets}};
}

nlohmann::json usage_json(size_t prompt_tokens, size_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

namespace {

json choice_json(const ChoiceOutput& choice, const Tokenizer* tokenizer) {
  return {{"index", choice.index},
          {"text", choice.text},
          {"token_ids", choice.tokens},
          {"logprobs", legacy_logprobs_json(choice, tokenizer)},
          {"finish_reason", choice.finish_reason ? json(*choice.finish_reason) : json(nullptr)}};
}

}  // namespace

nlohmann::json completion_response(const CompletionHeader& header,
                                   const std::vector<ChoiceOutput>& choices, size_t prompt_tokens,
                                   size_t completion_tokens, const Tokenizer* tokenizer) {
  json list = json::array();
  for (const ChoiceOutput& choice : choices) list.push_back(choice_json(choice, tokenizer));
  return {{"id", header.id},
          {"object", "text_completion"},
          {"created", header.created},
          {"model", header.model},
          {"choices", std::move(list)},
          {"usage", usage_json(prompt_tokens, completion_tokens)}};
}

nlohmann::json completion_chunk(const CompletionHeader& header, const ChoiceOutput& choice,
                                const Tokenizer* tokenizer, const Status& error) {
  json chunk = {{"id", header.id},
                {"object", "text_completion"},
                {"created", header.created},
                {"model", header.model},
                {"choices", json::array({choice_json(choice, tokenizer)})}};
  if (!error.ok()) chunk["error"] = status_error_json(error)["error"];
  return chunk;
}

nlohmann::json error_json(const std::string& message, const std::string& type,
                          const std::string& param, const std::string& code) {
  return {{"error",
           {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

nlohmann::json status_error_json(const Status& status) {
  if (status.code() == StatusCode::kInvalidArgument) {
    return error_json(status.message(), "invalid_request_error");
  }
  return error_json(status.message(), "server_error", "",
                    std::string(status_code_name(status.code())));
}

int http_status_for(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk:
      return 200;
    case StatusCode::kInvalidArgument:
      return 400;
    case StatusCode::kNotFound:
      return 404;
    case StatusCode::kUnavailable:
      return 503;
    case StatusCode::kResourceExhausted:
      return 429;
    case StatusCode::kUnimplemented:
      return 501;
    case StatusCode::kFailedPrecondition:  // E.g. a reconfiguration already in progress.
    case StatusCode::kAborted:
      return 409;
    default:
      return 500;
  }
}

std::string dump_json(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string sse_event(const std::string& data) { return "data: " + data + "\n\n"; }

}  // namespace flexpert
