// SPDX-License-Identifier: Apache-2.0
// ChatTemplate: renders a Hugging Face `chat_template` (Jinja, from tokenizer_config.json)
// into the prompt text that a model was trained on: system prompt, turns, generation prompt.
//
// flexpert runs its own interpreter of the Jinja subset that chat templates use
// (docs/ARCHITECTURE.md, "Chat templates", says which and why). parse() checks the whole
// template, including every filter, test, function and method it names, so a template the
// engine cannot run fails at load, never in the middle of a request. Rendering follows
// transformers' environment (trim_blocks and lstrip_blocks on). A parsed template is
// immutable; render() is thread-safe.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "flexpert/status.h"

namespace flexpert {

class Tokenizer;
namespace jinja {
struct Template;
}

struct ChatRenderOptions {
  bool add_generation_prompt = false;
  // Qwen3's switch; nullopt leaves the variable undefined (the template's default).
  std::optional<bool> enable_thinking;
  // A JSON array of tool specifications, or empty for none.
  std::string tools_json;
  // Values for the template's bos_token / eos_token variables; empty: those of the tokenizer
  // the template came from (from_tokenizer), else empty.
  std::string bos_token;
  std::string eos_token;
};

class ChatTemplate {
 public:
  // InvalidArgument (with line and what is unsupported) when the template uses Jinja outside
  // the subset or is malformed.
  static Result<std::unique_ptr<ChatTemplate>> parse(std::string_view source);
  // The `chat_template` of the tokenizer's tokenizer_config.json, with its bos/eos token
  // strings as render()'s defaults. NotFound when the config has no template.
  static Result<std::unique_ptr<ChatTemplate>> from_tokenizer(const Tokenizer& tokenizer);
  ~ChatTemplate();
  ChatTemplate(const ChatTemplate&) = delete;
  ChatTemplate& operator=(const ChatTemplate&) = delete;

  // `messages_json`: a JSON array of {"role": ..., "content": ..., ...}. InvalidArgument for
  // malformed JSON or when the template rejects the messages (raise_exception, a missing field
  // it needs).
  Result<std::string> render(std::string_view messages_json,
                             const ChatRenderOptions& options) const;
  // The general form: every top-level variable from one JSON object
  // ({"messages": [...], "add_generation_prompt": true, ...}).
  Result<std::string> render_variables(std::string_view variables_json) const;

 private:
  explicit ChatTemplate(std::unique_ptr<jinja::Template> t);
  std::unique_ptr<jinja::Template> template_;
  std::string default_bos_token_, default_eos_token_;
};

}  // namespace flexpert
