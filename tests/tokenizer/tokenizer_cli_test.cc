// SPDX-License-Identifier: Apache-2.0
// `flexpert tokenize` / `detokenize` / `chat-template` as a user runs them on the published Qwen3
// tokenizer: the same ids as the library (itself checked against the JS reference), JSON-lines
// input, and exit code 2 with a message for bad input.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "../common/run_flexpert.h"
#include "../common/scratch_dir.h"
#include "flexpert/chat_template.h"
#include "flexpert/tokenizer.h"
#include "js_reference.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class TokenizerCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = flexpert_test::model_dir("qwen3");
    if (!fs::exists(model_ + "/tokenizer.json")) {
      GTEST_SKIP() << model_ << " missing: bash scripts/setup.sh --deps-only installs it";
    }
  }
  std::string write(const std::string& name, const std::string& text) {
    return scratch_.write(name, text);
  }
  flexpert_test::ScratchDir scratch_{"flexpert_tok_cli"};
  const fs::path& dir_ = scratch_.path();
  std::string model_;
};

TEST_F(TokenizerCliTest, TokenizeAndDetokenize) {
  auto tokenizer = flexpert::Tokenizer::load(model_);
  ASSERT_TRUE(tokenizer.ok());
  const std::string a = "Hello, world! 你好 🙂", b = "<|im_start|>user\nhi<|im_end|>";
  const auto ids_a = (*tokenizer)->encode(a).value();
  const auto ids_b = (*tokenizer)->encode(b).value();

  flexpert_test::CliRun r =
      flexpert_test::run_flexpert("tokenize --tokenizer " + model_ + " --text '" + a + "'");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(json::parse(r.out), json({{"ids", ids_a}}));

  const std::string input =
      write("in.jsonl", json({{"text", a}}).dump() + "\n\n" + json({{"text", b}}).dump() + "\n");
  r = flexpert_test::run_flexpert("tokenize --tokenizer " + model_ + " --input " + input);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::istringstream lines(r.out);
  std::string line;
  std::getline(lines, line);
  EXPECT_EQ(json::parse(line), json({{"ids", ids_a}}));
  std::getline(lines, line);
  EXPECT_EQ(json::parse(line), json({{"ids", ids_b}}));
  EXPECT_FALSE(std::getline(lines, line));

  std::string csv;
  for (int32_t id : ids_b) {
    if (!csv.empty()) csv += ",";
    csv += std::to_string(id);
  }
  r = flexpert_test::run_flexpert("detokenize --tokenizer " + model_ + " --ids " + csv + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(json::parse(r.out)["text"], b);
  r = flexpert_test::run_flexpert("detokenize --tokenizer " + model_ + " --ids " + csv +
                                  " --skip-special");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out, "user\nhi\n");
}

TEST_F(TokenizerCliTest, ChatTemplate) {
  auto tokenizer = flexpert::Tokenizer::load(model_);
  ASSERT_TRUE(tokenizer.ok());
  auto tmpl = flexpert::ChatTemplate::from_tokenizer(**tokenizer);
  ASSERT_TRUE(tmpl.ok()) << tmpl.status().to_string();
  const std::string messages =
      R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}])";
  const std::string file = write("messages.json", messages);
  flexpert::ChatRenderOptions options;
  options.add_generation_prompt = true;
  options.enable_thinking = false;
  const std::string expected = (*tmpl)->render(messages, options).value();
  ASSERT_NE(expected.find("<think>\n\n</think>"), std::string::npos);

  flexpert_test::CliRun r =
      flexpert_test::run_flexpert("chat-template --tokenizer " + model_ + " --messages " + file +
                                  " --add-generation-prompt --enable-thinking false");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out, expected);
  r = flexpert_test::run_flexpert("chat-template --tokenizer " + model_ + " --messages " + file +
                                  " --add-generation-prompt --enable-thinking false --ids");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(json::parse(r.out),
            json({{"ids", (*tokenizer)->encode(expected, {.add_special_tokens = false}).value()}}));
}

TEST_F(TokenizerCliTest, SynthWithTokenizer) {
  const std::string out = (dir_ / "model").string();
  flexpert_test::CliRun r = flexpert_test::run_flexpert(
      "synth --preset tiny --layers 1 --dtype bf16 --tokenizer " + model_ + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::ifstream config_file(out + "/config.json");
  const json config = json::parse(config_file);
  auto tokenizer = flexpert::Tokenizer::load(out);  // The copied files load.
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().to_string();
  EXPECT_EQ(config["vocab_size"], (*tokenizer)->vocab_size());
  // Qwen3's tokenizer_config.json names <|im_end|> as its eos_token.
  EXPECT_EQ(config["eos_token_id"], *(*tokenizer)->token_to_id("<|im_end|>"));
  r = flexpert_test::run_flexpert("synth --preset tiny --layers 1 --vocab-size 1000 --tokenizer " +
                                  model_ + " --out " + out);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("smaller than the tokenizer"), std::string::npos) << r.out;
}

