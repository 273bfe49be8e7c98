// SPDX-License-Identifier: Apache-2.0
#include "tokenizer/added_tokens.h"

#include <algorithm>

#include "tokenizer/utf8.h"

namespace flexpert::tok {
namespace {

// The code point that ends at byte `end` (exclusive) of valid UTF-8.
char32_t code_point_before(std::string_view s, size_t end) {
  size_t start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return next_code_point(s, &start);
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens,
                                     std::vector<std::string> patterns)
    : tokens_(std::move(tokens)), patterns_(std::move(patterns)) {
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (patterns_[i].empty()) continue;
    by_first_byte_[static_cast<unsigned char>(patterns_[i][0])].push_back(static_cast<int32_t>(i));
  }
  for (auto& list : by_first_byte_) {
    std::stable_sort(list.begin(), list.end(), [&](int32_t a, int32_t b) {
      return patterns_[a].size() > patterns_[b].size();
    });
  }
}

void AddedTokenMatcher::split(std::string_view text, bool skip_special,
                              std::vector<Segment>* out) const {
  size_t done = 0;  // Text before this offset is in `out`.
  size_t pos = 0;
  while (pos < text.size()) {
    const auto& candidates = by_first_byte_[static_cast<unsigned char>(text[pos])];
    int32_t hit = -1;
    for (int32_t idx : candidates) {
      if (text.substr(pos).starts_with(patterns_[idx])) {
        hit = idx;
        break;
      }
    }
    if (hit < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = tokens_[hit];
    size_t start = pos, stop = pos + patterns_[hit].size();
    pos = stop;  // Matching goes on after this match, whether it is kept or not.
    if (skip_special && token.special) continue;
    if (token.single_word) {
      const bool word_before = start > 0 && is_unicode_word(code_point_before(text, start));
      size_t after = stop;
      const bool word_after = stop < text.size() && is_unicode_word(next_code_point(text, &after));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      while (start > done && is_unicode_whitespace(code_point_before(text, start))) {
        size_t cp_start = start - 1;
        while ((static_cast<unsigned char>(text[cp_start]) & 0xC0) == 0x80) --cp_start;
        start = cp_start;
      }
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        size_t next = stop;
        if (!is_unicode_whitespace(next_code_point(text, &next))) break;
        stop = next;
      }
      pos = stop;
    }
    if (done < start) out->push_back({done, start, -1});
    out->push_back({start, stop, token.id});
    done = stop;
  }
  if (done < text.size() || text.empty()) out->push_back({done, text.size(), -1});
}

}  // namespace flexpert::tok
