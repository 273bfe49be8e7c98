// SPDX-License-Identifier: Apache-2.0
// `flexpert chat-template`: renders the tokenizer's chat template (tokenizer_config.json) for
// a messages file, as a server would before tokenizing a chat request. Prints the text as is
// (no newline added), or with --ids the ids of that text (the template writes any BOS itself,
// so the post-processor is not applied, as transformers' apply_chat_template does).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli/commands.h"
#include "cli/flags.h"
#include "flexpert/chat_template.h"
#include "flexpert/tokenizer.h"

namespace flexpert::cli {
namespace {

const char kChatTemplateUsage[] =
    "usage: flexpert chat-template --tokenizer DIR --messages FILE.json [flags]\n"
    "  FILE.json: [{\"role\": \"system\"|\"user\"|\"assistant\"|\"tool\", \"content\": ...}, ...]\n"
    "  (- reads stdin). Prints the rendered prompt text.\n";

Result<std::string> read_input(const std::string& path, const std::string& flag) {
  std::ostringstream text;
  if (path == "-") {
    text << std::cin.rdbuf();
    return text.str();
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot read --" + flag + " " + path);
  text << in.rdbuf();
  return text.str();
}

}  // namespace

int cmd_chat_template(const Args& args) {
  Flags flags;
  flags.value("tokenizer", "", "directory with tokenizer.json and tokenizer_config.json")
      .value("messages", "", "JSON file with the messages array, or - for stdin")
      .value("tools", "", "JSON file with an array of tool specifications")
      .value("enable-thinking", "", "true | false: Qwen3's switch (default: the template's)")
      .boolean("add-generation-prompt", "end with the assistant's turn opening")
      .boolean("ids", "print {\"ids\": [...]} of the rendered text instead of the text")
      .boolean("help", "show this help");
  if (Status s = flags.parse(args); !s.ok()) return report_error("chat-template", s);
  if (flags.flag("help")) {
    std::printf("%s%s", kChatTemplateUsage, flags.help().c_str());
    return 0;
  }
  std::string out;
  auto run = [&]() -> Status {
    if (!flags.has("tokenizer")) return invalid_argument("--tokenizer DIR is required");
    if (!flags.has("messages")) return invalid_argument("--messages FILE.json is required");
    ChatRenderOptions options;
    options.add_generation_prompt = flags.flag("add-generation-prompt");
    if (flags.has("enable-thinking")) {
      const std::string v = flags.str("enable-thinking");
      if (v != "true" && v != "false") {
        return invalid_argument("--enable-thinking must be true or false, got '" + v + "'");
      }
      options.enable_thinking = v == "true";
    }
    FLEX_ASSIGN_OR_RETURN(std::string messages, read_input(flags.str("messages"), "messages"));
    if (flags.has("tools")) {
      FLEX_ASSIGN_OR_RETURN(options.tools_json, read_input(flags.str("tools"), "tools"));
    }
    FLEX_ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::load(flags.str("tokenizer")));
    auto tmpl = ChatTemplate::from_tokenizer(*tokenizer);
    if (!tmpl.ok()) return tmpl.status().annotate(flags.str("tokenizer"));
    auto text = (*tmpl)->render(messages, options);
    if (!text.ok()) return text.status().annotate(flags.str("messages"));
    out = std::move(text).value();
    if (flags.flag("ids")) {
      FLEX_ASSIGN_OR_RETURN(auto ids, tokenizer->encode(out, {.add_special_tokens = false}));
      out = nlohmann::json{{"ids", ids}}.dump() + "\n";
    }
    return Status();
  };
  if (Status s = run(); !s.ok()) return report_error("chat-template", s);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace flexpert::cli
