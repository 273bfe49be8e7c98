// SPDX-License-Identifier: Apache-2.0
// ChatTemplate (include/flexpert/chat_template.h) over the Jinja-subset interpreter of
// src/tokenizer/jinja.
#include "flexpert/chat_template.h"

#include <nlohmann/json.hpp>

#include "flexpert/tokenizer.h"
#include "tokenizer/jinja/eval.h"

namespace flexpert {

ChatTemplate::ChatTemplate(std::unique_ptr<jinja::Template> t) : template_(std::move(t)) {}
ChatTemplate::~ChatTemplate() = default;

Result<std::unique_ptr<ChatTemplate>> ChatTemplate::parse(std::string_view source) {
  if (source.empty()) return invalid_argument("the chat template is empty");
  auto t = jinja::parse_template(source);
  if (!t.ok()) return t.status().annotate("chat template");
  return std::unique_ptr<ChatTemplate>(new ChatTemplate(std::move(t).value()));
}

Result<std::unique_ptr<ChatTemplate>> ChatTemplate::from_tokenizer(const Tokenizer& tokenizer) {
  if (tokenizer.chat_template().empty()) {
    return not_found("tokenizer_config.json has no chat_template");
  }
  FLEX_ASSIGN_OR_RETURN(auto t, parse(tokenizer.chat_template()));
  t->default_bos_token_ = tokenizer.bos_token();
  t->default_eos_token_ = tokenizer.eos_token();
  return t;
}

Result<std::string> ChatTemplate::render_variables(std::string_view variables_json) const {
  const auto j = nlohmann::ordered_json::parse(variables_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return invalid_argument("chat template variables are not a JSON object");
  }
  return jinja::render(*template_, jinja::Value::from_json(j));
}

Result<std::string> ChatTemplate::render(std::string_view messages_json,
                                         const ChatRenderOptions& options) const {
  auto messages = nlohmann::ordered_json::parse(messages_json, nullptr, /*allow_exceptions=*/false);
  if (messages.is_discarded() || !messages.is_array()) {
    return invalid_argument("messages are not a JSON array");
  }
  for (const auto& m : messages) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return invalid_argument("every message needs a string \"role\"");
    }
  }
  nlohmann::ordered_json vars = nlohmann::ordered_json::object();
  vars["messages"] = std::move(messages);
  vars["add_generation_prompt"] = options.add_generation_prompt;
  vars["bos_token"] = options.bos_token.empty() ? default_bos_token_ : options.bos_token;
  vars["eos_token"] = options.eos_token.empty() ? default_eos_token_ : options.eos_token;
  if (options.enable_thinking) vars["enable_thinking"] = *options.enable_thinking;
  if (!options.tools_json.empty()) {
    auto tools = nlohmann::ordered_json::parse(options.tools_json, nullptr, false);
    if (tools.is_discarded() || !tools.is_array())
      return invalid_argument("tools are not a JSON array");
    vars["tools"] = std::move(tools);
  }
  return jinja::render(*template_, jinja::Value::from_json(vars));
}

}  // namespace flexpert
