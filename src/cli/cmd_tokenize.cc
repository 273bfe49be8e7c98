// SPDX-License-Identifier: Apache-2.0
// `flexpert tokenize` and `flexpert detokenize`: the tokenizer module (include/flexpert/
// tokenizer.h) from the command line. tokenize prints one {"ids": [...]} line per input text;
// bad input (unreadable file, a line that is not {"text": "..."}, text that is not UTF-8, ids
// outside the vocabulary) exits 2 with a message naming the line, before anything is printed.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/flags.h"
#include "flexpert/tokenizer.h"

namespace flexpert::cli {
namespace {

using nlohmann::json;

const char kTokenizeUsage[] =
    "usage: flexpert tokenize --tokenizer DIR (--text T | --input FILE.jsonl) [flags]\n"
    "  DIR holds tokenizer.json (and tokenizer_config.json); FILE.jsonl has one {\"text\": ...}\n"
    "  per line (- reads stdin; empty lines are skipped). Prints one {\"ids\": [...]} per text.\n";
const char kDetokenizeUsage[] =
    "usage: flexpert detokenize --tokenizer DIR --ids 1,2,3 [--skip-special] [--json]\n";

// The texts of a JSON-lines file (or stdin), each line {"text": "..."}.
Result<std::vector<std::string>> read_texts(const std::string& path) {
  std::ifstream file;
  std::istream* in = &std::cin;
  if (path != "-") {
    file.open(path, std::ios::binary);
    if (!file) return not_found("cannot read --input " + path);
    in = &file;
  }
  std::vector<std::string> texts;
  std::string line;
  for (int line_no = 1; std::getline(*in, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("text") || !j["text"].is_string()) {
      return invalid_argument(path + ":" + std::to_string(line_no) +
                              ": expected a JSON object {\"text\": \"...\"}");
    }
    texts.push_back(j["text"].get<std::string>());
  }
  return texts;
}

}  // namespace

int cmd_tokenize(const Args& args) {
  Flags flags;
  flags.value("tokenizer", "", "directory with tokenizer.json (and tokenizer_config.json)")
      .value("text", "", "one text to tokenize")
      .value("input", "", "JSON-lines file of {\"text\": ...}, or - for stdin")
      .boolean("no-add-special", "skip the post-processor (no BOS/EOS the file would add)")
      .boolean("literal-special", "special tokens written in the text are plain text")
      .boolean("help", "show this help");
  if (Status s = flags.parse(args); !s.ok()) return report_error("tokenize", s);
  if (flags.flag("help")) {
    std::printf("%s%s", kTokenizeUsage, flags.help().c_str());
    return 0;
  }
  std::vector<std::vector<int32_t>> results;
  auto run = [&]() -> Status {
    if (!flags.has("tokenizer")) return invalid_argument("--tokenizer DIR is required");
    if (flags.has("text") == flags.has("input")) {
      return invalid_argument("give exactly one of --text T and --input FILE.jsonl");
    }
    std::vector<std::string> texts;
    if (flags.has("text")) {
      texts.push_back(flags.str("text"));
    } else {
      FLEX_ASSIGN_OR_RETURN(texts, read_texts(flags.str("input")));
    }
    FLEX_ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::load(flags.str("tokenizer")));
    EncodeOptions options;
    options.add_special_tokens = !flags.flag("no-add-special");
    options.parse_special_tokens = !flags.flag("literal-special");
    for (size_t i = 0; i < texts.size(); ++i) {
      auto ids = tokenizer->encode(texts[i], options);
      if (!ids.ok()) {
        return flags.has("text") ? ids.status()
                                 : ids.status().annotate("text " + std::to_string(i + 1));
      }
      results.push_back(std::move(ids).value());
    }
    return Status();
  };
  if (Status s = run(); !s.ok()) return report_error("tokenize", s);
  for (const auto& ids : results) std::printf("%s\n", json{{"ids", ids}}.dump().c_str());
  return 0;
}

int cmd_detokenize(const Args& args) {
  Flags flags;
  flags.value("tokenizer", "", "directory with tokenizer.json (and tokenizer_config.json)")
      .value("ids", "", "comma-separated token ids")
      .boolean("skip-special", "leave special tokens out")
      .boolean("json", "print {\"text\": ...} instead of the bare text")
      .boolean("help", "show this help");
  if (Status s = flags.parse(args); !s.ok()) return report_error("detokenize", s);
  if (flags.flag("help")) {
    std::printf("%s%s", kDetokenizeUsage, flags.help().c_str());
    return 0;
  }
  std::string text;
  auto run = [&]() -> Status {
    if (!flags.has("tokenizer")) return invalid_argument("--tokenizer DIR is required");
    if (!flags.has("ids")) return invalid_argument("--ids 1,2,3 is required");
    FLEX_ASSIGN_OR_RETURN(std::vector<int64_t> ids64, flags.int_list("ids"));
    std::vector<int32_t> ids;
    for (int64_t id : ids64) {
      if (id < 0 || id > INT32_MAX)
        return invalid_argument("token id " + std::to_string(id) + " is out of range");
      ids.push_back(static_cast<int32_t>(id));
    }
    FLEX_ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::load(flags.str("tokenizer")));
    FLEX_ASSIGN_OR_RETURN(text, tokenizer->decode(ids, flags.flag("skip-special")));
    return Status();
  };
  if (Status s = run(); !s.ok()) return report_error("detokenize", s);
  if (flags.flag("json")) {
    std::printf("%s\n", json{{"text", text}}.dump().c_str());
  } else {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fputc('\n', stdout);
  }
  return 0;
}

}  // namespace flexpert::cli
