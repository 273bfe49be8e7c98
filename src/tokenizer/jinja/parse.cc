// SPDX-License-Identifier: Apache-2.0
// Parsing a chat template: the source is cut into text and tags (with Jinja's whitespace
// control, trim_blocks and lstrip_blocks as transformers sets them), each tag's expression is
// tokenized, and a recursive-descent parser with Jinja's operator precedence builds the tree.
#include <cctype>
#include <initializer_list>

#include "tokenizer/jinja/ast.h"

namespace flexpert::jinja {
namespace {

struct Segment {
  enum class Type { kText, kExpr, kStmt } type;
  std::string content;
  int line;
};

int line_at(std::string_view src, size_t pos) {
  int line = 1;
  for (size_t i = 0; i < pos; ++i) line += src[i] == '\n';
  return line;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

Result<std::vector<Segment>> segment(std::string_view src) {
  std::vector<Segment> out;
  size_t pos = 0;
  bool strip_leading = false, trim_newline = false;
  while (pos <= src.size()) {
    size_t open = pos;
    while (true) {
      open = src.find('{', open);
      if (open == std::string_view::npos || open + 1 >= src.size()) {
        open = std::string_view::npos;
        break;
      }
      const char c = src[open + 1];
      if (c == '{' || c == '%' || c == '#') break;
      ++open;
    }
    std::string text(
        src.substr(pos, open == std::string_view::npos ? std::string_view::npos : open - pos));
    if (strip_leading) {
      size_t k = 0;
      while (k < text.size() && is_space(text[k])) ++k;
      text.erase(0, k);
    } else if (trim_newline) {
      if (text.starts_with("\n")) {
        text.erase(0, 1);
      } else if (text.starts_with("\r\n")) {
        text.erase(0, 2);
      }
    }
    if (open == std::string_view::npos) {
      if (!text.empty()) out.push_back({Segment::Type::kText, text, line_at(src, pos)});
      break;
    }
    const char kind = src[open + 1];
    const char modifier = open + 2 < src.size() ? src[open + 2] : '\0';
    if (modifier == '-') {
      while (!text.empty() && is_space(text.back())) text.pop_back();
    } else if (modifier != '+' && (kind == '%' || kind == '#')) {
      // lstrip_blocks: spaces and tabs from the start of the line up to a block tag.
      size_t k = open;
      while (k > 0 && (src[k - 1] == ' ' || src[k - 1] == '\t')) --k;
      if (k == 0 || src[k - 1] == '\n') {
        const size_t n = open - k;
        if (n <= text.size()) text.erase(text.size() - n);
      }
    }
    if (!text.empty()) out.push_back({Segment::Type::kText, text, line_at(src, pos)});

    const char close = kind == '{' ? '}' : kind;
    size_t i = open + 2;
    char quote = 0;
    size_t end = std::string_view::npos;
    for (; i + 1 < src.size(); ++i) {
      const char c = src[i];
      if (quote) {
        if (c == '\\') {
          ++i;
        } else if (c == quote) {
          quote = 0;
        }
      } else if (kind != '#' && (c == '\'' || c == '"')) {
        quote = c;
      } else if (c == close && src[i + 1] == '}') {
        end = i;
        break;
      }
    }
    const int line = line_at(src, open);
    if (end == std::string_view::npos) {
      return invalid_argument("line " + std::to_string(line) + ": unclosed tag");
    }
    size_t body_begin = open + 2 + ((modifier == '-' || modifier == '+') ? 1 : 0);
    size_t body_end = end;
    strip_leading = false;
    if (body_end > body_begin && src[body_end - 1] == '-') {
      --body_end;
      strip_leading = true;
    } else if (body_end > body_begin && src[body_end - 1] == '+') {
      --body_end;
    }
    trim_newline = kind != '{';
    if (kind != '#') {
      out.push_back({kind == '{' ? Segment::Type::kExpr : Segment::Type::kStmt,
                     std::string(src.substr(body_begin, body_end - body_begin)), line});
    }
    pos = end + 2;
  }
  return out;
}

struct Token {
  enum class Type { kName, kString, kInt, kFloat, kOp, kEnd } type;
  std::string text;
};

Result<std::vector<Token>> tokenize(std::string_view s, int line) {
  std::vector<Token> out;
  size_t i = 0;
  auto error = [&](const std::string& what) {
    return invalid_argument("line " + std::to_string(line) + ": " + what);
  };
  while (i < s.size()) {
    const char c = s[i];
    if (is_space(c)) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back({Token::Type::kName, std::string(s.substr(i, j - i))});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      bool is_float = false;
      if (j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]))) {
        is_float = true;
        ++j;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      }
      out.push_back(
          {is_float ? Token::Type::kFloat : Token::Type::kInt, std::string(s.substr(i, j - i))});
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string text;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] != '\\' || j + 1 >= s.size()) {
          text += s[j];
          continue;
        }
        const char e = s[++j];
        switch (e) {
          case 'n':
            text += '\n';
            break;
          case 't':
            text += '\t';
            break;
          case 'r':
            text += '\r';
            break;
          case '\\':
          case '\'':
          case '"':
            text += e;
            break;
          default:
            text += '\\';
            text += e;
        }
      }
      if (j >= s.size()) return error("unterminated string");
      out.push_back({Token::Type::kString, text});
      i = j + 1;
    } else {
      static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "(", ")", "[",
                                   "]",  "{",  "}",  ".",  ",",  ":",  "|", "+", "-",
                                   "*",  "/",  "%",  "~",  "<",  ">",  "="};
      bool found = false;
      for (const char* op : kOps) {
        if (s.substr(i).starts_with(op)) {
          out.push_back({Token::Type::kOp, op});
          i += std::string_view(op).size();
          found = true;
          break;
        }
      }
      if (!found) return error(std::string("unexpected character '") + c + "'");
    }
  }
  out.push_back({Token::Type::kEnd, ""});
  return out;
}

