// SPDX-License-Identifier: Apache-2.0
// Comparing secrets (the admin key, the cluster key) without an early exit, so that
// the time a comparison takes does not reveal how much of a guess was right.
#pragma once

#include <algorithm>
#include <string_view>

namespace flexpert {

inline bool same_secret(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    diff |= static_cast<unsigned char>((i < a.size() ? a[i] : 0) ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

}  // namespace flexpert
