// SPDX-License-Identifier: Apache-2.0
// The parts of a loaded Tokenizer (private to the module): what tokenizer.json's normalizer,
// pre_tokenizer, model, post_processor and decoder became. Built once by tokenizer_load.cc,
// then read-only.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "flexpert/tokenizer.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace flexpert {

namespace tok {

// Rust's SplitDelimiterBehavior.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel } kind = Kind::kSplit;
  std::unique_ptr<Regex> regex;  // kSplit, and kByteLevel with use_regex.
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // kByteLevel.
};

// One item of a TemplateProcessing "single" template: special ids, or the sequence itself.
struct TemplateItem {
  bool is_sequence = false;
  std::vector<int32_t> ids;
};

}  // namespace tok

struct Tokenizer::Impl {
  std::vector<tok::NormalForm> normalizers;  // Applied in order; empty: none.
  std::vector<tok::PreTokenizerStep> pre_tokenizer;
  std::unique_ptr<tok::BpeModel> bpe;
  tok::AddedTokenMatcher raw_added;         // normalized: false, matched on the input.
  tok::AddedTokenMatcher normalized_added;  // normalized: true, matched after normalization.
  std::optional<std::vector<tok::TemplateItem>> post_template;  // nullopt: ids unchanged.

  std::vector<std::string> id_to_token;  // The vocabulary's spelling ("" for holes).
  std::vector<std::string> id_to_bytes;  // What the ByteLevel decoder makes of each id.
  std::vector<bool> special;
  std::unordered_map<std::string, int32_t> token_to_id;

  SpecialTokenIds special_ids;
  std::string bos_token, eos_token;
  std::string chat_template;

  void encode_plain(std::string_view text, std::vector<int32_t>* ids) const;
  Status encode_normalized(std::string_view text, bool parse_special,
                           std::vector<int32_t>* ids) const;
};

}  // namespace flexpert
