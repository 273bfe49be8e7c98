// SPDX-License-Identifier: Apache-2.0
// Bounds for JSON read at a trust boundary (HTTP bodies, safetensors headers,
// config.json, plan and placement files), checked before a parser sees the text.
//
// nlohmann's parser and destructor are iterative, but dump() and the code that walks
// a document recurse: a body nesting 60,000 arrays deep overflows the stack there.
// check_json_nesting() is a single iterative pass, so the limit holds whatever the
// input. Pure functions, thread-safe.
#pragma once

#include <string_view>

#include "flexpert/status.h"

namespace flexpert {

// Every document flexpert reads nests a few levels; 64 leaves room for metadata.
constexpr int kMaxJsonDepth = 64;

// InvalidArgument naming `what` when arrays/objects in `text` nest deeper than
// `max_depth` (brackets inside strings do not count). Says nothing about validity:
// the parser still decides that.
Status check_json_nesting(std::string_view text, std::string_view what,
                          int max_depth = kMaxJsonDepth);

}  // namespace flexpert
