// SPDX-License-Identifier: Apache-2.0
// Request parsing and response shapes of the completions API, without a server.
#include "serve/completion_api.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace flexpert {
namespace {

using nlohmann::json;

constexpr int kVocab = 100;
constexpr int kContext = 64;

struct Parsed {
  Status status;
  std::string param;
  ParsedCompletion out;
};

Parsed parse(const std::string& body) {
  Parsed p;
  p.status = parse_completion_request(body, kVocab, kContext, &p.out, &p.param);
  return p;
}

TEST(CompletionApiTest, DefaultsFollowOpenAI) {
  Parsed p = parse(R"({"prompt": [1, 2, 3], "model": "whatever", "user": "x"})");
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  const SamplingParams& s = p.out.request.params;
  EXPECT_EQ(p.out.request.prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(s.max_tokens, 16);
  EXPECT_EQ(s.temperature, 1.0f);
  EXPECT_EQ(s.top_p, 1.0f);
  EXPECT_EQ(s.top_k, 0);
  EXPECT_FALSE(s.ignore_eos);
  EXPECT_FALSE(p.out.has_seed);
  EXPECT_FALSE(p.out.stream);
}

TEST(CompletionApiTest, ReadsEveryField) {
  Parsed p = parse(R"({"prompt": [[5, 6]], "max_tokens": 8, "temperature": 0, "top_p": 0.5,
                       "top_k": 3, "seed": -1, "stream": true, "stop_token_ids": [9],
                       "ignore_eos": true, "stream_options": {"include_usage": true},
                       "n": 1, "stop": null, "logprobs": null, "echo": false})");
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  const SamplingParams& s = p.out.request.params;
  EXPECT_EQ(p.out.request.prompt, (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(s.max_tokens, 8);
  EXPECT_EQ(s.temperature, 0.0f);
  EXPECT_EQ(s.top_p, 0.5f);
  EXPECT_EQ(s.top_k, 3);
  EXPECT_TRUE(p.out.has_seed);
  EXPECT_EQ(s.seed, ~uint64_t{0});
  EXPECT_TRUE(p.out.stream);
  EXPECT_TRUE(p.out.include_usage);
  EXPECT_EQ(s.stop_token_ids, (std::vector<int32_t>{9}));
  EXPECT_TRUE(s.ignore_eos);
}

TEST(CompletionApiTest, NullMeansDefaultAndTopKMinusOneIsOff) {
  Parsed p = parse(R"({"prompt": [1], "max_tokens": null, "temperature": null, "top_k": -1})");
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  EXPECT_EQ(p.out.request.params.max_tokens, 16);
  EXPECT_EQ(p.out.request.params.top_k, 0);
}

TEST(CompletionApiTest, RejectsBadRequestsNamingTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", ""},
      {"[1, 2]", ""},
      {"{}", "prompt"},
      {R"({"prompt": null})", "prompt"},
      {R"({"prompt": []})", "prompt"},
      {R"({"prompt": [[]]})", "prompt"},
      {R"({"prompt": "hello"})", "prompt"},
      {R"({"prompt": ["a"]})", "prompt"},
      {R"({"prompt": [1, 2.5]})", "prompt"},
      {R"({"prompt": [1, true]})", "prompt"},
      {R"({"prompt": [[1], []]})", "prompt"},
      {R"({"prompt": [[1], 2]})", "prompt"},
      {R"({"prompt": [100]})", "prompt"},
      {R"({"prompt": [-1]})", "prompt"},
      {R"({"prompt": [18446744073709551615]})", "prompt"},
      {R"({"prompt": [4294967297]})", "prompt"},
      {R"({"prompt": 5})", "prompt"},
      {R"({"prompt": [1], "max_tokens": 0})", "max_tokens"},
      {R"({"prompt": [1], "max_tokens": "5"})", "max_tokens"},
      {R"({"prompt": [1], "max_tokens": 64})", "max_tokens"},
      {R"({"prompt": [1], "max_tokens": 18446744073709551615})", "max_tokens"},
      {R"({"prompt": [1], "temperature": -0.1})", "temperature"},
      {R"({"prompt": [1], "temperature": "hot"})", "temperature"},
      {R"({"prompt": [1], "temperature": 1e300})", "temperature"},
      {R"({"prompt": [1], "top_p": 0})", "top_p"},
      {R"({"prompt": [1], "top_p": 1.5})", "top_p"},
      {R"({"prompt": [1], "top_k": -2})", "top_k"},
      {R"({"prompt": [1], "top_k": 1.5})", "top_k"},
      {R"({"prompt": [1], "seed": "x"})", "seed"},
      {R"({"prompt": [1], "stream": "yes"})", "stream"},
      {R"({"prompt": [1], "ignore_eos": 1})", "ignore_eos"},
      {R"({"prompt": [1], "stop_token_ids": 3})", "stop_token_ids"},
      {R"({"prompt": [1], "stop_token_ids": [100]})", "stop_token_ids"},
      {R"({"prompt": [1], "stream_options": 1})", "stream_options"},
      {R"({"prompt": [1], "n": 0})", "n"},
      {R"({"prompt": [1], "n": 65})", "n"},
      {R"({"prompt": [[1], [2]], "n": 33})", "n"},
      // Without a tokenizer: no text prompts, stop strings or echo.
      {R"({"prompt": [1], "stop": ["\n"]})", "stop"},
      {R"({"prompt": [1], "stop": "x"})", "stop"},
      {R"({"prompt": [1], "stop": ["a", "b", "c", "d", "e"]})", "stop"},
      {R"({"prompt": [1], "stop": [""]})", "stop"},
      {R"({"prompt": [1], "stop": [1]})", "stop"},
      {"{\"prompt\": [1], \"stop\": \"" + std::string(257, 'a') + "\"}", "stop"},
      {R"({"prompt": [1], "echo": true})", "echo"},
      {R"({"prompt": [1], "logprobs": 21})", "logprobs"},
      {R"({"prompt": [1], "logprobs": 18446744073709551615})", "logprobs"},
      {R"({"prompt": [1], "logprobs": -1})", "logprobs"},
      {R"({"prompt": [1], "logprobs": true})", "logprobs"},
      {R"({"prompt": [1], "presence_penalty": 2.5})", "presence_penalty"},
      {R"({"prompt": [1], "presence_penalty": "x"})", "presence_penalty"},
      {R"({"prompt": [1], "frequency_penalty": -3})", "frequency_penalty"},
      {R"({"prompt": [1], "repetition_penalty": 0})", "repetition_penalty"},
      {R"({"prompt": [1], "repetition_penalty": 1e300})", "repetition_penalty"},
      {R"({"prompt": [1], "logit_bias": {"5": 101}})", "logit_bias"},
      {R"({"prompt": [1], "logit_bias": {"5": "x"}})", "logit_bias"},
      {R"({"prompt": [1], "logit_bias": {"100": 1}})", "logit_bias"},
      {R"({"prompt": [1], "logit_bias": {"-1": 1}})", "logit_bias"},
      {R"({"prompt": [1], "logit_bias": {"5x": 1}})", "logit_bias"},
      {R"({"prompt": [1], "logit_bias": {"99999999999999999999": 1}})", "logit_bias"},
      {R"({"prompt": [1], "stream_options": {"continuous_usage_stats": true}})", "stream_options"},
      {R"({"prompt": [1], "logit_bias": [1]})", "logit_bias"},
      {R"({"prompt": [1], "min_tokens": 17})", "min_tokens"},
      {R"({"prompt": [1], "min_tokens": -1})", "min_tokens"},
      // Fields this server cannot honour are refused by name, never ignored.
      {R"({"prompt": [1], "best_of": 2})", "best_of"},
      {R"({"prompt": [1], "suffix": "x"})", "suffix"},
      {R"({"prompt": [1], "model": 7})", "model"},
      {R"({"prompt": [1], "user": 7})", "user"},
  };
  for (const auto& [body, param] : cases) {
    Parsed p = parse(body);
    EXPECT_EQ(p.status.code(), StatusCode::kInvalidArgument) << body;
    EXPECT_EQ(p.param, param) << body << ": " << p.status.message();
    EXPECT_FALSE(p.status.message().empty()) << body;
  }
}

TEST(CompletionApiTest, LogitProcessingFieldsAndLogprobs) {
  Parsed p = parse(R"({"prompt": [1], "presence_penalty": -0.5, "frequency_penalty": 2,
                       "repetition_penalty": 1.25, "logit_bias": {"5": 100, "0": -100.0},
                       "min_tokens": 4, "max_tokens": 8, "logprobs": 20, "ignore_eos": true})");
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  const SamplingParams& s = p.out.request.params;
  EXPECT_EQ(s.presence_penalty, -0.5f);
  EXPECT_EQ(s.frequency_penalty, 2.0f);
  EXPECT_EQ(s.repetition_penalty, 1.25f);
  std::vector<std::pair<int32_t, float>> bias = s.logit_bias;
  std::sort(bias.begin(), bias.end());
  EXPECT_EQ(bias, (std::vector<std::pair<int32_t, float>>{{0, -100.0f}, {5, 100.0f}}));
  EXPECT_EQ(s.min_tokens, 4);
  EXPECT_EQ(s.logprobs, 20);
  EXPECT_TRUE(s.ignore_eos);
  // Absent: no processing, no logprobs (the fast path).
  Parsed plain = parse(R"({"prompt": [1], "logprobs": null})");
  ASSERT_TRUE(plain.status.ok());
  EXPECT_FALSE(plain.out.request.params.needs_logits());
}

TEST(CompletionApiTest, GenerationConfigDefaultsFillOmittedFields) {
  SamplingDefaults d;
  d.temperature = 0.6f;
  d.top_p = 0.95f;
  d.top_k = 20;
  d.repetition_penalty = 1.05f;
  ParsedCompletion out;
  std::string param;
  ASSERT_TRUE(
      parse_completion_request(R"({"prompt": [1]})", kVocab, kContext, &out, &param, nullptr, d)
          .ok());
  EXPECT_EQ(out.request.params.temperature, 0.6f);
  EXPECT_EQ(out.request.params.top_p, 0.95f);
  EXPECT_EQ(out.request.params.top_k, 20);
  EXPECT_EQ(out.request.params.repetition_penalty, 1.05f);
  // A request's own values win, null included as "unset".
  ASSERT_TRUE(parse_completion_request(
                  R"({"prompt": [1], "temperature": 0, "top_k": -1, "top_p": null,
                      "repetition_penalty": 1})",
                  kVocab, kContext, &out, &param, nullptr, d)
                  .ok());
  EXPECT_EQ(out.request.params.temperature, 0.0f);
  EXPECT_EQ(out.request.params.top_k, 0);
  EXPECT_EQ(out.request.params.top_p, 0.95f);
  EXPECT_EQ(out.request.params.repetition_penalty, 1.0f);
}

