// SPDX-License-Identifier: Apache-2.0
// Runs the flexpert binary (FLEXPERT_BINARY, set by tests/CMakeLists.txt) as a
// user would, for tests of the command line.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace flexpert_test {

struct CliRun {
  int exit_code;
  std::string out;  // stdout and stderr together (stdout alone: stdout_only).
};

// `args` go through the shell after the binary's path. stdout_only: stderr (progress
// lines, which a slow load draws, and logs) is dropped, for output a test parses.
inline CliRun run_flexpert(const std::string& args, bool stdout_only = false) {
  const std::string cmd =
      std::string(FLEXPERT_BINARY) + " " + args + (stdout_only ? " 2>/dev/null" : " 2>&1");
  FILE* pipe = popen(cmd.c_str(), "r");
  CliRun r{-1, ""};
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace flexpert_test
