// SPDX-License-Identifier: Apache-2.0
#include "cli/flags.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "flexpert/logging.h"

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

Result<std::string> secret_from(const Flags& flags, const std::string& name, const char* env) {
  const std::string file_flag = name + "-file";
  const bool has_file = !flags.str(file_flag).empty();
  const bool has_flag = !flags.str(name).empty();
  const char* env_value = std::getenv(env);
  const bool has_env = env_value != nullptr && *env_value != '\0';
  if (has_file + has_flag + has_env > 1) {
    return invalid_argument("give one of --" + file_flag + ", " + env + " or --" + name);
  }
  if (has_file) {
    const std::string path = flags.str(file_flag);
    // O_NONBLOCK: a FIFO must not hang the start; only a regular file is read.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
      return invalid_argument("--" + file_flag + " " + path + ": " + std::strerror(errno));
    struct stat st;
    char buf[4096];
    ssize_t n = -1;
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size < 4096) {
      n = ::read(fd, buf, sizeof(buf));
    }
    ::close(fd);
    if (n < 0) {
      return invalid_argument("--" + file_flag + " " + path +
                              ": not a readable regular file under 4 KiB");
    }
    std::string key(buf, static_cast<size_t>(n));
    key = key.substr(0, key.find_first_of("\r\n"));
    while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.pop_back();
    if (key.empty()) return invalid_argument("--" + file_flag + " " + path + " holds no key");
    return key;
  }
  if (has_env) return std::string(env_value);
  if (has_flag) {
    FLEX_LOG(WARN) << "--" << name << " is visible to every user of this host (/proc/PID/cmdline); "
                   << "prefer " << env << " or --" << file_flag;
  }
  return flags.str(name);
}

Result<std::string> admin_key_from(const Flags& flags) {
  return secret_from(flags, "admin-key", "FLEXPERT_ADMIN_KEY");
}

Result<int> min_replicas_flag(const Flags& flags) {
  const std::string v = flags.str("min-replicas");
  if (v == "auto") return 0;
  FLEX_ASSIGN_OR_RETURN(int64_t n, flags.integer("min-replicas"));
  if (n < 1 || n > (1 << 20)) return invalid_argument("--min-replicas must be auto or >= 1");
  return static_cast<int>(n);
}

}  // namespace flexpert::cli