TEST(CompletionApiTest, LogprobsRenderInTheLegacyShape) {
  const std::vector<TokenLogprob> lps = {{5, -0.5f, {{5, -0.5f}, {9, -1.25f}}},
                                         {3, -2.0f, {{9, -0.75f}, {4, -1.0f}}}};
  ChoiceOutput choice;
  choice.tokens = {5, 3};
  choice.logprobs = lps;
  choice.with_logprobs = true;
  choice.finish_reason = "length";
  const json j = completion_response({"cmpl-1", 1, "m"}, {choice}, 2, 2);
  const json& lp = j["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json({"token_id:5", "token_id:3"}));
  EXPECT_EQ(lp["token_logprobs"], json({-0.5, -2.0}));
  // Code points of the earlier tokens' strings ("token_id:5" is 10).
  EXPECT_EQ(lp["text_offset"], json({0, 10}));
  // The top entries plus the sampled token (vLLM's form).
  EXPECT_EQ(lp["top_logprobs"][0], json({{"token_id:5", -0.5}, {"token_id:9", -1.25}}));
  EXPECT_EQ(lp["top_logprobs"][1],
            json({{"token_id:9", -0.75}, {"token_id:4", -1.0}, {"token_id:3", -2.0}}));
  const json chunk = completion_chunk({"cmpl-1", 1, "m"}, choice);
  EXPECT_TRUE(chunk["choices"][0]["logprobs"].is_object());
  choice.with_logprobs = false;
  EXPECT_TRUE(completion_chunk({"cmpl-1", 1, "m"}, choice)["choices"][0]["logprobs"].is_null());
}

TEST(CompletionApiTest, NeutralValuesOfUnsupportedOptionsAreAccepted) {
  Parsed p = parse(R"({"prompt": [1], "presence_penalty": 0, "frequency_penalty": 0.0,
                       "logit_bias": {}, "best_of": 1, "model": "tiny", "user": "u-1"})");
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  EXPECT_EQ(p.out.model, "tiny");  // The server compares it with the name it serves.
}