class ExprParser {
 public:
  ExprParser(std::vector<Token> tokens, int line) : t_(std::move(tokens)), line_(line) {}

  Status error(const std::string& what) const {
    return invalid_argument("line " + std::to_string(line_) + ": " + what);
  }
  const Token& peek() const { return t_[i_]; }
  bool at_end() const { return t_[i_].type == Token::Type::kEnd; }
  bool is_op(std::string_view op) const {
    return t_[i_].type == Token::Type::kOp && t_[i_].text == op;
  }
  bool is_name(std::string_view name) const {
    return t_[i_].type == Token::Type::kName && t_[i_].text == name;
  }
  bool accept_op(std::string_view op) {
    if (!is_op(op)) return false;
    ++i_;
    return true;
  }
  bool accept_name(std::string_view name) {
    if (!is_name(name)) return false;
    ++i_;
    return true;
  }
  Status expect_op(std::string_view op) {
    if (accept_op(op)) return Status();
    return error("expected '" + std::string(op) + "', found '" + peek().text + "'");
  }
  Result<std::string> name() {
    if (peek().type != Token::Type::kName)
      return error("expected a name, found '" + peek().text + "'");
    return t_[i_++].text;
  }

  using P = std::unique_ptr<Expr>;
  P make(Expr::Kind kind, std::string name = {}) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->name = std::move(name);
    e->line = line_;
    return e;
  }

  Result<P> expression() {
    FLEX_ASSIGN_OR_RETURN(P value, or_expr());
    if (!accept_name("if")) return value;
    P cond = make(Expr::Kind::kCond);
    cond->args.push_back(std::move(value));
    FLEX_ASSIGN_OR_RETURN(P test, or_expr());
    cond->args.push_back(std::move(test));
    if (accept_name("else")) {
      FLEX_ASSIGN_OR_RETURN(P other, expression());
      cond->args.push_back(std::move(other));
    } else {
      cond->args.push_back(nullptr);
    }
    return cond;
  }

 private:
  P binary(std::string op, P a, P b) {
    P e = make(Expr::Kind::kBinary, std::move(op));
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }
  Result<P> or_expr() {
    FLEX_ASSIGN_OR_RETURN(P left, and_expr());
    while (accept_name("or")) {
      FLEX_ASSIGN_OR_RETURN(P right, and_expr());
      left = binary("or", std::move(left), std::move(right));
    }
    return left;
  }
  Result<P> and_expr() {
    FLEX_ASSIGN_OR_RETURN(P left, not_expr());
    while (accept_name("and")) {
      FLEX_ASSIGN_OR_RETURN(P right, not_expr());
      left = binary("and", std::move(left), std::move(right));
    }
    return left;
  }
  Result<P> not_expr() {
    if (accept_name("not")) {
      FLEX_ASSIGN_OR_RETURN(P inner, not_expr());
      P e = make(Expr::Kind::kNot);
      e->args.push_back(std::move(inner));
      return e;
    }
    return compare();
  }
  Result<P> compare() {
    FLEX_ASSIGN_OR_RETURN(P left, math1());
    while (true) {
      std::string op;
      if (peek().type == Token::Type::kOp &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == ">" ||
           peek().text == "<=" || peek().text == ">=")) {
        op = t_[i_++].text;
      } else if (accept_name("in")) {
        op = "in";
      } else if (is_name("not") && t_[i_ + 1].type == Token::Type::kName &&
                 t_[i_ + 1].text == "in") {
        i_ += 2;
        op = "notin";
      } else {
        return left;
      }
      FLEX_ASSIGN_OR_RETURN(P right, math1());
      left = binary(op, std::move(left), std::move(right));
    }
  }
  Result<P> math1() {
    FLEX_ASSIGN_OR_RETURN(P left, concat());
    while (is_op("+") || is_op("-")) {
      const std::string op = t_[i_++].text;
      FLEX_ASSIGN_OR_RETURN(P right, concat());
      left = binary(op, std::move(left), std::move(right));
    }
    return left;
  }
  Result<P> concat() {
    FLEX_ASSIGN_OR_RETURN(P left, math2());
    while (accept_op("~")) {
      FLEX_ASSIGN_OR_RETURN(P right, math2());
      left = binary("~", std::move(left), std::move(right));
    }
    return left;
  }
  Result<P> math2() {
    FLEX_ASSIGN_OR_RETURN(P left, unary());
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = t_[i_++].text;
      FLEX_ASSIGN_OR_RETURN(P right, unary());
      left = binary(op, std::move(left), std::move(right));
    }
    return left;
  }
  Result<P> unary() {
    P e;
    if (accept_op("-")) {
      FLEX_ASSIGN_OR_RETURN(P inner, unary_no_filter());
      e = make(Expr::Kind::kNeg);
      e->args.push_back(std::move(inner));
    } else {
      FLEX_ASSIGN_OR_RETURN(e, primary());
      FLEX_ASSIGN_OR_RETURN(e, postfix(std::move(e)));
    }
    return filters_and_tests(std::move(e));
  }
  Result<P> unary_no_filter() {
    if (accept_op("-")) {
      FLEX_ASSIGN_OR_RETURN(P inner, unary_no_filter());
      P e = make(Expr::Kind::kNeg);
      e->args.push_back(std::move(inner));
      return e;
    }
    FLEX_ASSIGN_OR_RETURN(P e, primary());
    return postfix(std::move(e));
  }
  Status call_args(Expr* e) {
    if (accept_op(")")) return Status();
    while (true) {
      if (peek().type == Token::Type::kName && t_[i_ + 1].type == Token::Type::kOp &&
          t_[i_ + 1].text == "=") {
        std::string key = t_[i_].text;
        i_ += 2;
        FLEX_ASSIGN_OR_RETURN(P value, expression());
        e->kwargs.emplace_back(std::move(key), std::move(value));
      } else {
        FLEX_ASSIGN_OR_RETURN(P value, expression());
        e->args.push_back(std::move(value));
      }
      if (accept_op(")")) return Status();
      FLEX_RETURN_IF_ERROR(expect_op(","));
    }
  }
  Result<P> postfix(P e) {
    while (true) {
      if (accept_op(".")) {
        FLEX_ASSIGN_OR_RETURN(std::string attr, name());
        P a = make(Expr::Kind::kAttr, attr);
        a->args.push_back(std::move(e));
        e = std::move(a);
      } else if (accept_op("[")) {
        P parts[3];
        int n = 0;
        bool slice = false;
        while (true) {
          if (!is_op(":") && !is_op("]")) {
            FLEX_ASSIGN_OR_RETURN(parts[n], expression());
          }
          if (accept_op(":")) {
            slice = true;
            if (++n > 2) return error("a slice has at most three parts");
            continue;
          }
          FLEX_RETURN_IF_ERROR(expect_op("]"));
          break;
        }
        P item = make(slice ? Expr::Kind::kSlice : Expr::Kind::kItem);
        item->args.push_back(std::move(e));
        if (slice) {
          for (auto& part : parts) item->args.push_back(std::move(part));
        } else {
          if (!parts[0]) return error("empty subscript");
          item->args.push_back(std::move(parts[0]));
        }
        e = std::move(item);
      } else if (accept_op("(")) {
        if (e->kind == Expr::Kind::kName && !is_known_function(e->name)) {
          return error("function '" + e->name + "' is not supported");
        }
        if (e->kind == Expr::Kind::kAttr && !is_known_method(e->name)) {
          return error("method '" + e->name + "' is not supported");
        }
        P call = make(Expr::Kind::kCall);
        call->args.push_back(std::move(e));
        FLEX_RETURN_IF_ERROR(call_args(call.get()));
        e = std::move(call);
      } else {
        return e;
      }
    }
  }
  Result<P> filters_and_tests(P e) {
    while (true) {
      if (accept_op("|")) {
        FLEX_ASSIGN_OR_RETURN(std::string filter, name());
        if (!is_known_filter(filter)) return error("filter '" + filter + "' is not supported");
        P f = make(Expr::Kind::kFilter, filter);
        f->args.push_back(std::move(e));
        if (accept_op("(")) FLEX_RETURN_IF_ERROR(call_args(f.get()));
        e = std::move(f);
      } else if (accept_name("is")) {
        const bool negated = accept_name("not");
        FLEX_ASSIGN_OR_RETURN(std::string test, name());
        if (!is_known_test(test)) return error("test '" + test + "' is not supported");
        P t = make(Expr::Kind::kTest, test);
        t->negated = negated;
        t->args.push_back(std::move(e));
        if (accept_op("(")) FLEX_RETURN_IF_ERROR(call_args(t.get()));
        e = std::move(t);
      } else {
        return e;
      }
    }
  }
  Result<P> primary() {
    const Token tok = peek();
    switch (tok.type) {
      case Token::Type::kString: {
        ++i_;
        std::string text = tok.text;
        while (peek().type == Token::Type::kString) text += t_[i_++].text;  // "a" "b"
        P e = make(Expr::Kind::kLiteral);
        e->literal = Value::string(text);
        return e;
      }
      case Token::Type::kInt:
      case Token::Type::kFloat: {
        ++i_;
        P e = make(Expr::Kind::kLiteral);
        e->literal = tok.type == Token::Type::kInt ? Value::integer(std::stoll(tok.text))
                                                   : Value::number(std::stod(tok.text));
        return e;
      }
      case Token::Type::kName: {
        ++i_;
        P e = make(Expr::Kind::kLiteral);
        if (tok.text == "true" || tok.text == "True") {
          e->literal = Value::boolean(true);
        } else if (tok.text == "false" || tok.text == "False") {
          e->literal = Value::boolean(false);
        } else if (tok.text == "none" || tok.text == "None") {
          e->literal = Value::none();
        } else {
          e = make(Expr::Kind::kName, tok.text);
        }
        return e;
      }
      case Token::Type::kOp:
        if (accept_op("(")) {
          FLEX_ASSIGN_OR_RETURN(P inner, expression());
          if (is_op(",")) return error("tuples are not supported");
          FLEX_RETURN_IF_ERROR(expect_op(")"));
          return inner;
        }
        if (accept_op("[")) {
          P list = make(Expr::Kind::kList);
          while (!accept_op("]")) {
            FLEX_ASSIGN_OR_RETURN(P item, expression());
            list->args.push_back(std::move(item));
            if (!is_op("]")) FLEX_RETURN_IF_ERROR(expect_op(","));
          }
          return list;
        }
        if (accept_op("{")) {
          P dict = make(Expr::Kind::kDict);
          while (!accept_op("}")) {
            FLEX_ASSIGN_OR_RETURN(P key, expression());
            FLEX_RETURN_IF_ERROR(expect_op(":"));
            FLEX_ASSIGN_OR_RETURN(P value, expression());
            dict->args.push_back(std::move(key));
            dict->args.push_back(std::move(value));
            if (!is_op("}")) FLEX_RETURN_IF_ERROR(expect_op(","));
          }
          return dict;
        }
        return error("unexpected '" + tok.text + "'");
      case Token::Type::kEnd:
        return error("expression ends too early");
    }
    return error("unexpected token");
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int line_;
};

