// SPDX-License-Identifier: Apache-2.0
// Logit processing and logprobs through HttpServer over a real LocalEngine on
// testdata/qwen3moe-tiny: logprobs do not change greedy tokens (Hugging Face's), one
// entry per token streamed or not; a logit_bias of +100 is obeyed (issue #30's symptom);
// min_tokens holds a stop id back.
#include "serve/http_server.h"
#include "serve/local_engine.h"
#include "serve_test_util.h"

namespace flexpert::testing {
namespace {

class HttpSamplingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto engine = LocalEngine::create(kTinyModelDir, LocalEngineOptions{});
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    engine_ = std::move(engine).value().release();
    HttpOptions options;
    options.port = 0;
    options.model_name = "qwen3moe-tiny";
    server_ = new HttpServer(*engine_, options);
    ASSERT_TRUE(server_->start().ok());
  }
  static void TearDownTestSuite() {
    delete server_;
    delete engine_;
  }
  std::unique_ptr<httplib::Client> client() { return make_client(server_->port()); }

  static LocalEngine* engine_;
  static HttpServer* server_;
};
LocalEngine* HttpSamplingTest::engine_ = nullptr;
HttpServer* HttpSamplingTest::server_ = nullptr;

json request(const RefPrompt& p, int max_tokens = 16) {
  return {{"prompt", p.input_ids}, {"max_tokens", max_tokens}, {"temperature", 0}};
}

// Checks a legacy logprobs object against the tokens: one entry each, the token's own
// logprob in its top entries, and (greedy, no processing) the token the most likely.
void check_logprobs(const json& lp, const std::vector<int32_t>& tokens, size_t k) {
  ASSERT_TRUE(lp.is_object()) << lp.dump();
  ASSERT_EQ(lp["tokens"].size(), tokens.size());
  ASSERT_EQ(lp["token_logprobs"].size(), tokens.size());
  ASSERT_EQ(lp["top_logprobs"].size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string name = "token_id:" + std::to_string(tokens[i]);
    EXPECT_EQ(lp["tokens"][i], name);
    const double logprob = lp["token_logprobs"][i].get<double>();
    EXPECT_LE(logprob, 0.0);
    const json& top = lp["top_logprobs"][i];
    EXPECT_EQ(top.size(), k);  // The greedy token is among the top k.
    double best = -1e30;
    for (const auto& [key, value] : top.items()) best = std::max(best, value.get<double>());
    EXPECT_EQ(top[name].get<double>(), logprob);
    EXPECT_EQ(logprob, best) << i;
  }
}

TEST_F(HttpSamplingTest, LogprobsLeaveGreedyTokensAsTheReference) {
  auto c = client();
  for (const RefPrompt& p : load_reference()) {
    json body = request(p);
    body["logprobs"] = 5;
    HttpReply r = post(*c, "/v1/completions", body);
    ASSERT_EQ(r.status, 200) << r.text;
    const json& choice = r.body["choices"][0];
    const auto tokens = choice["token_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tokens, p.greedy);
    check_logprobs(choice["logprobs"], tokens, 5);

    StreamReply s = stream(*c, body);
    ASSERT_EQ(s.status, 200);
    EXPECT_EQ(s.tokens, p.greedy);
    size_t num_logprobs = 0;
    for (const json& chunk : s.chunks) {
      if (chunk["choices"].empty()) continue;
      const json& ch = chunk["choices"][0];
      const auto chunk_tokens = ch["token_ids"].get<std::vector<int32_t>>();
      if (chunk_tokens.empty()) continue;
      check_logprobs(ch["logprobs"], chunk_tokens, 5);
      num_logprobs += ch["logprobs"]["tokens"].size();
    }
    EXPECT_EQ(num_logprobs, p.greedy.size());
  }
  // Without logprobs: null.
  HttpReply r = post(*c, "/v1/completions", request(load_reference()[0]));
  EXPECT_TRUE(r.body["choices"][0]["logprobs"].is_null());
}

TEST_F(HttpSamplingTest, LogitBiasOfPlus100IsObeyed) {
  auto c = client();
  const RefPrompt p = load_reference()[0];
  for (double temperature : {0.0, 1.0}) {
    json body = request(p, 8);
    body["temperature"] = temperature;
    body["logit_bias"] = {{"123", 100}};
    HttpReply r = post(*c, "/v1/completions", body);
    ASSERT_EQ(r.status, 200) << r.text;
    EXPECT_EQ(r.body["choices"][0]["token_ids"].get<std::vector<int32_t>>(),
              std::vector<int32_t>(8, 123))
        << temperature;
  }
}

TEST_F(HttpSamplingTest, MinTokensHoldsAStopIdBack) {
  auto c = client();
  const RefPrompt p = load_reference()[0];
  const int32_t stop = p.greedy[2];
  const size_t first =
      static_cast<size_t>(std::find(p.greedy.begin(), p.greedy.end(), stop) - p.greedy.begin());
  json body = request(p);
  body["stop_token_ids"] = {stop};
  HttpReply r = post(*c, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.text;
  EXPECT_EQ(r.body["choices"][0]["token_ids"].get<std::vector<int32_t>>(),
            std::vector<int32_t>(p.greedy.begin(), p.greedy.begin() + first + 1));
  EXPECT_EQ(r.body["choices"][0]["finish_reason"], "stop");

  const int min_tokens = static_cast<int>(first) + 3;
  body["min_tokens"] = min_tokens;
  r = post(*c, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.text;
  const auto tokens = r.body["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  ASSERT_GE(tokens.size(), static_cast<size_t>(min_tokens));
  // Up to the stop id the answer is the reference; then it goes past the stop id.
  EXPECT_EQ(std::vector<int32_t>(tokens.begin(), tokens.begin() + first),
            std::vector<int32_t>(p.greedy.begin(), p.greedy.begin() + first));
  for (int i = 0; i < min_tokens; ++i) EXPECT_NE(tokens[i], stop) << i;
}

}  // namespace
}  // namespace flexpert::testing
