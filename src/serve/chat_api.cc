// SPDX-License-Identifier: Apache-2.0
#include "serve/chat_api.h"

#include <algorithm>
#include <set>

#include "core/json_limits.h"
#include "serve/field_reader.h"
#include "serve/sampling_fields.h"

namespace flexpert {
namespace {

using nlohmann::json;

Status parse_body(const std::string& body, json* out) {
  FLEX_RETURN_IF_ERROR(check_json_nesting(body, "the request body"));
  *out = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (out->is_discarded()) return invalid_argument("the request body is not valid JSON");
  if (!out->is_object()) return invalid_argument("the request body must be a JSON object");
  return Status();
}

Status refuse_unknown(const json& body, const std::set<std::string>& known,
                      std::string* error_param) {
  for (const auto& [key, value] : body.items()) {
    if (!known.count(key)) {
      *error_param = key.substr(0, 64);
      return invalid_argument("unsupported field '" + key.substr(0, 64) + "'");
    }
  }
  return Status();
}

Status read_model(FieldReader& r, std::string* model) {
  if (const json* m = r.get("model")) {
    if (!m->is_string()) return r.fail("model", "model must be a string");
    *model = m->get<std::string>();
  }
  return Status();
}

// One message as the template gets it: {"role", "content": string}.
Status read_message(const json& message, size_t i, FieldReader& r, json* out) {
  const std::string where = "messages[" + std::to_string(i) + "]";
  if (!message.is_object()) return r.fail(where, where + " must be an object");
  for (const auto& [key, value] : message.items()) {
    if (key != "role" && key != "content" && !(key == "name" && value.is_null())) {
      return r.fail(where + "." + key.substr(0, 64),
                    "unsupported field '" + where + "." + key.substr(0, 64) + "'");
    }
  }
  auto role = message.find("role");
  if (role == message.end() || !role->is_string()) {
    return r.fail(where + ".role", where + ".role must be a string");
  }
  const std::string role_name = role->get<std::string>();
  if (role_name != "system" && role_name != "user" && role_name != "assistant") {
    return r.fail(where + ".role",
                  "unsupported role '" + role_name.substr(0, 32) + "' (system, user or assistant)");
  }
  auto content = message.find("content");
  std::string text;
  if (content == message.end() || content->is_null()) {
    return r.fail(where + ".content", where + ".content is required");
  } else if (content->is_string()) {
    text = content->get<std::string>();
  } else if (content->is_array()) {
    for (size_t k = 0; k < content->size(); ++k) {
      const json& part = (*content)[k];
      const std::string pw = where + ".content[" + std::to_string(k) + "]";
      if (!part.is_object()) return r.fail(pw, pw + " must be an object");
      auto type = part.find("type");
      if (type == part.end() || !type->is_string() || *type != "text") {
        return r.fail(pw + ".type", "unsupported content part type" +
                                        (type != part.end() && type->is_string()
                                             ? " '" + type->get<std::string>().substr(0, 32) + "'"
                                             : std::string()) +
                                        ": only \"text\"");
      }
      for (const auto& [key, value] : part.items()) {
        if (key != "type" && key != "text") {
          return r.fail(pw + "." + key.substr(0, 64),
                        "unsupported field '" + pw + "." + key.substr(0, 64) + "'");
        }
      }
      auto part_text = part.find("text");
      if (part_text == part.end() || !part_text->is_string()) {
        return r.fail(pw + ".text", pw + ".text must be a string");
      }
      if (k > 0) text += "\n";
      text += part_text->get<std::string>();
    }
  } else {
    return r.fail(where + ".content", where + ".content must be a string or a list of parts");
  }
  *out = {{"role", role_name}, {"content", std::move(text)}};
  return Status();
}

json token_bytes_json(const std::string& bytes) {
  json out = json::array();
  for (unsigned char c : bytes) out.push_back(static_cast<int>(c));
  return out;
}

json base_chunk(const CompletionHeader& header, const char* object) {
  return {
      {"id", header.id}, {"object", object}, {"created", header.created}, {"model", header.model}};
}

}  // namespace

Status render_chat_prompt(const json& body, const TextModel& text, std::string* prompt,
                          std::string* error_param) {
  FieldReader r{body, error_param};
  if (text.tokenizer == nullptr) {
    return r.fail("messages",
                  "chat needs a tokenizer: this server has none (serve --tokenizer DIR)");
  }
  if (text.chat_template == nullptr) {
    return r.fail("messages", "the tokenizer has no chat template (tokenizer_config.json)");
  }
  const json* messages = r.get("messages");
  if (messages == nullptr) return r.fail("messages", "messages is required");
  if (!messages->is_array() || messages->empty()) {
    return r.fail("messages", "messages must be a non-empty list");
  }
  json list = json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    json message;
    FLEX_RETURN_IF_ERROR(read_message((*messages)[i], i, r, &message));
    list.push_back(std::move(message));
  }
  ChatRenderOptions options;
  options.add_generation_prompt = true;  // vLLM's default.
  FLEX_RETURN_IF_ERROR(r.boolean("add_generation_prompt", &options.add_generation_prompt));
  if (const json* kwargs = r.get("chat_template_kwargs")) {
    if (!kwargs->is_object()) {
      return r.fail("chat_template_kwargs", "chat_template_kwargs must be an object");
    }
    for (const auto& [key, value] : kwargs->items()) {
      if (key != "enable_thinking") {
        return r.fail("chat_template_kwargs." + key.substr(0, 64),
                      "unsupported field 'chat_template_kwargs." + key.substr(0, 64) +
                          "' (only enable_thinking)");
      }
    }
    FieldReader k{*kwargs, error_param};
    if (k.get("enable_thinking") != nullptr) {
      bool enable = true;
      FLEX_RETURN_IF_ERROR(k.boolean("enable_thinking", &enable));
      options.enable_thinking = enable;
    }
  }
  Result<std::string> rendered = text.chat_template->render(list.dump(), options);
  if (!rendered.ok()) return r.fail("messages", rendered.status().message());
  *prompt = std::move(rendered.value());
  return Status();
}