class TemplateParser {
 public:
  explicit TemplateParser(std::vector<Segment> segments) : s_(std::move(segments)) {}

  // Parses nodes until a statement whose keyword is in `stops` (returned in *stop, with its
  // parser positioned after the keyword), or the end (an error when stops is not empty).
  Status body(std::vector<Node>* out, std::initializer_list<std::string_view> stops,
              std::string* stop, std::unique_ptr<ExprParser>* stop_parser) {
    while (i_ < s_.size()) {
      const Segment& seg = s_[i_++];
      if (seg.type == Segment::Type::kText) {
        Node n;
        n.kind = Node::Kind::kText;
        n.text = seg.content;
        n.line = seg.line;
        out->push_back(std::move(n));
        continue;
      }
      FLEX_ASSIGN_OR_RETURN(std::vector<Token> tokens, tokenize(seg.content, seg.line));
      auto p = std::make_unique<ExprParser>(std::move(tokens), seg.line);
      if (seg.type == Segment::Type::kExpr) {
        Node n;
        n.kind = Node::Kind::kOutput;
        n.line = seg.line;
        FLEX_ASSIGN_OR_RETURN(n.expr, p->expression());
        if (!p->at_end()) return p->error("unexpected '" + p->peek().text + "' in {{ }}");
        out->push_back(std::move(n));
        continue;
      }
      FLEX_ASSIGN_OR_RETURN(std::string keyword, p->name());
      for (std::string_view s : stops) {
        if (keyword == s) {
          *stop = keyword;
          *stop_parser = std::move(p);
          return Status();
        }
      }
      Node n;
      n.line = seg.line;
      if (keyword == "if") {
        FLEX_RETURN_IF_ERROR(parse_if(std::move(p), &n));
      } else if (keyword == "for") {
        FLEX_RETURN_IF_ERROR(parse_for(std::move(p), &n));
      } else if (keyword == "set") {
        FLEX_RETURN_IF_ERROR(parse_set(std::move(p), &n));
      } else {
        return invalid_argument("line " + std::to_string(seg.line) + ": statement '" + keyword +
                                "' is not supported");
      }
      out->push_back(std::move(n));
    }
    if (stops.size() > 0) {
      return invalid_argument("template ends inside a block: missing {% " +
                              std::string(*stops.begin()) + " %}");
    }
    return Status();
  }

