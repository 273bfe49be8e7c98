// SPDX-License-Identifier: Apache-2.0
// Running a parsed template: Python's semantics for the values chat templates use (truthiness,
// `and`/`or` returning an operand, negative indices and slices, str methods), Jinja's scoping
// (a for loop body is its own scope; `set` on a namespace reaches out of it).
#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "tokenizer/jinja/ast.h"
#include "tokenizer/jinja/eval.h"
#include "tokenizer/utf8.h"

namespace flexpert::jinja {
namespace {

constexpr std::string_view kFilters[] = {
    "length",  "count", "tojson", "trim",    "string", "upper", "lower",
    "first",   "last",  "join",   "default", "d",      "list",  "capitalize",
    "replace", "int",   "float",  "abs",     "safe",   "items", "reverse"};
constexpr std::string_view kTests[] = {
    "defined",  "undefined", "none", "string", "number", "integer", "float", "boolean", "mapping",
    "iterable", "sequence",  "true", "false",  "odd",    "even",    "eq",    "equalto"};
constexpr std::string_view kFunctions[] = {"namespace", "raise_exception", "range"};
constexpr std::string_view kMethods[] = {"startswith", "endswith", "strip", "lstrip",  "rstrip",
                                         "split",      "upper",    "lower", "replace", "title",
                                         "capitalize", "get",      "items", "keys",    "values"};

template <size_t N>
bool known(const std::string_view (&names)[N], std::string_view name) {
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t start = pos;
    tok::next_code_point(s, &pos);
    out.push_back(s.substr(start, pos - start));
  }
  return out;
}

bool is_py_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

std::string strip_chars(const std::string& s, const Value* chars, bool left, bool right) {
  auto strip_this = [&](char c) {
    return chars ? chars->s.find(c) != std::string::npos : is_py_space(c);
  };
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e && strip_this(s[b])) ++b;
  }
  if (right) {
    while (e > b && strip_this(s[e - 1])) --e;
  }
  return s.substr(b, e - b);
}

class Renderer {
 public:
  explicit Renderer(Value globals) { scopes_.push_back(std::move(globals)); }

  Status render(const std::vector<Node>& nodes, std::string* out) {
    for (const Node& n : nodes) FLEX_RETURN_IF_ERROR(render_node(n, out));
    return Status();
  }

