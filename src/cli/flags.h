// SPDX-License-Identifier: Apache-2.0
// A small command-line flag parser for the flexpert subcommands.
//
// Accepts `--name value`, `--name=value` and bare boolean `--name`. Every flag
// must be declared; unknown flags, missing values and malformed numbers are
// reported as InvalidArgument, which the CLI turns into exit code 2.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "flexpert/status.h"

namespace flexpert::cli {

class Flags {
 public:
  // Declares a flag taking a value, with its default ("" for none) and help text.
  Flags& value(const std::string& name, std::string default_value, std::string help);
  // Declares a boolean flag (false unless given).
  Flags& boolean(const std::string& name, std::string help);

  Status parse(const std::vector<std::string>& args);

  bool has(const std::string& name) const;  // Given on the command line.
  std::string str(const std::string& name) const;
  bool flag(const std::string& name) const;
  Result<int64_t> integer(const std::string& name) const;
  Result<double> number(const std::string& name) const;
  // A comma-separated list of integers ("1,2,3").
  Result<std::vector<int64_t>> int_list(const std::string& name) const;
  std::string help() const;

 private:
  struct Spec {
    bool is_bool = false;
    std::string default_value;
    std::string help;
  };
  std::map<std::string, Spec> specs_;
  std::map<std::string, std::string> values_;
};

Result<int64_t> parse_int(const std::string& text, const std::string& what);

// --min-replicas: "auto" (0: as many as the slots hold, up to two; auto_min_replicas in
// flexpert/placement.h) or a count >= 1.
Result<int> min_replicas_flag(const Flags& flags);

// A secret from --NAME-file (its first line), else the environment variable `env`,
// else --NAME (visible to every user in /proc/PID/cmdline: kept for compatibility,
// with a warning). "" when none is given. Two sources at once, an unreadable or
// empty file: InvalidArgument. The flags NAME and NAME-file must be declared.
Result<std::string> secret_from(const Flags& flags, const std::string& name, const char* env);
// The admin key: secret_from(flags, "admin-key", "FLEXPERT_ADMIN_KEY").
Result<std::string> admin_key_from(const Flags& flags);

}  // namespace flexpert::cli