TEST_F(TokenizerCliTest, BadInputExitsWithTwoAndAMessage) {
  const std::string bad_line = write("bad.jsonl", "{\"text\": \"ok\"}\n{\"txt\": 1}\n");
  const std::string t = " --tokenizer " + model_;
  const std::string messages = write("m.json", R"([{"role": "user", "content": "x"}])");
  const std::string no_template = (dir_ / "no_template").string();
  fs::create_directories(no_template);
  fs::create_symlink(model_ + "/tokenizer.json", no_template + "/tokenizer.json");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"tokenize --text hi", "--tokenizer DIR is required"},
      {"tokenize" + t, "exactly one of"},
      {"tokenize" + t + " --text hi --input x.jsonl", "exactly one of"},
      {"tokenize --tokenizer /nonexistent --text hi", "tokenizer.json"},
      {"tokenize" + t + " --input /nonexistent.jsonl", "cannot read"},
      {"tokenize" + t + " --input " + bad_line, "bad.jsonl:2"},
      {"tokenize" + t + " --text \"$(printf '\\377')\"", "UTF-8"},
      {"tokenize" + t + " --text hi --bogus", "bogus"},
      {"detokenize" + t, "--ids"},
      {"detokenize" + t + " --ids 1,x", "--ids"},
      {"detokenize" + t + " --ids 1,999999", "outside"},
      {"detokenize" + t + " --ids -5", "out of range"},
      {"chat-template" + t, "--messages"},
      {"chat-template" + t + " --messages /nonexistent.json", "cannot read"},
      {"chat-template" + t + " --messages " + bad_line, "not a JSON array"},
      {"chat-template" + t + " --messages " + messages + " --enable-thinking maybe",
       "true or false"},
      {"chat-template --tokenizer " + no_template + " --messages " + messages, "no chat_template"},
  };
  for (const auto& [args, says] : cases) {
    const flexpert_test::CliRun r = flexpert_test::run_flexpert(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(says), std::string::npos) << args << "\n" << r.out;
  }
}

TEST_F(TokenizerCliTest, GenerateFromTextAndChat) {
  // The ids a text prompt or a chat runs are those of --prompt-ids with the library's encoding
  // (checked against the JS references in tokenizer_test), and the text is their decoding.
  const std::string model = (dir_ / "model").string();
  flexpert_test::CliRun r = flexpert_test::run_flexpert(
      "synth --preset tiny --layers 1 --tokenizer " + model_ + " --out " + model);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto tokenizer = flexpert::Tokenizer::load(model_);
  ASSERT_TRUE(tokenizer.ok());
  auto generate = [&](const std::string& input) {
    flexpert_test::CliRun g = flexpert_test::run_flexpert(
        "generate --model " + model + " --max-tokens 6 --ignore-eos --json " + input);
    EXPECT_EQ(g.exit_code, 0) << input << "\n" << g.out;
    return json::parse(g.out.substr(g.out.find('{')))["choices"][0];
  };
  auto ids_arg = [](const std::vector<int32_t>& ids) {
    std::string out = "--prompt-ids ";
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i > 0) out += ",";
      out += std::to_string(ids[i]);
    }
    return out;
  };
  const json text = generate("--prompt 'Grüße, 世界!'");
  const json by_ids = generate(ids_arg((*tokenizer)->encode("Grüße, 世界!").value()));
  EXPECT_EQ(text["token_ids"], by_ids["token_ids"]);
  EXPECT_EQ(text["text"],
            (*tokenizer)->decode(text["token_ids"].get<std::vector<int32_t>>(), true).value());
  const std::string messages = R"([{"role": "user", "content": "Hi"}])";
  const std::string file = write("chat.json", messages);
  auto tmpl = flexpert::ChatTemplate::from_tokenizer(**tokenizer);
  ASSERT_TRUE(tmpl.ok());
  flexpert::ChatRenderOptions options;
  options.add_generation_prompt = true;
  const std::string rendered = (*tmpl)->render(messages, options).value();
  const json chat = generate("--chat " + file);
  EXPECT_EQ(
      chat["token_ids"],
      generate(ids_arg(
          (*tokenizer)->encode(rendered, {.add_special_tokens = false}).value()))["token_ids"]);
  r = flexpert_test::run_flexpert("generate --model " + model + " --prompt x --prompt-ids 1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
}

TEST_F(TokenizerCliTest, ServeRefusesATemplateItCannotRunAtStart) {
  // A template outside the Jinja subset: serve exits 2 before any worker starts, naming it.
  const std::string bad = (dir_ / "bad_template").string();
  fs::create_directories(bad);
  fs::create_symlink(model_ + "/tokenizer.json", bad + "/tokenizer.json");
  write("bad_template/tokenizer_config.json",
        json({{"chat_template", "{% macro m() %}x{% endmacro %}{{ m() }}"}}).dump());
  const std::string model = (dir_ / "model").string();
  flexpert_test::CliRun r = flexpert_test::run_flexpert(
      "synth --preset tiny --layers 1 --dtype bf16 --tokenizer " + model_ + " --out " + model);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  r = flexpert_test::run_flexpert("serve --local --port 0 --model " + model + " --tokenizer " +
                                  bad);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("chat template"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("macro"), std::string::npos) << r.out;
  r = flexpert_test::run_flexpert("serve --local --port 0 --model " + model +
                                  " --tokenizer /nonexistent");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("tokenizer"), std::string::npos) << r.out;
}

}  // namespace