 private:
  static Status error(int line, const std::string& what) {
    return invalid_argument("chat template line " + std::to_string(line) + ": " + what);
  }

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      for (const auto& [key, value] : *it->dict) {
        if (key == name) return value;
      }
    }
    return Value();
  }

  Status render_node(const Node& n, std::string* out) {
    switch (n.kind) {
      case Node::Kind::kText:
        *out += n.text;
        return Status();
      case Node::Kind::kOutput: {
        FLEX_ASSIGN_OR_RETURN(Value v, eval(*n.expr));
        *out += to_output(v);
        return Status();
      }
      case Node::Kind::kIf:
        for (const auto& [cond, body] : n.branches) {
          bool take = true;
          if (cond) {
            FLEX_ASSIGN_OR_RETURN(Value c, eval(*cond));
            take = c.truthy();
          }
          if (take) return render(body, out);
        }
        return Status();
      case Node::Kind::kSet: {
        FLEX_ASSIGN_OR_RETURN(Value v, eval(*n.expr));
        if (n.set_attr.empty()) {
          scopes_.back().set(n.set_name, std::move(v));
          return Status();
        }
        Value ns = lookup(n.set_name);
        if (ns.kind != Value::Kind::kNamespace) {
          return error(n.line,
                       "'" + n.set_name + "' is not a namespace: cannot set ." + n.set_attr);
        }
        ns.set(n.set_attr, std::move(v));
        return Status();
      }
      case Node::Kind::kFor:
        return render_for(n, out);
    }
    return Status();
  }

  Status render_for(const Node& n, std::string* out) {
    FLEX_ASSIGN_OR_RETURN(Value iterable, eval(*n.expr));
    List items;
    switch (iterable.kind) {
      case Value::Kind::kUndefined:
        break;
      case Value::Kind::kList:
        items = *iterable.list;
        break;
      case Value::Kind::kDict:
        for (const auto& [key, value] : *iterable.dict) items.push_back(Value::string(key));
        break;
      case Value::Kind::kString:
        for (std::string& c : code_points(iterable.s)) items.push_back(Value::string(std::move(c)));
        break;
      default:
        return error(n.line, std::string("cannot loop over ") + kind_name(iterable.kind));
    }
    auto bind = [&](Value& scope, const Value& item) -> Status {
      if (n.targets.size() == 1) {
        scope.set(n.targets[0], item);
        return Status();
      }
      if (item.kind != Value::Kind::kList || item.list->size() != n.targets.size()) {
        return error(n.line, "cannot unpack a loop item into " + std::to_string(n.targets.size()) +
                                 " names");
      }
      for (size_t k = 0; k < n.targets.size(); ++k) scope.set(n.targets[k], (*item.list)[k]);
      return Status();
    };
    if (n.filter) {
      List kept;
      for (const Value& item : items) {
        scopes_.push_back(Value::new_dict());
        Status s = bind(scopes_.back(), item);
        Result<Value> keep = s.ok() ? eval(*n.filter) : Result<Value>(s);
        scopes_.pop_back();
        if (!keep.ok()) return keep.status();
        if (keep->truthy()) kept.push_back(item);
      }
      items.swap(kept);
    }
    if (items.empty()) return render_scoped(n.else_body, out);
    const auto length = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < length; ++k) {
      Value scope = Value::new_dict();
      FLEX_RETURN_IF_ERROR(bind(scope, items[k]));
      Value loop = Value::new_dict();
      loop.set("index0", Value::integer(k));
      loop.set("index", Value::integer(k + 1));
      loop.set("revindex0", Value::integer(length - k - 1));
      loop.set("revindex", Value::integer(length - k));
      loop.set("first", Value::boolean(k == 0));
      loop.set("last", Value::boolean(k == length - 1));
      loop.set("length", Value::integer(length));
      scope.set("loop", loop);
      scopes_.push_back(std::move(scope));
      Status s = render(n.body, out);
      scopes_.pop_back();
      FLEX_RETURN_IF_ERROR(s);
    }
    return Status();
  }

  Status render_scoped(const std::vector<Node>& nodes, std::string* out) {
    scopes_.push_back(Value::new_dict());
    Status s = render(nodes, out);
    scopes_.pop_back();
    return s;
  }

  Result<Value> eval(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.literal;
      case Expr::Kind::kName:
        return lookup(e.name);
      case Expr::Kind::kAttr: {
        FLEX_ASSIGN_OR_RETURN(Value obj, eval(*e.args[0]));
        if (obj.is_undefined()) return error(e.line, "'" + e.name + "' of an undefined value");
        return obj.get(e.name);
      }
      case Expr::Kind::kItem: {
        FLEX_ASSIGN_OR_RETURN(Value obj, eval(*e.args[0]));
        FLEX_ASSIGN_OR_RETURN(Value key, eval(*e.args[1]));
        return item(e, obj, key);
      }
      case Expr::Kind::kSlice:
        return slice(e);
      case Expr::Kind::kCall:
        return call(e);
      case Expr::Kind::kFilter:
        return filter(e);
      case Expr::Kind::kTest: {
        FLEX_ASSIGN_OR_RETURN(bool r, test(e));
        return Value::boolean(r != e.negated);
      }
      case Expr::Kind::kNot: {
        FLEX_ASSIGN_OR_RETURN(Value v, eval(*e.args[0]));
        return Value::boolean(!v.truthy());
      }
      case Expr::Kind::kNeg: {
        FLEX_ASSIGN_OR_RETURN(Value v, eval(*e.args[0]));
        if (v.kind == Value::Kind::kInt) return Value::integer(-v.i);
        if (v.kind == Value::Kind::kFloat) return Value::number(-v.f);
        return error(e.line, std::string("cannot negate ") + kind_name(v.kind));
      }
      case Expr::Kind::kBinary:
        return binary(e);
      case Expr::Kind::kCond: {
        FLEX_ASSIGN_OR_RETURN(Value c, eval(*e.args[1]));
        if (c.truthy()) return eval(*e.args[0]);
        if (e.args[2]) return eval(*e.args[2]);
        return Value();
      }
      case Expr::Kind::kList: {
        Value list = Value::new_list();
        for (const auto& a : e.args) {
          FLEX_ASSIGN_OR_RETURN(Value v, eval(*a));
          list.list->push_back(std::move(v));
        }
        return list;
      }
      case Expr::Kind::kDict: {
        Value dict = Value::new_dict();
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          FLEX_ASSIGN_OR_RETURN(Value key, eval(*e.args[k]));
          FLEX_ASSIGN_OR_RETURN(Value v, eval(*e.args[k + 1]));
          if (key.kind != Value::Kind::kString) return error(e.line, "dict keys must be strings");
          dict.set(key.s, std::move(v));
        }
        return dict;
      }
    }
    return error(e.line, "unknown expression");
  }

  Result<Value> item(const Expr& e, const Value& obj, const Value& key) {
    if (obj.is_mapping()) {
      if (key.kind != Value::Kind::kString) return error(e.line, "dict keys must be strings");
      return obj.get(key.s);
    }
    if (key.kind != Value::Kind::kInt) {
      if (obj.is_undefined()) return error(e.line, "subscript of an undefined value");
      return error(e.line, std::string("cannot index ") + kind_name(obj.kind) + " with " +
                               kind_name(key.kind));
    }
    if (obj.kind == Value::Kind::kList || obj.kind == Value::Kind::kString) {
      std::vector<std::string> chars;
      if (obj.kind == Value::Kind::kString) chars = code_points(obj.s);
      const auto n =
          static_cast<int64_t>(obj.kind == Value::Kind::kList ? obj.list->size() : chars.size());
      int64_t k = key.i < 0 ? key.i + n : key.i;
      if (k < 0 || k >= n) return Value();  // Jinja: undefined, not an error.
      if (obj.kind == Value::Kind::kList) return (*obj.list)[k];
      return Value::string(chars[k]);
    }
    if (obj.is_undefined()) return error(e.line, "subscript of an undefined value");
    return error(e.line, std::string("cannot index ") + kind_name(obj.kind));
  }

  Result<Value> slice(const Expr& e) {
    FLEX_ASSIGN_OR_RETURN(Value obj, eval(*e.args[0]));
    int64_t parts[3] = {0, 0, 1};
    bool given[3] = {false, false, false};
    for (int k = 0; k < 3; ++k) {
      if (!e.args[k + 1]) continue;
      FLEX_ASSIGN_OR_RETURN(Value v, eval(*e.args[k + 1]));
      if (v.kind == Value::Kind::kNone) continue;
      if (v.kind != Value::Kind::kInt) return error(e.line, "slice bounds must be integers");
      parts[k] = v.i;
      given[k] = true;
    }
    const int64_t step = parts[2];
    if (step == 0) return error(e.line, "slice step cannot be zero");
    List src;
    if (obj.kind == Value::Kind::kList) {
      src = *obj.list;
    } else if (obj.kind == Value::Kind::kString) {
      for (std::string& c : code_points(obj.s)) src.push_back(Value::string(std::move(c)));
    } else {
      return error(e.line, std::string("cannot slice ") + kind_name(obj.kind));
    }
    const auto n = static_cast<int64_t>(src.size());
    // Python's slice.indices().
    auto clamp = [&](int64_t v, bool is_given, int64_t fallback) {
      if (!is_given) return fallback;
      if (v < 0) v += n;
      if (step > 0) return std::clamp<int64_t>(v, 0, n);
      return std::clamp<int64_t>(v, -1, n - 1);
    };
    const int64_t start = clamp(parts[0], given[0], step > 0 ? 0 : n - 1);
    const int64_t stop = clamp(parts[1], given[1], step > 0 ? n : -1);
    List out;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) out.push_back(src[k]);
    if (obj.kind == Value::Kind::kList) return Value::new_list(std::move(out));
    std::string s;
    for (const Value& c : out) s += c.s;
    return Value::string(std::move(s));
  }

  Result<std::vector<Value>> eval_args(const Expr& e, size_t first) {
    std::vector<Value> args;
    for (size_t k = first; k < e.args.size(); ++k) {
      FLEX_ASSIGN_OR_RETURN(Value v, eval(*e.args[k]));
      args.push_back(std::move(v));
    }
    return args;
  }

  Result<Value> call(const Expr& e) {
    const Expr& callee = *e.args[0];
    FLEX_ASSIGN_OR_RETURN(std::vector<Value> args, eval_args(e, 1));
    if (callee.kind == Expr::Kind::kName) {
      if (callee.name == "namespace") {
        Value ns = Value::new_dict(Value::Kind::kNamespace);
        for (const auto& [key, value] : e.kwargs) {
          FLEX_ASSIGN_OR_RETURN(Value v, eval(*value));
          ns.set(key, std::move(v));
        }
        return ns;
      }
      if (callee.name == "raise_exception") {
        return invalid_argument("chat template: " + (args.empty() ? "error" : to_output(args[0])));
      }
      if (callee.name == "range") {
        int64_t r[3] = {0, 0, 1};
        for (const Value& a : args) {
          if (a.kind != Value::Kind::kInt) return error(e.line, "range() takes integers");
        }
        if (args.size() == 1) {
          r[1] = args[0].i;
        } else if (args.size() >= 2) {
          r[0] = args[0].i;
          r[1] = args[1].i;
          if (args.size() == 3) r[2] = args[2].i;
        }
        if (r[2] == 0 || args.empty() || args.size() > 3) return error(e.line, "bad range()");
        Value list = Value::new_list();
        for (int64_t k = r[0]; r[2] > 0 ? k < r[1] : k > r[1]; k += r[2]) {
          list.list->push_back(Value::integer(k));
        }
        return list;
      }
      return error(e.line, "'" + callee.name + "' is not callable");
    }
    if (callee.kind != Expr::Kind::kAttr)
      return error(e.line, "only functions and methods can be called");
    FLEX_ASSIGN_OR_RETURN(Value obj, eval(*callee.args[0]));
    return method(e.line, obj, callee.name, args);
  }

  Result<Value> method(int line, const Value& obj, const std::string& name,
                       const std::vector<Value>& args) {
    auto str_arg = [&](size_t k) -> const Value* {
      return k < args.size() && args[k].kind == Value::Kind::kString ? &args[k] : nullptr;
    };
    if (obj.kind == Value::Kind::kString) {
      const std::string& s = obj.s;
      if (name == "startswith" || name == "endswith") {
        const Value* a = str_arg(0);
        if (!a) return error(line, name + "() takes a string");
        return Value::boolean(name == "startswith" ? s.starts_with(a->s) : s.ends_with(a->s));
      }
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        const Value* chars = str_arg(0);
        return Value::string(strip_chars(s, chars, name != "rstrip", name != "lstrip"));
      }
      if (name == "split") {
        Value list = Value::new_list();
        const Value* sep = str_arg(0);
        if (sep == nullptr) {
          size_t k = 0;
          while (k < s.size()) {
            while (k < s.size() && is_py_space(s[k])) ++k;
            size_t j = k;
            while (j < s.size() && !is_py_space(s[j])) ++j;
            if (j > k) list.list->push_back(Value::string(s.substr(k, j - k)));
            k = j;
          }
          return list;
        }
        if (sep->s.empty()) return error(line, "split() with an empty separator");
        size_t start = 0;
        while (true) {
          const size_t at = s.find(sep->s, start);
          list.list->push_back(Value::string(s.substr(start, at - start)));
          if (at == std::string::npos) break;
          start = at + sep->s.size();
        }
        return list;
      }
      if (name == "upper" || name == "lower") {
        std::string r = s;
        for (char& c : r)
          c = static_cast<char>(name == "upper" ? std::toupper(c) : std::tolower(c));
        return Value::string(r);
      }
      if (name == "replace") {
        const Value* from = str_arg(0);
        const Value* to = str_arg(1);
        if (!from || !to || from->s.empty()) return error(line, "replace() takes two strings");
        std::string r;
        size_t start = 0, at;
        while ((at = s.find(from->s, start)) != std::string::npos) {
          r += s.substr(start, at - start) + to->s;
          start = at + from->s.size();
        }
        return Value::string(r + s.substr(start));
      }
      if (name == "title" || name == "capitalize") {
        std::string r = s;
        bool word_start = true;
        for (size_t k = 0; k < r.size(); ++k) {
          const bool alpha = std::isalpha(static_cast<unsigned char>(r[k]));
          if (name == "capitalize") {
            r[k] = static_cast<char>(k == 0 ? std::toupper(r[k]) : std::tolower(r[k]));
          } else {
            r[k] = static_cast<char>(word_start ? std::toupper(r[k]) : std::tolower(r[k]));
            word_start = !alpha;
          }
        }
        return Value::string(r);
      }
    }
    if (obj.kind == Value::Kind::kDict) {
      if (name == "get") {
        const Value* key = str_arg(0);
        if (!key) return error(line, "get() takes a string key");
        Value v = obj.get(key->s);
        if (v.is_undefined()) return args.size() > 1 ? args[1] : Value::none();
        return v;
      }
      if (name == "items" || name == "keys" || name == "values") {
        Value list = Value::new_list();
        for (const auto& [key, value] : *obj.dict) {
          if (name == "items") {
            list.list->push_back(Value::new_list({Value::string(key), value}));
          } else {
            list.list->push_back(name == "keys" ? Value::string(key) : value);
          }
        }
        return list;
      }
    }
    return error(line, std::string("no method ") + name + "() on " + kind_name(obj.kind));
  }

  Result<Value> filter(const Expr& e) {
    FLEX_ASSIGN_OR_RETURN(Value v, eval(*e.args[0]));
    FLEX_ASSIGN_OR_RETURN(std::vector<Value> args, eval_args(e, 1));
    const std::string& f = e.name;
    if (f == "length" || f == "count") {
      switch (v.kind) {
        case Value::Kind::kString:
          return Value::integer(static_cast<int64_t>(code_points(v.s).size()));
        case Value::Kind::kList:
          return Value::integer(static_cast<int64_t>(v.list->size()));
        case Value::Kind::kDict:
          return Value::integer(static_cast<int64_t>(v.dict->size()));
        default:
          return error(e.line, std::string("length of ") + kind_name(v.kind));
      }
    }
    if (f == "tojson") {
      int indent = -1;
      for (const auto& [key, value] : e.kwargs) {
        FLEX_ASSIGN_OR_RETURN(Value iv, eval(*value));
        if (key == "indent" && iv.kind == Value::Kind::kInt) indent = static_cast<int>(iv.i);
      }
      if (!args.empty() && args[0].kind == Value::Kind::kInt) indent = static_cast<int>(args[0].i);
      return Value::string(to_json_text(v, indent));
    }
    if (f == "trim") return Value::string(strip_chars(to_output(v), nullptr, true, true));
    if (f == "string") return Value::string(to_output(v));
    if (f == "upper" || f == "lower" || f == "capitalize") {
      return method(e.line, Value::string(to_output(v)), f, {});
    }
    if (f == "replace") return method(e.line, Value::string(to_output(v)), f, args);
    if (f == "first" || f == "last") {
      if (v.kind == Value::Kind::kList) {
        if (v.list->empty()) return Value();
        return f == "first" ? v.list->front() : v.list->back();
      }
      if (v.kind == Value::Kind::kString) {
        auto chars = code_points(v.s);
        if (chars.empty()) return Value();
        return Value::string(f == "first" ? chars.front() : chars.back());
      }
      return error(e.line, f + " of " + kind_name(v.kind));
    }
    if (f == "join") {
      if (v.kind != Value::Kind::kList)
        return error(e.line, "join of " + std::string(kind_name(v.kind)));
      const std::string sep = args.empty() ? "" : to_output(args[0]);
      std::string r;
      for (size_t k = 0; k < v.list->size(); ++k) r += (k ? sep : "") + to_output((*v.list)[k]);
      return Value::string(r);
    }
    if (f == "default" || f == "d") {
      const bool boolean = args.size() > 1 && args[1].truthy();
      if (v.is_undefined() || (boolean && !v.truthy()))
        return args.empty() ? Value::string("") : args[0];
      return v;
    }
    if (f == "list") {
      if (v.kind == Value::Kind::kList) return Value::new_list(*v.list);
      if (v.kind == Value::Kind::kDict) return method(e.line, v, "keys", {});
      if (v.kind == Value::Kind::kString) {
        Value list = Value::new_list();
        for (std::string& c : code_points(v.s)) list.list->push_back(Value::string(std::move(c)));
        return list;
      }
      return error(e.line, std::string("list of ") + kind_name(v.kind));
    }
    if (f == "items") return method(e.line, v, "items", {});
    if (f == "reverse") {
      if (v.kind == Value::Kind::kList) {
        List r(v.list->rbegin(), v.list->rend());
        return Value::new_list(std::move(r));
      }
      if (v.kind == Value::Kind::kString) {
        auto chars = code_points(v.s);
        std::string r;
        for (auto it = chars.rbegin(); it != chars.rend(); ++it) r += *it;
        return Value::string(r);
      }
      return error(e.line, std::string("reverse of ") + kind_name(v.kind));
    }
    if (f == "int") {
      if (v.kind == Value::Kind::kInt) return v;
      if (v.kind == Value::Kind::kFloat) return Value::integer(static_cast<int64_t>(v.f));
      if (v.kind == Value::Kind::kString)
        return Value::integer(std::strtoll(v.s.c_str(), nullptr, 10));
      return Value::integer(0);
    }
    if (f == "float") {
      if (v.kind == Value::Kind::kFloat) return v;
      if (v.kind == Value::Kind::kInt) return Value::number(static_cast<double>(v.i));
      if (v.kind == Value::Kind::kString) return Value::number(std::strtod(v.s.c_str(), nullptr));
      return Value::number(0);
    }
    if (f == "abs") {
      if (v.kind == Value::Kind::kInt) return Value::integer(v.i < 0 ? -v.i : v.i);
      if (v.kind == Value::Kind::kFloat) return Value::number(std::fabs(v.f));
      return error(e.line, std::string("abs of ") + kind_name(v.kind));
    }
    if (f == "safe") return v;
    return error(e.line, "filter '" + f + "' is not supported");
  }

  Result<bool> test(const Expr& e) {
    FLEX_ASSIGN_OR_RETURN(Value v, eval(*e.args[0]));
    FLEX_ASSIGN_OR_RETURN(std::vector<Value> args, eval_args(e, 1));
    const std::string& t = e.name;
    using K = Value::Kind;
    if (t == "defined") return !v.is_undefined();
    if (t == "undefined") return v.is_undefined();
    if (t == "none") return v.kind == K::kNone;
    if (t == "string") return v.kind == K::kString;
    if (t == "number") return v.kind == K::kInt || v.kind == K::kFloat;
    if (t == "integer") return v.kind == K::kInt;
    if (t == "float") return v.kind == K::kFloat;
    if (t == "boolean") return v.kind == K::kBool;
    if (t == "mapping") return v.kind == K::kDict;
    if (t == "iterable") return v.kind == K::kList || v.kind == K::kDict || v.kind == K::kString;
    if (t == "sequence") return v.kind == K::kList || v.kind == K::kString || v.kind == K::kDict;
    if (t == "true") return v.kind == K::kBool && v.b;
    if (t == "false") return v.kind == K::kBool && !v.b;
    if (t == "odd" || t == "even") {
      if (v.kind != K::kInt) return error(e.line, t + " test of " + kind_name(v.kind));
      return (v.i % 2 != 0) == (t == "odd");
    }
    if (t == "eq" || t == "equalto") {
      if (args.size() != 1) return error(e.line, t + " test takes one argument");
      return equals(v, args[0]);
    }
    return error(e.line, "test '" + t + "' is not supported");
  }

  Result<Value> binary(const Expr& e) {
    const std::string& op = e.name;
    FLEX_ASSIGN_OR_RETURN(Value a, eval(*e.args[0]));
    if (op == "and") return a.truthy() ? eval(*e.args[1]) : Result<Value>(a);
    if (op == "or") return a.truthy() ? Result<Value>(a) : eval(*e.args[1]);
    FLEX_ASSIGN_OR_RETURN(Value b, eval(*e.args[1]));
    using K = Value::Kind;
    if (op == "==") return Value::boolean(equals(a, b));
    if (op == "!=") return Value::boolean(!equals(a, b));
    if (op == "~") return Value::string(to_output(a) + to_output(b));
    if (op == "in" || op == "notin") {
      bool found = false;
      if (b.kind == K::kString && a.kind == K::kString) {
        found = b.s.find(a.s) != std::string::npos;
      } else if (b.kind == K::kList) {
        for (const Value& x : *b.list) found = found || equals(x, a);
      } else if (b.is_mapping() && a.kind == K::kString) {
        found = !b.get(a.s).is_undefined();
      } else {
        return error(e.line, std::string("'in' on ") + kind_name(b.kind));
      }
      return Value::boolean(found == (op == "in"));
    }
    const bool numbers =
        (a.kind == K::kInt || a.kind == K::kFloat) && (b.kind == K::kInt || b.kind == K::kFloat);
    const double x = a.kind == K::kFloat ? a.f : static_cast<double>(a.i);
    const double y = b.kind == K::kFloat ? b.f : static_cast<double>(b.i);
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int cmp;
      if (numbers) {
        cmp = x < y ? -1 : (x > y ? 1 : 0);
      } else if (a.kind == K::kString && b.kind == K::kString) {
        cmp = a.s.compare(b.s);
      } else {
        return error(e.line, std::string("cannot compare ") + kind_name(a.kind) + " and " +
                                 kind_name(b.kind));
      }
      const bool r = op == "<" ? cmp < 0 : op == ">" ? cmp > 0 : op == "<=" ? cmp <= 0 : cmp >= 0;
      return Value::boolean(r);
    }
    if (op == "+") {
      if (a.kind == K::kString && b.kind == K::kString) return Value::string(a.s + b.s);
      if (a.kind == K::kList && b.kind == K::kList) {
        List r = *a.list;
        r.insert(r.end(), b.list->begin(), b.list->end());
        return Value::new_list(std::move(r));
      }
    }
    if (numbers) {
      const bool ints = a.kind == K::kInt && b.kind == K::kInt;
      if (op == "+") return ints ? Value::integer(a.i + b.i) : Value::number(x + y);
      if (op == "-") return ints ? Value::integer(a.i - b.i) : Value::number(x - y);
      if (op == "*") return ints ? Value::integer(a.i * b.i) : Value::number(x * y);
      if (op == "/") {
        if (y == 0) return error(e.line, "division by zero");
        return Value::number(x / y);
      }
      if (op == "//" || op == "%") {
        if (y == 0) return error(e.line, "division by zero");
        if (ints) {
          int64_t q = a.i / b.i;
          if ((a.i % b.i != 0) && ((a.i < 0) != (b.i < 0))) --q;  // Python floors.
          return op == "//" ? Value::integer(q) : Value::integer(a.i - q * b.i);
        }
        const double q = std::floor(x / y);
        return op == "//" ? Value::number(q) : Value::number(x - q * y);
      }
    }
    if (op == "*" && a.kind == K::kString && b.kind == K::kInt) {
      std::string r;
      for (int64_t k = 0; k < b.i; ++k) r += a.s;
      return Value::string(r);
    }
    return error(e.line,
                 "cannot apply '" + op + "' to " + kind_name(a.kind) + " and " + kind_name(b.kind));
  }

  std::vector<Value> scopes_;  // Dicts, innermost last.
};

}  // namespace

bool is_known_filter(std::string_view name) { return known(kFilters, name); }
bool is_known_test(std::string_view name) { return known(kTests, name); }
bool is_known_function(std::string_view name) { return known(kFunctions, name); }
bool is_known_method(std::string_view name) { return known(kMethods, name); }

Result<std::string> render(const Template& t, const Value& globals) {
  Renderer r(globals);
  std::string out;
  FLEX_RETURN_IF_ERROR(r.render(t.body, &out));
  return out;
}

}  // namespace flexpert::jinja
