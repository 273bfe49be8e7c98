// SPDX-License-Identifier: Apache-2.0
// Encoding and decoding with a loaded Tokenizer (see include/flexpert/tokenizer.h), in the
// order of the Rust `tokenizers` pipeline: added tokens on the raw text, normalizer, added
// tokens flagged `normalized` on the normalized text, pre-tokenizer, BPE, post-processor.
#include <algorithm>
#include <deque>

#include "tokenizer/tokenizer_impl.h"

namespace flexpert {
namespace {

using tok::SplitBehavior;

struct Piece {
  size_t begin, end;
  bool is_match;
};

// Applies a Split's behavior to `text` cut at `matches`, appending the kept pieces.
void split_pieces(std::string_view text, const std::vector<std::pair<size_t, size_t>>& matches,
                  SplitBehavior behavior, bool invert, std::vector<std::string_view>* out) {
  std::vector<Piece> pieces;
  size_t done = 0;
  for (const auto& [b, e] : matches) {
    if (done < b) pieces.push_back({done, b, invert});
    pieces.push_back({b, e, !invert});
    done = e;
  }
  if (done < text.size()) pieces.push_back({done, text.size(), invert});

  std::vector<std::pair<size_t, size_t>> kept;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Piece& p : pieces) kept.emplace_back(p.begin, p.end);
      break;
    case SplitBehavior::kRemoved:
      for (const Piece& p : pieces) {
        if (!p.is_match) kept.emplace_back(p.begin, p.end);
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Piece& p : pieces) {
        if (p.is_match && !previous_match && !kept.empty()) {
          kept.back().second = p.end;
        } else {
          kept.emplace_back(p.begin, p.end);
        }
        previous_match = p.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) {
        if (it->is_match && !previous_match && !kept.empty()) {
          kept.back().first = it->begin;
        } else {
          kept.emplace_back(it->begin, it->end);
        }
        previous_match = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    case SplitBehavior::kContiguous:
      for (size_t i = 0; i < pieces.size(); ++i) {
        if (i > 0 && pieces[i].is_match == previous_match) {
          kept.back().second = pieces[i].end;
        } else {
          kept.emplace_back(pieces[i].begin, pieces[i].end);
        }
        previous_match = pieces[i].is_match;
      }
      break;
  }
  for (const auto& [b, e] : kept) out->push_back(text.substr(b, e - b));
}

}  // namespace

void Tokenizer::Impl::encode_plain(std::string_view text, std::vector<int32_t>* ids) const {
  std::vector<std::string_view> pieces{text}, next;
  std::vector<std::pair<size_t, size_t>> matches;
  std::deque<std::string> prefixed;  // Owns pieces that ByteLevel's add_prefix_space grew.
  for (const tok::PreTokenizerStep& step : pre_tokenizer) {
    next.clear();
    for (std::string_view piece : pieces) {
      if (step.kind == tok::PreTokenizerStep::Kind::kByteLevel && step.add_prefix_space &&
          !piece.starts_with(' ')) {
        std::string& grown = prefixed.emplace_back(1, ' ');
        grown.append(piece);
        piece = grown;
      }
      if (step.regex == nullptr) {
        next.push_back(piece);
        continue;
      }
      matches.clear();
      // find_all fails only when PCRE2 cannot allocate; such a piece stays whole.
      if (!step.regex->find_all(piece, &matches).ok()) {
        next.push_back(piece);
        continue;
      }
      split_pieces(piece, matches, step.behavior, step.invert, &next);
    }
    pieces.swap(next);
  }
  for (std::string_view word : pieces) bpe->encode_word(word, ids);
}

Status Tokenizer::Impl::encode_normalized(std::string_view text, bool parse_special,
                                          std::vector<int32_t>* ids) const {
  std::string normalized;
  std::string_view view = text;
  if (!normalizers.empty() && !tok::is_ascii(text)) {  // Every normal form keeps ASCII as is.
    normalized = std::string(text);
    for (tok::NormalForm form : normalizers) {
      FLEX_ASSIGN_OR_RETURN(normalized, tok::normalize(normalized, form));
    }
    view = normalized;
  }
  if (normalized_added.empty()) {
    encode_plain(view, ids);
    return Status();
  }
  std::vector<tok::Segment> segments;
  normalized_added.split(view, !parse_special, &segments);
  for (const tok::Segment& s : segments) {
    if (s.token_id >= 0) {
      ids->push_back(s.token_id);
    } else if (s.end > s.begin) {
      encode_plain(view.substr(s.begin, s.end - s.begin), ids);
    }
  }
  return Status();
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

Result<std::vector<int32_t>> Tokenizer::encode(std::string_view text,
                                               const EncodeOptions& options) const {
  if (!tok::is_valid_utf8(text)) return invalid_argument("text is not valid UTF-8");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<tok::Segment> segments;
  impl_->raw_added.split(text, !options.parse_special_tokens, &segments);
  for (const tok::Segment& s : segments) {
    if (s.token_id >= 0) {
      ids.push_back(s.token_id);
    } else if (s.end > s.begin) {
      FLEX_RETURN_IF_ERROR(impl_->encode_normalized(text.substr(s.begin, s.end - s.begin),
                                                    options.parse_special_tokens, &ids));
    }
  }
  if (options.add_special_tokens && impl_->post_template) {
    std::vector<int32_t> with_specials;
    with_specials.reserve(ids.size() + 4);
    for (const tok::TemplateItem& item : *impl_->post_template) {
      const auto& src = item.is_sequence ? ids : item.ids;
      with_specials.insert(with_specials.end(), src.begin(), src.end());
    }
    ids.swap(with_specials);
  }
  return ids;
}

Result<std::string> Tokenizer::decode(std::span<const int32_t> ids,
                                      bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) {
      return invalid_argument("token id " + std::to_string(id) + " is outside [0, " +
                              std::to_string(vocab_size()) + ")");
    }
    if (skip_special_tokens && impl_->special[id]) continue;
    bytes += impl_->id_to_bytes[id];
  }
  if (tok::is_valid_utf8(bytes)) return bytes;
  std::string text;
  tok::append_lossy(bytes, &text);
  return text;
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_to_token.size()); }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->token_to_id.find(std::string(token));
  if (it == impl_->token_to_id.end()) return std::nullopt;
  return it->second;
}

std::string_view Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return impl_->id_to_token[id];
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return impl_->id_to_bytes[id];
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && impl_->special[id];
}

const SpecialTokenIds& Tokenizer::special_token_ids() const { return impl_->special_ids; }
const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }
const std::string& Tokenizer::bos_token() const { return impl_->bos_token; }
const std::string& Tokenizer::eos_token() const { return impl_->eos_token; }

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {}

Result<std::string> IncrementalDecoder::push(int32_t id) {
  if (id < 0 || id >= tokenizer_->vocab_size()) {
    return invalid_argument("token id " + std::to_string(id) + " is outside [0, " +
                            std::to_string(tokenizer_->vocab_size()) + ")");
  }
  if (skip_special_tokens_ && tokenizer_->impl_->special[id]) return std::string();
  pending_ += tokenizer_->impl_->id_to_bytes[id];
  const size_t complete = tok::complete_prefix_length(pending_);
  std::string text;
  tok::append_lossy(std::string_view(pending_).substr(0, complete), &text);
  pending_.erase(0, complete);
  return text;
}

std::string IncrementalDecoder::flush() {
  std::string text;
  tok::append_lossy(pending_, &text);
  pending_.clear();
  return text;
}

}  // namespace flexpert
