// SPDX-License-Identifier: Apache-2.0
// The syntax tree of a parsed template (parse.cc builds it, eval.cc runs it), and the names
// of the filters, tests, functions and methods the interpreter implements: the parser refuses
// any other, so unsupported templates fail at load.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "flexpert/status.h"
#include "tokenizer/jinja/value.h"

namespace flexpert::jinja {

struct Expr {
  enum class Kind {
    kLiteral,  // literal
    kName,     // name
    kAttr,     // args[0].name
    kItem,     // args[0][args[1]]
    kSlice,    // args[0][args[1]:args[2]:args[3]] (null parts absent)
    kCall,     // args[0](args[1..], kwargs)
    kFilter,   // args[0] | name(args[1..], kwargs)
    kTest,     // args[0] is [not] name(args[1..])
    kNot,      // not args[0]
    kNeg,      // -args[0]
    kBinary,   // args[0] name args[1]: or and == != < > <= >= in notin + - * / // % ~
    kCond,     // args[0] if args[1] else args[2]
    kList,     // [args...]
    kDict,     // {args[0]: args[1], ...}
  };
  Kind kind = Kind::kLiteral;
  Value literal;
  std::string name;
  std::vector<std::unique_ptr<Expr>> args;
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
  bool negated = false;
  int line = 0;
};

struct Node {
  enum class Kind { kText, kOutput, kIf, kFor, kSet };
  Kind kind = Kind::kText;
  int line = 0;
  std::string text;            // kText.
  std::unique_ptr<Expr> expr;  // kOutput; kSet's value; kFor's iterable.
  // kIf: (condition, body) per if/elif; a null condition is the else branch.
  std::vector<std::pair<std::unique_ptr<Expr>, std::vector<Node>>> branches;
  std::vector<std::string> targets;   // kFor: loop variables (several unpack a pair).
  std::unique_ptr<Expr> filter;       // kFor: `for x in xs if cond`.
  std::vector<Node> body, else_body;  // kFor.
  std::string set_name, set_attr;     // kSet: `set name = ..` or `set name.attr = ..`.
};

struct Template {
  std::vector<Node> body;
};

Result<std::unique_ptr<Template>> parse_template(std::string_view source);

// What the interpreter implements (eval.cc), checked at parse time.
bool is_known_filter(std::string_view name);
bool is_known_test(std::string_view name);
bool is_known_function(std::string_view name);
bool is_known_method(std::string_view name);

}  // namespace flexpert::jinja
