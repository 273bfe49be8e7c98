// SPDX-License-Identifier: Apache-2.0
// TextStream: the text of one generated choice as its tokens arrive, for the OpenAI-style
// routes (docs/ARCHITECTURE.md, "Text in, text out").
//
// Tokens go through an IncrementalDecoder (never half a UTF-8 character), special tokens
// skipped as vLLM's default `skip_special_tokens` does. Stop strings are matched on the
// decoded text, so a stop string may end inside a token or span several: the text from the
// match on is dropped (or kept up to the end of the stop string with
// include_stop_str_in_output), and the choice is finished. Text that could still be the
// start of a stop string is held back until it cannot, so that a stream never sends what
// a later match would have cut. One TextStream per choice, on one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flexpert/status.h"
#include "flexpert/tokenizer.h"

namespace flexpert {

struct StopStrings {
  std::vector<std::string> stop;  // Non-empty strings, matched on the decoded text.
  bool include_stop_str_in_output = false;
};

class TextStream {
 public:
  // The tokenizer must outlive the stream.
  TextStream(const Tokenizer& tokenizer, StopStrings stops);

  // Feeds one generated token; returns the text that is now final (often empty). After a
  // stop string matched, stopped() is true and further pushes return "". An id the
  // tokenizer does not have (a model's vocabulary is often padded past it) is no text, as
  // the Rust `tokenizers` library decodes it.
  Result<std::string> push(int32_t id);
  // The model finished: the text still held back (the decoder's unfinished character as
  // U+FFFD, text that could have begun a stop string), stop strings checked once more.
  std::string finish();
  bool stopped() const { return stopped_; }

  // The longest suffix of `text` that is a proper prefix of one of `stops` (what must be
  // held back), in bytes. Public for tests.
  static size_t held_suffix(const std::string& text, const std::vector<std::string>& stops);

 private:
  // Appends `piece` to the held text and returns what became final.
  std::string advance(const std::string& piece, bool final);

  const Tokenizer* tokenizer_;
  IncrementalDecoder decoder_;
  StopStrings stops_;
  std::string held_;  // Decoded, not yet returned: could be the start of a stop string.
  bool stopped_ = false;
};

}  // namespace flexpert
