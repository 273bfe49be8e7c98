// SPDX-License-Identifier: Apache-2.0
#include "core/json_limits.h"

#include <string>

namespace flexpert {

Status check_json_nesting(std::string_view text, std::string_view what, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // The escaped character cannot end the string.
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return invalid_argument(std::string(what) + " nests arrays/objects deeper than " +
                                std::to_string(max_depth) + " levels (at byte " +
                                std::to_string(i) + ")");
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return Status();
}

}  // namespace flexpert
