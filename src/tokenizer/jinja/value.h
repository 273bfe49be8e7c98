// SPDX-License-Identifier: Apache-2.0
// Values of the Jinja interpreter (src/tokenizer/jinja): Python's types as chat templates see
// them. Lists, dicts and namespaces are shared by reference, as in Python (a namespace is how
// a template carries state out of a loop). Dicts keep insertion order (tojson prints in it).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace flexpert::jinja {

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;

struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace };
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;  // kDict and kNamespace.

  static Value none() { return with(Kind::kNone); }
  static Value boolean(bool v) {
    Value x = with(Kind::kBool);
    x.b = v;
    return x;
  }
  static Value integer(int64_t v) {
    Value x = with(Kind::kInt);
    x.i = v;
    return x;
  }
  static Value number(double v) {
    Value x = with(Kind::kFloat);
    x.f = v;
    return x;
  }
  static Value string(std::string v) {
    Value x = with(Kind::kString);
    x.s = std::move(v);
    return x;
  }
  static Value new_list(List items = {}) {
    Value x = with(Kind::kList);
    x.list = std::make_shared<List>(std::move(items));
    return x;
  }
  static Value new_dict(Kind kind = Kind::kDict) {
    Value x = with(kind);
    x.dict = std::make_shared<Dict>();
    return x;
  }
  static Value from_json(const nlohmann::ordered_json& j);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_mapping() const { return kind == Kind::kDict || kind == Kind::kNamespace; }
  bool truthy() const;
  // The attribute or key `name` of a dict or namespace; undefined if absent.
  Value get(const std::string& name) const;
  void set(const std::string& name, Value v);

 private:
  static Value with(Kind k) {
    Value x;
    x.kind = k;
    return x;
  }
};

bool equals(const Value& a, const Value& b);
// What `{{ v }}` prints (Python's str(); undefined prints nothing).
std::string to_output(const Value& v);
// Python's json.dumps(v, ensure_ascii=False) (indent < 0: one line), which transformers'
// tojson filter calls.
std::string to_json_text(const Value& v, int indent = -1);
const char* kind_name(Value::Kind kind);

}  // namespace flexpert::jinja
