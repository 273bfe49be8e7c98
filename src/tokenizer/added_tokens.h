// SPDX-License-Identifier: Apache-2.0
// Added tokens (tokenizer.json "added_tokens") and the splitting of text around them before
// normalization and pre-tokenization: leftmost-longest matches, then the token's flags
// (single_word, lstrip, rstrip) as the Rust `tokenizers` AddedVocabulary applies them.
// Immutable after build; thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace flexpert::tok {

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool special = false;
  bool normalized = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// A piece of split text: bytes [begin, end) and the added token it is, or -1.
struct Segment {
  size_t begin = 0;
  size_t end = 0;
  int32_t token_id = -1;
};

class AddedTokenMatcher {
 public:
  // `patterns[i]` is what token i is matched as (its content, normalized for the normalized set).
  AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns);
  AddedTokenMatcher() = default;

  bool empty() const { return tokens_.empty(); }
  // Appends the segments covering `text`. With `skip_special`, special tokens are matched but
  // left in the text (Rust's `encode_special_tokens`).
  void split(std::string_view text, bool skip_special, std::vector<Segment>* out) const;

 private:
  std::vector<AddedToken> tokens_;
  std::vector<std::string> patterns_;
  // Token indices by the first byte of their pattern, longest pattern first.
  std::array<std::vector<int32_t>, 256> by_first_byte_;
};

}  // namespace flexpert::tok
