// SPDX-License-Identifier: Apache-2.0
// Tokenizer: text <-> token ids for byte-level BPE models (Qwen2/Qwen3, DeepSeek-V3/V2),
// loaded from a Hugging Face `tokenizer.json` (+ `tokenizer_config.json` when present).
//
// encode: added/special tokens split out first (their flags honoured), then the normalizer,
// the pre-tokenizer's Split regexes as the file gives them (PCRE2, UTF + UCP), ByteLevel,
// BPE merges by rank, then the post-processor. decode: the ByteLevel decoder, invalid UTF-8
// replaced by U+FFFD. Both follow the Rust `tokenizers` library (docs/ARCHITECTURE.md,
// "Text: tokenizer and chat templates"). A Tokenizer is immutable after load; every const
// method is thread-safe (the per-word BPE cache is internally locked). An IncrementalDecoder
// belongs to one stream and is not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "flexpert/status.h"

namespace flexpert {

struct EncodeOptions {
  // Apply the post-processor (BOS/EOS where tokenizer.json's TemplateProcessing says so).
  bool add_special_tokens = true;
  // Match special tokens written in the text. false: their text is tokenized as plain text
  // (what a server does with user content; Rust's `encode_special_tokens`).
  bool parse_special_tokens = true;
};

// The special tokens tokenizer_config.json names (absent when it names none).
struct SpecialTokenIds {
  std::optional<int32_t> bos;
  std::optional<int32_t> eos;
  std::optional<int32_t> pad;
  std::optional<int32_t> unk;
};

class Tokenizer {
 public:
  // DIR/tokenizer.json (required) and DIR/tokenizer_config.json (optional: special tokens,
  // chat template). NotFound without tokenizer.json; InvalidArgument for a malformed file;
  // Unimplemented for a component this build does not support (named in the message).
  static Result<std::unique_ptr<Tokenizer>> load(const std::string& dir);
  // The same from file contents; `config_json` may be empty.
  static Result<std::unique_ptr<Tokenizer>> from_json(std::string_view tokenizer_json,
                                                      std::string_view config_json = {});
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // InvalidArgument when `text` is not valid UTF-8.
  Result<std::vector<int32_t>> encode(std::string_view text,
                                      const EncodeOptions& options = {}) const;
  // InvalidArgument for an id outside [0, vocab_size()) (Rust silently drops those).
  Result<std::string> decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // One more than the largest id (model vocabulary and added tokens).
  int32_t vocab_size() const;
  // The id of a token as the vocabulary spells it (added token content or a BPE token in its
  // byte-level form, e.g. "Ġthe").
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The vocabulary's spelling of an id; empty for an id with no token.
  std::string_view id_to_token(int32_t id) const;
  // The bytes an id decodes to on its own (may be part of a UTF-8 character).
  std::string_view token_bytes(int32_t id) const;
  // An added token flagged `special` (skipped by decode(..., skip_special_tokens=true)).
  bool is_special(int32_t id) const;
  const SpecialTokenIds& special_token_ids() const;
  // tokenizer_config.json's `chat_template` (the "default" one when it is a list); empty if none.
  const std::string& chat_template() const;
  // Strings tokenizer_config.json gives for bos_token / eos_token (for chat templates).
  const std::string& bos_token() const;
  const std::string& eos_token() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend class IncrementalDecoder;
};

// Streaming detokenization: push ids as they are generated, get the text that is complete so
// far. Never emits part of a UTF-8 character: bytes of an unfinished character are held until
// the ids that complete it arrive (or flush()). The concatenation of every push() and flush()
// equals decode(all ids). The Tokenizer must outlive it.
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  // The text that became complete with `id` (often empty for a partial character).
  Result<std::string> push(int32_t id);
  // Whatever is held back, invalid bytes as U+FFFD; the decoder starts afresh.
  std::string flush();
  // Bytes held back for an unfinished character (0..3).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
};

}  // namespace flexpert
