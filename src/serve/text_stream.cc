// SPDX-License-Identifier: Apache-2.0
#include "serve/text_stream.h"

#include <algorithm>

namespace flexpert {

TextStream::TextStream(const Tokenizer& tokenizer, StopStrings stops)
    : tokenizer_(&tokenizer),
      decoder_(tokenizer, /*skip_special_tokens=*/true),
      stops_(std::move(stops)) {}

size_t TextStream::held_suffix(const std::string& text, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const std::string& stop : stops) {
    // Suffixes of `text` shorter than `stop`, longest first.
    const size_t longest = std::min(text.size(), stop.size() - 1);
    for (size_t len = longest; len > best; --len) {
      if (text.compare(text.size() - len, len, stop, 0, len) == 0) {
        best = len;
        break;
      }
    }
  }
  return best;
}

std::string TextStream::advance(const std::string& piece, bool final) {
  if (stopped_) return "";
  held_ += piece;
  // The earliest match wins (then the stop listed first); the held text holds no match
  // from earlier calls, so a match found now ends in `piece`.
  size_t match = std::string::npos;
  const std::string* matched = nullptr;
  for (const std::string& stop : stops_.stop) {
    const size_t at = held_.find(stop);
    if (at < match) {
      match = at;
      matched = &stop;
    }
  }
  std::string out;
  if (matched != nullptr) {
    out = held_.substr(0, match);
    if (stops_.include_stop_str_in_output) out += *matched;
    held_.clear();
    stopped_ = true;
    return out;
  }
  // NOTE: a stop string is valid UTF-8, so a suffix equal to one of its prefixes starts on
  // a character boundary: what is returned never ends in half a character.
  const size_t keep = final ? 0 : held_suffix(held_, stops_.stop);
  out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

Result<std::string> TextStream::push(int32_t id) {
  if (stopped_ || id < 0 || id >= tokenizer_->vocab_size()) return std::string();
  FLEX_ASSIGN_OR_RETURN(std::string piece, decoder_.push(id));
  if (piece.empty()) return std::string();
  return advance(piece, /*final=*/false);
}

std::string TextStream::finish() {
  if (stopped_) return "";
  return advance(decoder_.flush(), /*final=*/true);
}

}  // namespace flexpert
