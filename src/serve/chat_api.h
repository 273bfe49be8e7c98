// SPDX-License-Identifier: Apache-2.0
// The OpenAI-style /v1/chat/completions wire format, and the text routes /tokenize and
// /detokenize in vLLM's shapes. Pure functions over JSON, no I/O.
//
// Messages (system, user, assistant; content a string or a list of {"type": "text"} parts,
// joined with "\n" as vLLM does) are rendered with the tokenizer's chat template
// (`add_generation_prompt`, default true; `chat_template_kwargs.enable_thinking`) and encoded
// without adding special tokens (the template writes them). Sampling fields, stop strings and
// stream options are read by the same functions as /v1/completions (completion_api.h).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "flexpert/chat_template.h"
#include "flexpert/status.h"
#include "flexpert/tokenizer.h"
#include "serve/completion_api.h"

namespace flexpert {

// The model's text layer as the routes see it: both may be null (no tokenizer; a tokenizer
// without a chat template). Owned by the caller, which keeps them for the server's life.
struct TextModel {
  const Tokenizer* tokenizer = nullptr;
  const ChatTemplate* chat_template = nullptr;
};

// Reads body["messages"], `add_generation_prompt` and `chat_template_kwargs` and renders
// them into the prompt text. InvalidArgument naming the field (`messages[1].content[0].type`,
// ...) for anything outside the supported shapes, or when the template rejects them.
Status render_chat_prompt(const nlohmann::json& body, const TextModel& text, std::string* prompt,
                          std::string* error_param);

// A chat request: the rendered prompt becomes out->prompts[0]; the sampling fields through
// parse_sampling_fields (`defaults` for the absent ones); `logprobs` (bool) with
// `top_logprobs` sets params.logprobs; `max_completion_tokens` (or `max_tokens`) defaults to
// the rest of the context; validate_request checks the whole.
Status parse_chat_request(const std::string& body, const TextModel& text, int vocab_size,
                          int max_context, ParsedCompletion* out, std::string* error_param,
                          const SamplingDefaults& defaults = SamplingDefaults());

// Chat logprobs {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}; null when
// the request asked for none.
nlohmann::json chat_logprobs_json(const ChoiceOutput& choice, const Tokenizer* tokenizer);

// A whole non-streaming chat.completion.
nlohmann::json chat_response(const CompletionHeader& header,
                             const std::vector<ChoiceOutput>& choices, size_t prompt_tokens,
                             size_t completion_tokens, const Tokenizer* tokenizer);

// One chat.completion.chunk for one choice: the role delta (`role_delta`), or the choice's new
// content (no "content" key when it has none), its logprobs and finish reason. `error` as in
// completion_chunk.
nlohmann::json chat_chunk(const CompletionHeader& header, const ChoiceOutput& choice,
                          bool role_delta, const Tokenizer* tokenizer,
                          const Status& error = Status());

// POST /tokenize: {"model"?, "prompt" | "messages", "add_special_tokens"?,
// "add_generation_prompt"?, "chat_template_kwargs"?} -> {"count", "max_model_len", "tokens"}.
// `*model` is set to the model named ("" when absent).
Result<nlohmann::json> tokenize_request(const std::string& body, const TextModel& text,
                                        int max_context, std::string* model,
                                        std::string* error_param);
// POST /detokenize: {"model"?, "tokens": [...]} -> {"prompt"}.
Result<nlohmann::json> detokenize_request(const std::string& body, const TextModel& text,
                                          std::string* model, std::string* error_param);

}  // namespace flexpert