TEST(CompletionApiTest, ContextLimitCountsPromptAndMaxTokens) {
  EXPECT_TRUE(parse(R"({"prompt": [1, 2, 3, 4], "max_tokens": 60})").status.ok());
  Parsed p = parse(R"({"prompt": [1, 2, 3, 4], "max_tokens": 61})");
  EXPECT_EQ(p.param, "max_tokens");
  EXPECT_NE(p.status.message().find("context length 64"), std::string::npos);
}

TEST(CompletionApiTest, ListsOfPromptsAndChoices) {
  Parsed p = parse(R"({"prompt": [[1, 2], [3]], "n": 2, "logprobs": 3})");
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  EXPECT_EQ(p.out.prompts, (std::vector<std::vector<int32_t>>{{1, 2}, {3}}));
  EXPECT_EQ(p.out.n, 2);
  EXPECT_EQ(p.out.request.params.logprobs, 3);
  EXPECT_EQ(parse(R"({"prompt": [1]})").out.request.params.logprobs, -1);
}

TEST(CompletionApiTest, ResponseShapes) {
  const CompletionHeader h{"cmpl-7", 1700000000, "tiny"};
  ChoiceOutput a;
  a.tokens = {4, 5};
  a.finish_reason = "length";
  ChoiceOutput b;
  b.index = 1;
  b.tokens = {6};
  b.finish_reason = "stop";
  const json r = completion_response(h, {a, b}, 3, 3);
  EXPECT_EQ(r["id"], "cmpl-7");
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["created"], 1700000000);
  EXPECT_EQ(r["model"], "tiny");
  EXPECT_EQ(r["choices"][0]["token_ids"], json({4, 5}));
  EXPECT_EQ(r["choices"][0]["text"], "");
  EXPECT_TRUE(r["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r["choices"][1]["index"], 1);
  EXPECT_EQ(r["choices"][1]["finish_reason"], "stop");
  EXPECT_EQ(r["usage"],
            json({{"prompt_tokens", 3}, {"completion_tokens", 3}, {"total_tokens", 6}}));

  ChoiceOutput piece;
  piece.tokens = {9};
  const json c = completion_chunk(h, piece);
  EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(c.contains("error"));
  ChoiceOutput last;
  last.finish_reason = "error";
  const json e = completion_chunk(h, last, nullptr, unavailable("rank 2 died"));
  EXPECT_EQ(e["choices"][0]["finish_reason"], "error");
  EXPECT_EQ(e["error"]["message"], "rank 2 died");
  EXPECT_EQ(e["error"]["code"], "UNAVAILABLE");

  // Legacy logprobs without a tokenizer: tokens spelled "token_id:N" (vLLM), offsets in code
  // points of those strings.
  ChoiceOutput lp;
  lp.tokens = {4, 12};
  lp.with_logprobs = true;
  lp.text_offset = 5;
  lp.logprobs = {{4, -0.5f, {{4, -0.5f}, {7, -1.5f}}}, {12, -2.0f, {{3, -0.25f}, {12, -2.0f}}}};
  const json l = legacy_logprobs_json(lp, nullptr);
  EXPECT_EQ(l["tokens"], json({"token_id:4", "token_id:12"}));
  EXPECT_EQ(l["token_logprobs"], json({-0.5, -2.0}));
  EXPECT_EQ(l["top_logprobs"][0], json({{"token_id:4", -0.5}, {"token_id:7", -1.5}}));
  EXPECT_EQ(l["text_offset"], json({5, 15}));  // "token_id:4" has 10 code points.

  const json err = error_json("bad", "invalid_request_error", "prompt");
  EXPECT_EQ(err, json::parse(R"({"error": {"message": "bad", "type": "invalid_request_error",
                                           "param": "prompt", "code": null}})"));
  EXPECT_EQ(http_status_for(invalid_argument("x")), 400);
  EXPECT_EQ(http_status_for(unavailable("x")), 503);
  EXPECT_EQ(http_status_for(internal_error("x")), 500);
  EXPECT_EQ(sse_event("[DONE]"), "data: [DONE]\n\n");
  // Invalid UTF-8 (say, echoed from a request) must not throw.
  EXPECT_NO_THROW(dump_json(error_json("bad \xff byte", "x")));
}

}  // namespace
}  // namespace flexpert