Status parse_chat_request(const std::string& body, const TextModel& text, int vocab_size,
                          int max_context, ParsedCompletion* out, std::string* error_param,
                          const SamplingDefaults& defaults) {
  error_param->clear();
  json j;
  FLEX_RETURN_IF_ERROR(parse_body(body, &j));
  *out = ParsedCompletion();
  static const std::set<std::string> kKnown = [] {
    std::set<std::string> known = sampling_field_names();
    known.insert({"messages", "model", "user", "stream", "stream_options", "stop", "n", "logprobs",
                  "top_logprobs", "include_stop_str_in_output", "chat_template_kwargs",
                  "add_generation_prompt"});
    return known;
  }();
  FLEX_RETURN_IF_ERROR(refuse_unknown(j, kKnown, error_param));
  FieldReader r{j, error_param};
  FLEX_RETURN_IF_ERROR(read_model(r, &out->model));
  if (const json* user = r.get("user"); user != nullptr && !user->is_string()) {
    return r.fail("user", "user must be a string");
  }
  std::string prompt;
  FLEX_RETURN_IF_ERROR(render_chat_prompt(j, text, &prompt, error_param));
  EncodeOptions encode;
  encode.add_special_tokens = false;  // The template writes them.
  Result<std::vector<int32_t>> ids = text.tokenizer->encode(prompt, encode);
  if (!ids.ok()) return r.fail("messages", ids.status().message());
  if (ids.value().empty()) return r.fail("messages", "the rendered prompt is empty");
  for (int32_t id : ids.value()) {
    if (id >= vocab_size) {
      return r.fail("messages", "the prompt encodes to token " + std::to_string(id) +
                                    ", outside the model's vocabulary");
    }
  }
  out->prompts.push_back(std::move(ids.value()));
  out->request.prompt = out->prompts[0];
  SamplingParams& p = out->request.params;
  FLEX_RETURN_IF_ERROR(
      parse_sampling_fields(j, vocab_size, defaults, &p, &out->has_seed, error_param));

  // Without max_tokens / max_completion_tokens, the rest of the context.
  const size_t prompt_len = out->prompts[0].size();
  const char* max_field = "max_tokens";
  if (r.get("max_completion_tokens") != nullptr) {
    max_field = "max_completion_tokens";
  } else if (r.get("max_tokens") == nullptr) {
    p.max_tokens = max_context - static_cast<int>(std::min<size_t>(prompt_len, max_context));
  }
  FLEX_RETURN_IF_ERROR(
      check_max_tokens(p.max_tokens, max_field, prompt_len, max_context, error_param));
  FLEX_RETURN_IF_ERROR(read_stream_fields(j, &out->stream, &out->include_usage, error_param));
  FLEX_RETURN_IF_ERROR(read_stop_fields(j, text.tokenizer, &out->stops, error_param));

  int64_t n = 1;
  FLEX_RETURN_IF_ERROR(r.integer("n", &n));
  if (n < 1 || n > kMaxChoices) {
    return r.fail("n", "n must be in [1, " + std::to_string(kMaxChoices) + "]");
  }
  out->n = static_cast<int>(n);
  bool logprobs = false;
  FLEX_RETURN_IF_ERROR(r.boolean("logprobs", &logprobs));
  int64_t top = 0;
  FLEX_RETURN_IF_ERROR(r.integer("top_logprobs", &top));
  if (top < 0 || top > kMaxTopLogprobs) {
    return r.fail("top_logprobs",
                  "top_logprobs must be in [0, " + std::to_string(kMaxTopLogprobs) + "]");
  }
  if (r.get("top_logprobs") != nullptr && !logprobs) {
    return r.fail("top_logprobs", "top_logprobs needs logprobs: true");
  }
  if (logprobs) p.logprobs = static_cast<int>(top);
  return validate_request(out->request.prompt, p, vocab_size, max_context, error_param);
}

