// SPDX-License-Identifier: Apache-2.0
#include "serve/completion_api.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <set>

#include "core/json_limits.h"
#include "serve/sampling_fields.h"

namespace flexpert {
namespace {

using nlohmann::json;

// Each getter leaves `*out` alone when the field is absent or null (OpenAI clients
// send explicit nulls for "unset"), and fails naming the field on a wrong type.
struct FieldReader {
  const json& body;
  std::string* error_param;

  Status fail(const char* field, const std::string& message) {
    *error_param = field;
    return invalid_argument(message);
  }
  const json* get(const char* field) {
    auto it = body.find(field);
    return it == body.end() || it->is_null() ? nullptr : &*it;
  }
  Status integer(const char* field, int64_t* out) {
    const json* v = get(field);
    if (v == nullptr) return Status();
    if (v->is_number_unsigned()) {
      const uint64_t u = v->get<uint64_t>();
      *out = u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                 ? std::numeric_limits<int64_t>::max()
                 : static_cast<int64_t>(u);
      return Status();
    }
    if (!v->is_number_integer()) return fail(field, std::string(field) + " must be an integer");
    *out = v->get<int64_t>();
    return Status();
  }
  Status number(const char* field, double* out) {
    const json* v = get(field);
    if (v == nullptr) return Status();
    if (!v->is_number()) return fail(field, std::string(field) + " must be a number");
    *out = v->get<double>();
    return Status();
  }
  Status boolean(const char* field, bool* out) {
    const json* v = get(field);
    if (v == nullptr) return Status();
    if (!v->is_boolean()) return fail(field, std::string(field) + " must be true or false");
    *out = v->get<bool>();
    return Status();
  }
  // A list of token ids in [0, vocab_size); `what` names it in messages.
  Status token_ids(const char* field, const json& list, int vocab_size, std::vector<int32_t>* out) {
    for (const json& id : list) {
      if (!id.is_number_integer()) {
        // The type name, not the value: an array may nest deep, and dump() recurses.
        return fail(field,
                    std::string(field) + " must contain only integer token ids, got " +
                        (id.is_primitive() ? id.dump(-1, ' ', false, json::error_handler_t::replace)
                                           : std::string("an ") + id.type_name()));
      }
      // Compare as 64-bit (or unsigned) first so that huge values cannot wrap into range.
      const bool in_range = id.is_number_unsigned()
                                ? id.get<uint64_t>() < static_cast<uint64_t>(vocab_size)
                                : id.get<int64_t>() >= 0 && id.get<int64_t>() < vocab_size;
      if (!in_range) {
        return fail(field, std::string(field) + " contains token id " +
                               id.dump(-1, ' ', false, json::error_handler_t::replace) +
                               " outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
      }
      out->push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
    return Status();
  }
};

}  // namespace

Status parse_completion_request(const std::string& body, int vocab_size, int max_context,
                                ParsedCompletion* out, std::string* error_param,
                                const SamplingDefaults& defaults) {
  error_param->clear();
  FLEX_RETURN_IF_ERROR(check_json_nesting(body, "the request body"));
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("the request body is not valid JSON");
  if (!j.is_object()) return invalid_argument("the request body must be a JSON object");
  FieldReader r{j, error_param};
  *out = ParsedCompletion();
  // Every field is read below; anything else is refused by name.
  static const std::set<std::string> kKnown = {"prompt",
                                               "max_tokens",
                                               "temperature",
                                               "top_p",
                                               "top_k",
                                               "seed",
                                               "stream",
                                               "ignore_eos",
                                               "stream_options",
                                               "stop_token_ids",
                                               "n",
                                               "stop",
                                               "echo",
                                               "logprobs",
                                               "model",
                                               "user",
                                               "presence_penalty",
                                               "frequency_penalty",
                                               "logit_bias",
                                               "best_of",
                                               "repetition_penalty",
                                               "min_tokens"};
  for (const auto& [key, value] : j.items()) {
    if (!kKnown.count(key)) {
      return r.fail(key.substr(0, 64).c_str(), "unsupported field '" + key.substr(0, 64) + "'");
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

  // prompt: [ids] or [[ids]] (the batched form, with exactly one prompt).
  const json* prompt = r.get("prompt");
  if (prompt == nullptr) return r.fail("prompt", "prompt is required");
  if (prompt->is_string() || (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_string())) {
    return r.fail("prompt", "prompt must be token ids: this server has no tokenizer");
  }
  if (!prompt->is_array()) return r.fail("prompt", "prompt must be an array of token ids");
  const json* ids = prompt;
  if (!prompt->empty() && (*prompt)[0].is_array()) {
    if (prompt->size() != 1) {
      return r.fail("prompt", "prompt as a list of lists must hold exactly one prompt");
    }
    ids = &(*prompt)[0];
  }
  if (ids->empty()) return r.fail("prompt", "prompt must not be empty");
  FLEX_RETURN_IF_ERROR(r.token_ids("prompt", *ids, vocab_size, &out->request.prompt));

  FLEX_RETURN_IF_ERROR(
      parse_sampling_fields(j, vocab_size, defaults, &p, &out->has_seed, error_param));
  // OpenAI's legacy integer (0..5 there): the sampled token's logprob and the k most likely.
  if (const json* lp = r.get("logprobs")) {
    if (!lp->is_number_integer()) return r.fail("logprobs", "logprobs must be an integer");
    // JSON's non-negative integers parse as unsigned; compare before any narrowing.
    const int64_t k = lp->is_number_unsigned()
                          ? static_cast<int64_t>(std::min<uint64_t>(lp->get<uint64_t>(), 1000))
                          : lp->get<int64_t>();
    if (k < 0 || k > SamplingParams::kMaxLogprobs) {
      return r.fail("logprobs", "logprobs must be in [0, " +
                                    std::to_string(SamplingParams::kMaxLogprobs) + "]");
    }
    p.logprobs = static_cast<int>(k);
  }

  FLEX_RETURN_IF_ERROR(r.boolean("stream", &out->stream));
  if (const json* opts = r.get("stream_options")) {
    if (!opts->is_object()) return r.fail("stream_options", "stream_options must be an object");
    FieldReader o{*opts, error_param};
    FLEX_RETURN_IF_ERROR(o.boolean("include_usage", &out->include_usage));
  }

  // Options we cannot honour are refused rather than silently ignored.
  int64_t n = 1;
  FLEX_RETURN_IF_ERROR(r.integer("n", &n));
  if (n != 1) return r.fail("n", "only n = 1 is supported");
  if (const json* stop = r.get("stop"); stop != nullptr && !(stop->is_array() && stop->empty())) {
    return r.fail("stop", "stop strings need a tokenizer; use stop_token_ids");
  }
  bool echo = false;
  FLEX_RETURN_IF_ERROR(r.boolean("echo", &echo));
  if (echo) return r.fail("echo", "echo is not supported");
  int64_t best_of = 1;
  FLEX_RETURN_IF_ERROR(r.integer("best_of", &best_of));
  if (best_of != 1) return r.fail("best_of", "only best_of = 1 is supported");
  return validate_request(out->request.prompt, p, vocab_size, max_context, error_param);
}

nlohmann::json usage_json(size_t prompt_tokens, size_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

nlohmann::json completion_logprobs_json(const std::vector<TokenLogprob>& logprobs) {
  auto text = [](int32_t id) { return "token_id:" + std::to_string(id); };
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  for (const TokenLogprob& lp : logprobs) {
    tokens.push_back(text(lp.token));
    token_logprobs.push_back(lp.logprob);
    json entries = json::object();
    for (const auto& [id, logprob] : lp.top) entries[text(id)] = logprob;
    entries[text(lp.token)] = lp.logprob;
    top.push_back(std::move(entries));
    offsets.push_back(0);
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top)},
          {"text_offset", std::move(offsets)}};
}

nlohmann::json completion_response(const CompletionHeader& header,
                                   const std::vector<int32_t>& tokens,
                                   const std::string& finish_reason, size_t prompt_tokens,
                                   const std::vector<TokenLogprob>* logprobs) {
  json choice = {{"index", 0},
                 {"text", ""},
                 {"token_ids", tokens},
                 {"logprobs", logprobs ? completion_logprobs_json(*logprobs) : json(nullptr)},
                 {"finish_reason", finish_reason}};
  return {{"id", header.id},
          {"object", "text_completion"},
          {"created", header.created},
          {"model", header.model},
          {"choices", json::array({choice})},
          {"usage", usage_json(prompt_tokens, tokens.size())}};
}

nlohmann::json completion_chunk(const CompletionHeader& header, const std::vector<int32_t>& tokens,
                                const std::optional<std::string>& finish_reason,
                                const Status& error, const std::vector<TokenLogprob>* logprobs) {
  json choice = {{"index", 0},
                 {"text", ""},
                 {"token_ids", tokens},
                 {"logprobs", logprobs ? completion_logprobs_json(*logprobs) : json(nullptr)},
                 {"finish_reason", finish_reason ? json(*finish_reason) : json(nullptr)}};
  json chunk = {{"id", header.id},
                {"object", "text_completion"},
                {"created", header.created},
                {"model", header.model},
                {"choices", json::array({choice})}};
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
