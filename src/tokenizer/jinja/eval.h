// SPDX-License-Identifier: Apache-2.0
// Rendering a parsed template (ast.h) with the given top-level variables (a dict).
#pragma once

#include <string>

#include "flexpert/status.h"
#include "tokenizer/jinja/ast.h"

namespace flexpert::jinja {

// InvalidArgument (with the template line) for what the template does with values it cannot
// handle, or for raise_exception.
Result<std::string> render(const Template& t, const Value& globals);

}  // namespace flexpert::jinja
