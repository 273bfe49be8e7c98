// SPDX-License-Identifier: Apache-2.0
// The tokenizer's rules on a small hand-made tokenizer.json whose expected ids follow from
// the Rust `tokenizers` documentation: added-token flags (lstrip, rstrip, single_word, special),
// TemplateProcessing, merges by rank, lossy decoding, streaming detokenization, and the
// errors a server or the CLI turns into 400 / exit 2.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "flexpert/tokenizer.h"
#include "js_reference.h"

namespace {

using flexpert::EncodeOptions;
using flexpert::IncrementalDecoder;
using flexpert::StatusCode;
using flexpert::Tokenizer;
using nlohmann::json;

// GPT-2's byte -> char map, written out from its definition (printable Latin-1 bytes are
// themselves; the rest take U+0100.. in byte order).
std::string byte_char(int b) {
  const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  int cp = b;
  if (!printable) {
    int rank = 0;
    for (int x = 0; x < b; ++x) {
      if (!((x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) ++rank;
    }
    cp = 256 + rank;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

// Byte b has id b; "he" 256, "ll" 257, "hell" 258, "hello" 259; added tokens from 300.
json tiny_tokenizer_json() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["he"] = 256;
  vocab["ll"] = 257;
  vocab["hell"] = 258;
  vocab["hello"] = 259;
  auto added = [](const char* content, int id, bool special, bool lstrip, bool rstrip,
                  bool single_word) {
    return json{{"id", id},
                {"content", content},
                {"special", special},
                {"normalized", false},
                {"lstrip", lstrip},
                {"rstrip", rstrip},
                {"single_word", single_word}};
  };
  return json{
      {"version", "1.0"},
      {"added_tokens",
       {added("[CLS]", 300, true, false, false, false), added("my", 301, false, true, true, false),
        added("ony", 302, false, false, false, true)}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "[CLS]"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"[CLS]", {{"id", "[CLS]"}, {"ids", {300}}, {"tokens", {"[CLS]"}}}}}}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"h e", "l l", "he ll", "hell o"}}}}};
}

// The value of an OK result (a failed expectation and an empty value otherwise).
template <typename T>
T val(flexpert::Result<T> r) {
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? std::move(r).value() : T{};
}

std::unique_ptr<Tokenizer> tiny() {
  auto t = Tokenizer::from_json(tiny_tokenizer_json().dump());
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? std::move(t.value()) : nullptr;
}

std::vector<int32_t> bytes_of(const std::string& s) {
  std::vector<int32_t> ids;
  for (unsigned char c : s) ids.push_back(c);
  return ids;
}

TEST(TokenizerUnitTest, MergesByRankAndTemplateProcessing) {
  auto t = tiny();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(val(t->encode("hello", {.add_special_tokens = false})), std::vector<int32_t>{259});
  EXPECT_EQ(val(t->encode("hello")), (std::vector<int32_t>{300, 259}));  // [CLS] $A
  // "hel": he + l; GPT-2's split keeps the space with the word.
  EXPECT_EQ(val(t->encode("hel hel", {.add_special_tokens = false})),
            (std::vector<int32_t>{256, 'l', ' ', 256, 'l'}));
  EXPECT_EQ(t->vocab_size(), 303);
  EXPECT_EQ(t->token_to_id("hello"), 259);
  EXPECT_EQ(t->token_to_id("[CLS]"), 300);
  EXPECT_EQ(t->token_to_id("nope"), std::nullopt);
  EXPECT_EQ(t->id_to_token(' '), "\xC4\xA0");  // "Ġ"
  EXPECT_TRUE(t->is_special(300));
  EXPECT_FALSE(t->is_special(301));
}

TEST(TokenizerUnitTest, AddedTokenFlags) {
  auto t = tiny();
  ASSERT_NE(t, nullptr);
  // As in the Rust library's AddedVocabulary tests: "my" takes the spaces on both sides
  // (lstrip, rstrip), "ony" inside "Anthony" is no single word, alone it is.
  std::vector<int32_t> expected = {300};
  for (int32_t id : bytes_of(" hi")) expected.push_back(id);
  expected.push_back(301);
  for (const char* w : {"name", " is", " Anthony"}) {
    for (int32_t id : bytes_of(w)) expected.push_back(id);
  }
  EXPECT_EQ(val(t->encode("[CLS] hi my name is Anthony", {.add_special_tokens = false})), expected);
  EXPECT_EQ(val(t->encode("a ony b", {.add_special_tokens = false})),
            (std::vector<int32_t>{'a', ' ', 302, ' ', 'b'}));
  // Special tokens written in the text, unparsed: their text is plain bytes.
  EXPECT_EQ(val(t->encode("[CLS]", {.add_special_tokens = false, .parse_special_tokens = false})),
            bytes_of("[CLS]"));
  // Decoding: special tokens kept or skipped; an added token's own text.
  EXPECT_EQ(val(t->decode(std::vector<int32_t>{300, 259, 301})), "[CLS]hellomy");
  EXPECT_EQ(val(t->decode(std::vector<int32_t>{300, 259, 301}, /*skip_special_tokens=*/true)),
            "hellomy");
}