json chat_logprobs_json(const ChoiceOutput& choice, const Tokenizer* tokenizer) {
  if (!choice.with_logprobs) return nullptr;
  json content = json::array();
  for (const TokenLogprob& lp : choice.logprobs) {
    json top = json::array();
    for (const auto& [id, logprob] : lp.top) {
      top.push_back({{"token", logprob_token_text(tokenizer, id)},
                     {"logprob", logprob},
                     {"bytes", token_bytes_json(logprob_token_bytes(tokenizer, id))}});
    }
    content.push_back({{"token", logprob_token_text(tokenizer, lp.token)},
                       {"logprob", lp.logprob},
                       {"bytes", token_bytes_json(logprob_token_bytes(tokenizer, lp.token))},
                       {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}, {"refusal", nullptr}};
}

json chat_response(const CompletionHeader& header, const std::vector<ChoiceOutput>& choices,
                   size_t prompt_tokens, size_t completion_tokens, const Tokenizer* tokenizer) {
  json list = json::array();
  for (const ChoiceOutput& c : choices) {
    list.push_back({{"index", c.index},
                    {"message", {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}}},
                    {"logprobs", chat_logprobs_json(c, tokenizer)},
                    {"finish_reason", c.finish_reason ? json(*c.finish_reason) : json(nullptr)}});
  }
  json out = base_chunk(header, "chat.completion");
  out["choices"] = std::move(list);
  out["usage"] = usage_json(prompt_tokens, completion_tokens);
  return out;
}

json chat_chunk(const CompletionHeader& header, const ChoiceOutput& choice, bool role_delta,
                const Tokenizer* tokenizer, const Status& error) {
  json delta = json::object();
  if (role_delta) {
    delta = {{"role", "assistant"}, {"content", ""}};
  } else if (!choice.text.empty()) {
    delta["content"] = choice.text;
  }
  json out = base_chunk(header, "chat.completion.chunk");
  out["choices"] = json::array(
      {{{"index", choice.index},
        {"delta", std::move(delta)},
        {"logprobs", role_delta ? json(nullptr) : chat_logprobs_json(choice, tokenizer)},
        {"finish_reason", choice.finish_reason ? json(*choice.finish_reason) : json(nullptr)}}});
  if (!error.ok()) out["error"] = status_error_json(error)["error"];
  return out;
}

Result<json> tokenize_request(const std::string& body, const TextModel& text, int max_context,
                              std::string* model, std::string* error_param) {
  error_param->clear();
  json j;
  FLEX_RETURN_IF_ERROR(parse_body(body, &j));
  FLEX_RETURN_IF_ERROR(refuse_unknown(j,
                                      {"model", "prompt", "messages", "add_special_tokens",
                                       "add_generation_prompt", "chat_template_kwargs"},
                                      error_param));
  FieldReader r{j, error_param};
  FLEX_RETURN_IF_ERROR(read_model(r, model));
  const bool chat = r.get("messages") != nullptr;
  if (chat == (r.get("prompt") != nullptr)) {
    return r.fail(chat ? "prompt" : "prompt", "give either prompt or messages");
  }
  if (text.tokenizer == nullptr) {
    return r.fail(chat ? "messages" : "prompt",
                  "this server has no tokenizer (serve --tokenizer DIR)");
  }
  std::string prompt;
  EncodeOptions encode;
  encode.add_special_tokens = !chat;  // vLLM's defaults: true for a prompt, false for messages.
  FLEX_RETURN_IF_ERROR(r.boolean("add_special_tokens", &encode.add_special_tokens));
  if (chat) {
    FLEX_RETURN_IF_ERROR(render_chat_prompt(j, text, &prompt, error_param));
  } else {
    const json* p = r.get("prompt");
    if (!p->is_string()) return r.fail("prompt", "prompt must be a string");
    prompt = p->get<std::string>();
    for (const char* chat_only : {"add_generation_prompt", "chat_template_kwargs"}) {
      if (r.get(chat_only) != nullptr) {
        return r.fail(chat_only, std::string(chat_only) + " applies to messages only");
      }
    }
  }
  Result<std::vector<int32_t>> ids = text.tokenizer->encode(prompt, encode);
  if (!ids.ok()) return r.fail(chat ? "messages" : "prompt", ids.status().message());
  return json{
      {"count", ids.value().size()}, {"max_model_len", max_context}, {"tokens", ids.value()}};
}

Result<json> detokenize_request(const std::string& body, const TextModel& text, std::string* model,
                                std::string* error_param) {
  error_param->clear();
  json j;
  FLEX_RETURN_IF_ERROR(parse_body(body, &j));
  FLEX_RETURN_IF_ERROR(refuse_unknown(j, {"model", "tokens"}, error_param));
  FieldReader r{j, error_param};
  FLEX_RETURN_IF_ERROR(read_model(r, model));
  const json* tokens = r.get("tokens");
  if (tokens == nullptr || !tokens->is_array()) {
    return r.fail("tokens", "tokens must be a list of token ids");
  }
  if (text.tokenizer == nullptr) {
    return r.fail("tokens", "this server has no tokenizer (serve --tokenizer DIR)");
  }
  std::vector<int32_t> ids;
  FLEX_RETURN_IF_ERROR(r.token_ids("tokens", *tokens, text.tokenizer->vocab_size(), &ids));
  Result<std::string> decoded = text.tokenizer->decode(ids);
  if (!decoded.ok()) return r.fail("tokens", decoded.status().message());
  return json{{"prompt", decoded.value()}};
}

}  // namespace flexpert
