// SPDX-License-Identifier: Apache-2.0
// UTF-8 and Unicode helpers of the tokenizer module: validation, lossy decoding (maximal
// subparts become U+FFFD, as Rust's from_utf8_lossy and WHATWG decoders do), normalization
// through libutf8proc, character classes for added-token flags, and GPT-2's byte <-> char map
// used by ByteLevel. Pure functions; thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "flexpert/status.h"

namespace flexpert::tok {

enum class Utf8Step { kValid, kInvalid, kIncomplete };

// Looks at the sequence starting at s[0] (n > 0 bytes available). kValid: *len bytes form one
// character. kInvalid: the first *len bytes are a maximal invalid subpart (one U+FFFD).
// kIncomplete: all n bytes are a valid but unfinished prefix of a character.
Utf8Step utf8_step(const unsigned char* s, size_t n, size_t* len);

bool is_valid_utf8(std::string_view s);
// Appends `bytes` to `out`, every maximal invalid subpart (and an unfinished tail) as U+FFFD.
void append_lossy(std::string_view bytes, std::string* out);
// The length of the longest prefix of `bytes` that ends outside an unfinished character:
// what a streaming decoder may emit now.
size_t complete_prefix_length(std::string_view bytes);

// Decodes one code point of valid UTF-8 at s[*pos] and advances *pos.
char32_t next_code_point(std::string_view s, size_t* pos);
void append_utf8(char32_t cp, std::string* out);

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
// Normalizes valid UTF-8 with libutf8proc.
Result<std::string> normalize(std::string_view s, NormalForm form);
bool is_ascii(std::string_view s);

// Unicode White_Space (Rust regex `\s`).
bool is_unicode_whitespace(char32_t cp);
// Rust regex `\w`: letters, marks, decimal and letter numbers, connector punctuation, ZWJ/ZWNJ.
bool is_unicode_word(char32_t cp);

// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100.. in order (the ByteLevel pre-tokenizer and decoder of tokenizer.json).
const std::array<char32_t, 256>& byte_to_char();
// The byte a ByteLevel char stands for, or -1.
int char_to_byte(char32_t cp);

}  // namespace flexpert::tok
