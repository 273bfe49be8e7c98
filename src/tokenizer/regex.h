// SPDX-License-Identifier: Apache-2.0
// A compiled PCRE2 pattern (UTF + UCP, JIT-compiled where the platform supports it) that lists
// the non-overlapping matches in a subject, leftmost first like Oniguruma, which the Rust
// `tokenizers` library uses. Immutable after compile; find_all is thread-safe (match data and
// the JIT stack are per thread).
#pragma once

#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "flexpert/status.h"

namespace flexpert::tok {

class Regex {
 public:
  // `literal`: the pattern is a plain string (a Split's {"String": ...}).
  static Result<std::unique_ptr<Regex>> compile(std::string_view pattern, bool literal = false);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [begin, end) byte ranges of the matches in `subject` (valid UTF-8; the pattern
  // sees nothing beyond its ends, so lookaheads stop there). Empty matches are skipped.
  Status find_all(std::string_view subject, std::vector<std::pair<size_t, size_t>>* out) const;
  bool jit() const { return jit_; }

 private:
  Regex() = default;
  struct Code;
  Code* code_ = nullptr;
  bool jit_ = false;
};

}  // namespace flexpert::tok