 private:
  static Status finish(ExprParser& p) {
    if (!p.at_end()) return p.error("unexpected '" + p.peek().text + "'");
    return Status();
  }
  Status parse_if(std::unique_ptr<ExprParser> p, Node* n) {
    n->kind = Node::Kind::kIf;
    while (true) {
      std::unique_ptr<Expr> cond;
      if (p) {
        FLEX_ASSIGN_OR_RETURN(cond, p->expression());
        FLEX_RETURN_IF_ERROR(finish(*p));
      }
      std::vector<Node> branch;
      std::string stop;
      std::unique_ptr<ExprParser> next;
      const bool is_else = cond == nullptr;
      if (is_else) {
        FLEX_RETURN_IF_ERROR(body(&branch, {"endif"}, &stop, &next));
      } else {
        FLEX_RETURN_IF_ERROR(body(&branch, {"endif", "elif", "else"}, &stop, &next));
      }
      n->branches.emplace_back(std::move(cond), std::move(branch));
      if (stop == "endif") return finish(*next);
      if (stop == "else") {
        FLEX_RETURN_IF_ERROR(finish(*next));
        p.reset();
      } else {
        p = std::move(next);
      }
    }
  }
  Status parse_for(std::unique_ptr<ExprParser> p, Node* n) {
    n->kind = Node::Kind::kFor;
    do {
      FLEX_ASSIGN_OR_RETURN(std::string target, p->name());
      n->targets.push_back(std::move(target));
    } while (p->accept_op(","));
    if (!p->accept_name("in")) return p->error("expected 'in' in for");
    // The iterable stops before a trailing `if`, which filters items.
    FLEX_ASSIGN_OR_RETURN(n->expr, p->expression());
    if (n->expr->kind == Expr::Kind::kCond && n->expr->args[2] == nullptr) {
      n->filter = std::move(n->expr->args[1]);
      n->expr = std::move(n->expr->args[0]);
    }
    FLEX_RETURN_IF_ERROR(finish(*p));
    std::string stop;
    std::unique_ptr<ExprParser> next;
    FLEX_RETURN_IF_ERROR(body(&n->body, {"endfor", "else"}, &stop, &next));
    FLEX_RETURN_IF_ERROR(finish(*next));
    if (stop == "else") {
      FLEX_RETURN_IF_ERROR(body(&n->else_body, {"endfor"}, &stop, &next));
      FLEX_RETURN_IF_ERROR(finish(*next));
    }
    return Status();
  }
  Status parse_set(std::unique_ptr<ExprParser> p, Node* n) {
    n->kind = Node::Kind::kSet;
    FLEX_ASSIGN_OR_RETURN(n->set_name, p->name());
    if (p->accept_op(".")) {
      FLEX_ASSIGN_OR_RETURN(n->set_attr, p->name());
    }
    if (!p->accept_op("=")) return p->error("block {% set %} is not supported; use set x = ...");
    FLEX_ASSIGN_OR_RETURN(n->expr, p->expression());
    return finish(*p);
  }

  std::vector<Segment> s_;
  size_t i_ = 0;
};

}  // namespace

Result<std::unique_ptr<Template>> parse_template(std::string_view source) {
  // Jinja drops one newline at the very end of a template (keep_trailing_newline=False).
  if (source.ends_with("\r\n")) {
    source.remove_suffix(2);
  } else if (source.ends_with("\n")) {
    source.remove_suffix(1);
  }
  FLEX_ASSIGN_OR_RETURN(std::vector<Segment> segments, segment(source));
  auto t = std::make_unique<Template>();
  TemplateParser parser(std::move(segments));
  std::string stop;
  std::unique_ptr<ExprParser> unused;
  FLEX_RETURN_IF_ERROR(parser.body(&t->body, {}, &stop, &unused));
  return t;
}

}  // namespace flexpert::jinja