TEST(TokenizerUnitTest, DecodeReplacesInvalidUtf8LikeRust) {
  auto t = tiny();
  ASSERT_NE(t, nullptr);
  // Maximal invalid subparts become one U+FFFD each (Rust's String::from_utf8_lossy).
  EXPECT_EQ(val(t->decode(bytes_of("a\xF0\x9F"
                                   "b"))),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(val(t->decode(bytes_of("\xC0\x80"))), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(val(t->decode(bytes_of("\xED\xA0\x80"))), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(val(t->decode(bytes_of("x\xE2\x82"))), "x\xEF\xBF\xBD");
  EXPECT_EQ(val(t->decode(bytes_of("\xF0\x9F\x99\x82"))), "\xF0\x9F\x99\x82");
}

// Every push returns whole characters; all pushes + flush == decode(all).
// `bytes` is the tiny tokenizer, whose ids are bytes: decoding a piece's bytes with it changes
// nothing exactly when the piece is valid UTF-8.
void expect_streams_like_decode(const Tokenizer& t, const std::vector<int32_t>& ids,
                                const Tokenizer& bytes) {
  IncrementalDecoder stream(t);
  std::string text;
  for (int32_t id : ids) {
    auto piece = stream.push(id);
    ASSERT_TRUE(piece.ok());
    // A piece is itself valid UTF-8: decoding its bytes changes nothing.
    EXPECT_EQ(val(bytes.decode(bytes_of(*piece))), *piece) << "a piece split a character";
    text += *piece;
  }
  text += stream.flush();
  EXPECT_EQ(text, val(t.decode(ids)));
}

TEST(TokenizerUnitTest, IncrementalDecoderHoldsPartialCharacters) {
  auto t = tiny();
  ASSERT_NE(t, nullptr);
  IncrementalDecoder stream(*t);
  const std::string smile = "\xF0\x9F\x99\x82";
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(val(stream.push(static_cast<unsigned char>(smile[i]))), "");
    EXPECT_EQ(stream.pending_bytes(), static_cast<size_t>(i + 1));
  }
  EXPECT_EQ(val(stream.push(static_cast<unsigned char>(smile[3]))), smile);
  EXPECT_EQ(stream.pending_bytes(), 0u);
  // A broken sequence is replaced as soon as it is known to be broken.
  EXPECT_EQ(val(stream.push(0xE2)), "");
  EXPECT_EQ(val(stream.push('A')),
            "\xEF\xBF\xBD"
            "A");
  // An unfinished tail at the end of the stream.
  EXPECT_EQ(val(stream.push(0xE2)), "");
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
  expect_streams_like_decode(
      *t, bytes_of("h\xC3\xA9llo \xE4\xBD\xA0\xE5\xA5\xBD " + smile + "\xF0\x9F\x99 x\xFF\xC3"),
      *t);
  EXPECT_EQ(val(stream.push(300)), "[CLS]");
  IncrementalDecoder skipping(*t, /*skip_special_tokens=*/true);
  EXPECT_EQ(val(skipping.push(300)), "");
}

TEST(TokenizerUnitTest, IncrementalDecoderOnPublishedTokenizers) {
  auto bytes = tiny();
  ASSERT_NE(bytes, nullptr);
  for (const std::string family : {"qwen3", "deepseek_v3"}) {
    if (!std::filesystem::exists(flexpert_test::model_dir(family) + "/tokenizer.json")) {
      GTEST_SKIP() << "published tokenizer files missing (tokenizer_test's reference test "
                      "says how to install them)";
    }
    auto t = Tokenizer::load(flexpert_test::model_dir(family));
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    for (const char* text :
         {"👨‍👩‍👧‍👦 family 🏳️‍🌈 and 你好，世界 e\u0301",
          "𐌰𐌱𐌲 𝒳𝒴𝒵 ꦗꦮ", "plain ascii text", "ありがとうございます🙇‍♂️"}) {
      auto ids = (*t)->encode(text);
      ASSERT_TRUE(ids.ok());
      expect_streams_like_decode(**t, *ids, *bytes);
    }
  }
}

TEST(TokenizerUnitTest, ConcurrentEncodesAgreeWithOneThread) {
  // One Tokenizer shared by threads, as a server shares it: the per-word cache and PCRE2's
  // per-thread match state must not mix results.
  if (!std::filesystem::exists(flexpert_test::model_dir("qwen3") + "/tokenizer.json")) {
    GTEST_SKIP() << "published tokenizer files missing";
  }
  auto loaded = Tokenizer::load(flexpert_test::model_dir("qwen3"));
  ASSERT_TRUE(loaded.ok());
  const Tokenizer& t = **loaded;
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i) {
    texts.push_back("word" + std::to_string(i * 7919) + " Привет " + std::to_string(i) +
                    " 你好世界 <|im_end|> tail" + std::string(static_cast<size_t>(i % 5), ' '));
  }
  std::vector<std::vector<int32_t>> expected;
  for (const std::string& text : texts) expected.push_back(val(t.encode(text)));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      for (int rep = 0; rep < 20; ++rep) {
        for (size_t i = 0; i < texts.size(); ++i) {
          const size_t k = (i + static_cast<size_t>(w * 13 + rep)) % texts.size();
          auto ids = t.encode(texts[k]);
          if (!ids.ok() || *ids != expected[k]) ++mismatches[w];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

TEST(TokenizerUnitTest, BadInputIsInvalidArgument) {
  auto t = tiny();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->encode("bad \xC3(").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->decode(std::vector<int32_t>{1, 303}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->decode(std::vector<int32_t>{-1}).status().code(), StatusCode::kInvalidArgument);
  IncrementalDecoder stream(*t);
  EXPECT_EQ(stream.push(99999).status().code(), StatusCode::kInvalidArgument);
  // 303 is no token, but 302 is: holes below vocab_size() decode to nothing.
  EXPECT_EQ(Tokenizer::from_json("{").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Tokenizer::load("/nonexistent/dir").status().code(), StatusCode::kNotFound);
}

TEST(TokenizerUnitTest, UnsupportedComponentsFailAtLoad) {
  struct Case {
    const char* key;
    json value;
    StatusCode code;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"normalizer", {{"type", "Lowercase"}}, StatusCode::kUnimplemented, "Lowercase"},
      {"pre_tokenizer", {{"type", "Metaspace"}}, StatusCode::kUnimplemented, "Metaspace"},
      {"decoder", {{"type", "WordPiece"}}, StatusCode::kUnimplemented, "WordPiece"},
      {"post_processor", {{"type", "BertProcessing"}}, StatusCode::kUnimplemented, "Bert"},
      {"pre_tokenizer",
       {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}},
       StatusCode::kInvalidArgument,
       "does not compile"},
  };
  for (const Case& c : cases) {
    json j = tiny_tokenizer_json();
    j[c.key] = c.value;
    auto t = Tokenizer::from_json(j.dump());
    ASSERT_FALSE(t.ok()) << c.key;
    EXPECT_EQ(t.status().code(), c.code) << t.status().to_string();
    EXPECT_NE(t.status().message().find(c.says), std::string::npos) << t.status().to_string();
  }
  json j = tiny_tokenizer_json();
  j["model"]["merges"].push_back("x zz");
  EXPECT_EQ(Tokenizer::from_json(j.dump()).status().code(), StatusCode::kInvalidArgument);
}

TEST(TokenizerUnitTest, SplitBehaviorsFromTheFile) {
  // Digits isolated, then removed: the pattern and behavior come from the file, not the code.
  json j = tiny_tokenizer_json();
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern", {{"String", "-"}}},
         {"behavior", "Removed"},
         {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  auto t = Tokenizer::from_json(j.dump());
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(val((*t)->encode("hello-hello--he", {.add_special_tokens = false})),
            (std::vector<int32_t>{259, 259, 256}));
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "MergedWithPrevious";
  t = Tokenizer::from_json(j.dump());
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(val((*t)->encode("hello-he", {.add_special_tokens = false})),
            (std::vector<int32_t>{259, '-', 256}));
}

}  // namespace
