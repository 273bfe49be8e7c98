// SPDX-License-Identifier: Apache-2.0
#include "tokenizer/jinja/value.h"

#include <cmath>
#include <cstdio>

namespace flexpert::jinja {

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned:
      return integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float:
      return number(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Value v = new_list();
      for (const auto& item : j) v.list->push_back(from_json(item));
      return v;
    }
    case nlohmann::ordered_json::value_t::object: {
      Value v = new_dict();
      for (auto it = j.begin(); it != j.end(); ++it) v.dict->emplace_back(it.key(), from_json(*it));
      return v;
    }
    default:
      return Value();
  }
}

bool Value::truthy() const {
  switch (kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return b;
    case Kind::kInt:
      return i != 0;
    case Kind::kFloat:
      return f != 0;
    case Kind::kString:
      return !s.empty();
    case Kind::kList:
      return !list->empty();
    case Kind::kDict:
      return !dict->empty();
    case Kind::kNamespace:
      return true;
  }
  return false;
}

Value Value::get(const std::string& name) const {
  if (!is_mapping()) return Value();
  for (const auto& [key, value] : *dict) {
    if (key == name) return value;
  }
  return Value();
}

void Value::set(const std::string& name, Value v) {
  for (auto& [key, value] : *dict) {
    if (key == name) {
      value = std::move(v);
      return;
    }
  }
  dict->emplace_back(name, std::move(v));
}

bool equals(const Value& a, const Value& b) {
  using K = Value::Kind;
  const bool a_num = a.kind == K::kInt || a.kind == K::kFloat || a.kind == K::kBool;
  const bool b_num = b.kind == K::kInt || b.kind == K::kFloat || b.kind == K::kBool;
  if (a_num && b_num) {
    auto as_double = [](const Value& v) {
      return v.kind == K::kFloat ? v.f : static_cast<double>(v.kind == K::kBool ? v.b : v.i);
    };
    return as_double(a) == as_double(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case K::kUndefined:
    case K::kNone:
      return true;
    case K::kString:
      return a.s == b.s;
    case K::kList:
      if (a.list->size() != b.list->size()) return false;
      for (size_t i = 0; i < a.list->size(); ++i) {
        if (!equals((*a.list)[i], (*b.list)[i])) return false;
      }
      return true;
    case K::kDict:
    case K::kNamespace:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [key, value] : *a.dict) {
        if (!equals(value, b.get(key))) return false;
      }
      return true;
    default:
      return false;
  }
}

namespace {

std::string python_float(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, f);
    if (std::strtod(buf, nullptr) == f) break;
  }
  std::string s = buf;
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

std::string python_repr(const Value& v);

std::string repr_string(const std::string& s) {
  const char quote =
      s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, quote);
  for (char c : s) {
    if (c == quote || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else {
      out += c;
    }
  }
  return out + quote;
}

std::string python_repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kString:
      return repr_string(v.s);
    case Value::Kind::kList: {
      std::string out = "[";
      for (size_t i = 0; i < v.list->size(); ++i)
        out += (i ? ", " : "") + python_repr((*v.list)[i]);
      return out + "]";
    }
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      std::string out = "{";
      bool first = true;
      for (const auto& [key, value] : *v.dict) {
        out += (first ? "" : ", ") + repr_string(key) + ": " + python_repr(value);
        first = false;
      }
      return out + "}";
    }
    default:
      return to_output(v);
  }
}

void json_string(const std::string& s, std::string* out) {
  *out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          *out += buf;
        } else {
          *out += static_cast<char>(c);
        }
    }
  }
  *out += '"';
}

void json_text(const Value& v, int indent, int depth, std::string* out) {
  const bool pretty = indent >= 0;
  auto newline = [&](int d) {
    if (!pretty) return;
    out->push_back('\n');
    out->append(static_cast<size_t>(indent * d), ' ');
  };
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      *out += "null";
      return;
    case Value::Kind::kBool:
      *out += v.b ? "true" : "false";
      return;
    case Value::Kind::kInt:
      *out += std::to_string(v.i);
      return;
    case Value::Kind::kFloat:
      *out += python_float(v.f);
      return;
    case Value::Kind::kString:
      json_string(v.s, out);
      return;
    case Value::Kind::kList: {
      if (v.list->empty()) {
        *out += "[]";
        return;
      }
      *out += '[';
      for (size_t i = 0; i < v.list->size(); ++i) {
        if (i > 0) *out += pretty ? "," : ", ";
        newline(depth + 1);
        json_text((*v.list)[i], indent, depth + 1, out);
      }
      newline(depth);
      *out += ']';
      return;
    }
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      if (v.dict->empty()) {
        *out += "{}";
        return;
      }
      *out += '{';
      bool first = true;
      for (const auto& [key, value] : *v.dict) {
        if (!first) *out += pretty ? "," : ", ";
        first = false;
        newline(depth + 1);
        json_string(key, out);
        *out += ": ";
        json_text(value, indent, depth + 1, out);
      }
      newline(depth);
      *out += '}';
      return;
    }
  }
}

}  // namespace

std::string to_output(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.b ? "True" : "False";
    case Value::Kind::kInt:
      return std::to_string(v.i);
    case Value::Kind::kFloat:
      return python_float(v.f);
    case Value::Kind::kString:
      return v.s;
    default:
      return python_repr(v);
  }
}

std::string to_json_text(const Value& v, int indent) {
  std::string out;
  json_text(v, indent, 0, &out);
  return out;
}

const char* kind_name(Value::Kind kind) {
  switch (kind) {
    case Value::Kind::kUndefined:
      return "undefined";
    case Value::Kind::kNone:
      return "none";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "string";
    case Value::Kind::kList:
      return "list";
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kNamespace:
      return "namespace";
  }
  return "?";
}

}  // namespace flexpert::jinja
