// SPDX-License-Identifier: Apache-2.0
#include "tokenizer/utf8.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

namespace flexpert::tok {

Utf8Step utf8_step(const unsigned char* s, size_t n, size_t* len) {
  const unsigned char b = s[0];
  if (b < 0x80) {
    *len = 1;
    return Utf8Step::kValid;
  }
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;  // The range of the second byte.
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    *len = 1;
    return Utf8Step::kInvalid;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (k >= n) {
      *len = n;
      return Utf8Step::kIncomplete;
    }
    const unsigned char c = s[k];
    const bool ok = k == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
    if (!ok) {
      *len = k;
      return Utf8Step::kInvalid;
    }
  }
  *len = need + 1;
  return Utf8Step::kValid;
}

bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    if (utf8_step(p + i, s.size() - i, &len) != Utf8Step::kValid) return false;
    i += len;
  }
  return true;
}

void append_lossy(std::string_view bytes, std::string* out) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t i = 0;
  while (i < bytes.size()) {
    size_t len;
    const Utf8Step step = utf8_step(p + i, bytes.size() - i, &len);
    if (step == Utf8Step::kValid) {
      out->append(bytes.data() + i, len);
    } else {
      out->append("\xEF\xBF\xBD");
    }
    i += len;
  }
}

size_t complete_prefix_length(std::string_view bytes) {
  // An unfinished character is at most 3 bytes: look at the last few lead positions only.
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const size_t start = n - back;
    if ((p[start] & 0xC0) == 0x80) continue;  // A continuation byte: look further back.
    size_t len;
    if (utf8_step(p + start, back, &len) == Utf8Step::kIncomplete) return start;
    return n;
  }
  return n;
}

char32_t next_code_point(std::string_view s, size_t* pos) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + *pos;
  char32_t cp;
  size_t len;
  if (p[0] < 0x80) {
    cp = p[0];
    len = 1;
  } else if (p[0] < 0xE0) {
    cp = ((p[0] & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    len = 2;
  } else if (p[0] < 0xF0) {
    cp = ((p[0] & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    len = 3;
  } else {
    cp = ((p[0] & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
    len = 4;
  }
  *pos += len;
  return cp;
}

void append_utf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_ascii(std::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

Result<std::string> normalize(std::string_view s, NormalForm form) {
  if (s.empty()) return std::string();
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &out,
                                          static_cast<utf8proc_option_t>(options));
  if (n < 0) {
    return invalid_argument(std::string("utf8proc_map: ") + utf8proc_errmsg(n));
  }
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(out, &std::free);
  return std::string(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
}

bool is_unicode_whitespace(char32_t cp) {
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85) return true;
  if (cp < 0xA0) return false;
  const utf8proc_category_t cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL || cat == UTF8PROC_CATEGORY_ZP;
}

bool is_unicode_word(char32_t cp) {
  if (cp == 0x200C || cp == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

namespace {

struct ByteMaps {
  std::array<char32_t, 256> to_char{};
  ByteMaps() {
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      to_char[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next++);
    }
  }
};

const ByteMaps& byte_maps() {
  static const ByteMaps maps;
  return maps;
}

}  // namespace

const std::array<char32_t, 256>& byte_to_char() { return byte_maps().to_char; }

int char_to_byte(char32_t cp) {
  // Printable bytes map to themselves; the others to 256 + their rank among the non-printable.
  if ((cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE && cp <= 0xFF)) {
    return static_cast<int>(cp);
  }
  if (cp < 256 || cp >= 256 + 68) return -1;
  static const std::array<int, 68> kInverse = [] {
    std::array<int, 68> inv{};
    const auto& to_char = byte_to_char();
    for (int b = 0; b < 256; ++b) {
      if (to_char[b] >= 256) inv[to_char[b] - 256] = b;
    }
    return inv;
  }();
  return kInverse[cp - 256];
}

}  // namespace flexpert::tok
