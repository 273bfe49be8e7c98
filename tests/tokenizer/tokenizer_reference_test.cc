// SPDX-License-Identifier: Apache-2.0
// The published Qwen3 and DeepSeek-V3 tokenizers against Hugging Face's JS tokenizer
// (@huggingface/tokenizers, an independent implementation of the Rust library's pipeline):
// identical ids for every string of testdata/strings.json and for seeded random mixtures of
// them with random code points, and decode(encode(x)) giving x back (Qwen3: x in NFC, its
// normalizer's form). FLEXPERT_TOKENIZER_MIXED=20000 (20,000 mixtures per tokenizer) found no
// difference either on 2026-12-01.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "flexpert/tokenizer.h"
#include "js_reference.h"

namespace {

using nlohmann::json;

std::vector<std::string> hand_written_strings() {
  std::ifstream in(std::string(FLEXPERT_TOKENIZER_TESTDATA_DIR) + "/strings.json");
  const json j = json::parse(in);
  return j["strings"].get<std::vector<std::string>>();
}

// Code points drawn from blocks assigned long ago (Unicode 6 or earlier, so that the
// Unicode versions of PCRE2, utf8proc and the JS engine agree on them): letters of several
// scripts, marks, digits, spaces, punctuation, symbols, emoji.
std::string random_code_point(std::mt19937& rng) {
  static const std::pair<char32_t, char32_t> kRanges[] = {
      {0x20, 0x7E},      {0xA0, 0x17F},    {0x300, 0x36F},   {0x391, 0x3C9},   {0x410, 0x44F},
      {0x5D0, 0x5EA},    {0x620, 0x64A},   {0x660, 0x669},   {0x905, 0x939},   {0x93E, 0x94D},
      {0x966, 0x96F},    {0xE01, 0xE3A},   {0x1100, 0x1112}, {0x2000, 0x200A}, {0x2010, 0x2027},
      {0x2030, 0x205E},  {0x2190, 0x21FF}, {0x2200, 0x22FF}, {0x3000, 0x303F}, {0x3041, 0x3096},
      {0x30A1, 0x30FA},  {0x4E00, 0x9FA5}, {0xAC00, 0xD7A3}, {0xFF01, 0xFF5E}, {0x1F300, 0x1F5FF},
      {0x1F600, 0x1F64F}};
  const auto& [lo, hi] = kRanges[rng() % std::size(kRanges)];
  const char32_t cp = lo + static_cast<char32_t>(rng() % (hi - lo + 1));
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// Mixtures of fragments of the hand-written strings, runs of random code points and special
// tokens, joined by whitespace or nothing, so that boundaries fall in places nobody chose.
// FLEXPERT_TOKENIZER_MIXED=N asks for N of them instead (a longer search for differences).
std::vector<std::string> mixed_strings(const std::vector<std::string>& base,
                                       const std::vector<std::string>& specials, size_t count) {
  if (const char* n = std::getenv("FLEXPERT_TOKENIZER_MIXED")) count = std::stoul(n);
  std::mt19937 rng(20261201);
  const std::vector<std::string> joins = {"", " ", "  ", "\n", "\n\n", "\t", " \n ", "\r\n"};
  std::vector<std::string> out;
  while (out.size() < count) {
    std::string s;
    const int parts = 2 + static_cast<int>(rng() % 5);
    for (int p = 0; p < parts; ++p) {
      if (p > 0) s += joins[rng() % joins.size()];
      if (rng() % 5 == 0) {
        s += specials[rng() % specials.size()];
        continue;
      }
      if (rng() % 3 == 0) {
        const int n = 1 + static_cast<int>(rng() % 12);
        for (int k = 0; k < n; ++k) s += random_code_point(rng);
        continue;
      }
      const std::string& src = base[rng() % base.size()];
      // Whole strings, or a cut at a character boundary.
      size_t begin = src.empty() ? 0 : rng() % src.size();
      while (begin > 0 && (static_cast<unsigned char>(src[begin]) & 0xC0) == 0x80) --begin;
      s += rng() % 2 == 0 ? src : src.substr(begin);
    }
    out.push_back(std::move(s));
  }
  return out;
}

void require_files(const std::string& family) {
  ASSERT_TRUE(std::filesystem::exists(flexpert_test::model_dir(family) + "/tokenizer.json"))
      << flexpert_test::model_dir(family) << "/tokenizer.json is missing: run `npm ci --prefix "
      << flexpert_test::js_dir() << "` (bash scripts/setup.sh --deps-only does)";
}

class ReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceTest, IdsAndRoundTripMatchTheJsTokenizer) {
  const std::string family = GetParam();
  if (const std::string why = flexpert_test::references_missing(); !why.empty())
    GTEST_SKIP() << why;
  ASSERT_NO_FATAL_FAILURE(require_files(family));
  auto tokenizer = flexpert::Tokenizer::load(flexpert_test::model_dir(family));
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().to_string();

  std::vector<std::string> specials;
  if (family == "qwen3") {
    specials = {"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"};
  } else {
    specials = {"<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                "<｜end▁of▁sentence｜>"};
  }
  std::vector<std::string> texts = hand_written_strings();
  const std::vector<std::string> mixed = mixed_strings(texts, specials, 160);
  texts.insert(texts.end(), mixed.begin(), mixed.end());
  ASSERT_GE(texts.size(), 300u);

  std::string error;
  const json answer =
      flexpert_test::run_reference("encode", {{"family", family}, {"texts", texts}}, &error);
  ASSERT_TRUE(error.empty()) << error;
  ASSERT_EQ(answer["ids"].size(), texts.size());

  int mismatches = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto expected = answer["ids"][i].get<std::vector<int32_t>>();
    auto ids = (*tokenizer)->encode(texts[i]);
    ASSERT_TRUE(ids.ok()) << ids.status().to_string();
    if (*ids != expected && ++mismatches <= 20) {
      ADD_FAILURE() << family << " string " << i << " " << json(texts[i]).dump()
                    << "\n  ours: " << json(*ids).dump() << "\n  js:   " << json(expected).dump();
    }
    auto decoded = (*tokenizer)->decode(*ids);
    ASSERT_TRUE(decoded.ok());
    // The JS decode of its own ids: x for DeepSeek-V3 (no normalizer), NFC(x) for Qwen3.
    const std::string js_decoded = answer["decoded"][i].get<std::string>();
    EXPECT_EQ(*decoded, js_decoded) << family << " string " << i;
    if (family == "deepseek_v3") {
      EXPECT_EQ(*decoded, texts[i]) << "string " << i;
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << texts.size() << " strings";
}

INSTANTIATE_TEST_SUITE_P(Published, ReferenceTest, ::testing::Values("qwen3", "deepseek_v3"));

}  // namespace
