// SPDX-License-Identifier: Apache-2.0
#include "cli/flags.h"

#include <cerrno>
#include <cstdlib>
#include <sstream>

namespace flexpert::cli {

Flags& Flags::value(const std::string& name, std::string default_value, std::string help) {
  specs_[name] = Spec{false, std::move(default_value), std::move(help)};
  return *this;
}

Flags& Flags::boolean(const std::string& name, std::string help) {
  specs_[name] = Spec{true, "", std::move(help)};
  return *this;
}

Status Flags::parse(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0) return invalid_argument("unexpected argument '" + arg + "'");
    std::string name = arg.substr(2), val;
    bool inline_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      val = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    auto it = specs_.find(name);
    if (it == specs_.end()) return invalid_argument("unknown flag --" + name);
    if (it->second.is_bool) {
      if (inline_value && val != "true" && val != "false") {
        return invalid_argument("--" + name + " takes no value (or =true/=false)");
      }
      values_[name] = inline_value ? val : "true";
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= args.size()) return invalid_argument("--" + name + " needs a value");
      val = args[++i];
    }
    values_[name] = val;
  }
  return Status();
}

bool Flags::has(const std::string& name) const { return values_.count(name) > 0; }

std::string Flags::str(const std::string& name) const {
  auto it = values_.find(name);
  if (it != values_.end()) return it->second;
  auto spec = specs_.find(name);
  return spec == specs_.end() ? "" : spec->second.default_value;
}

bool Flags::flag(const std::string& name) const { return str(name) == "true"; }

Result<int64_t> parse_int(const std::string& text, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE) {
    return invalid_argument(what + " must be an integer, got '" + text + "'");
  }
  return static_cast<int64_t>(v);
}

Result<int64_t> Flags::integer(const std::string& name) const {
  return parse_int(str(name), "--" + name);
}

Result<double> Flags::number(const std::string& name) const {
  const std::string text = str(name);
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0') {
    return invalid_argument("--" + name + " must be a number, got '" + text + "'");
  }
  return v;
}

Result<std::vector<int64_t>> Flags::int_list(const std::string& name) const {
  std::vector<int64_t> out;
  std::stringstream ss(str(name));
  std::string item;
  while (std::getline(ss, item, ',')) {
    FLEX_ASSIGN_OR_RETURN(int64_t v, parse_int(item, "--" + name + " item"));
    out.push_back(v);
  }
  if (out.empty()) return invalid_argument("--" + name + " needs a comma-separated list");
  return out;
}

std::string Flags::help() const {
  std::ostringstream out;
  for (const auto& [name, spec] : specs_) {
    out << "  --" << name << (spec.is_bool ? "" : " VALUE");
    if (!spec.default_value.empty()) out << " (default " << spec.default_value << ")";
    out << "\n      " << spec.help << "\n";
  }
  return out.str();
}

}  // namespace flexpert::cli
