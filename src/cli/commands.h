// SPDX-License-Identifier: Apache-2.0
// The flexpert subcommands. Each returns the process exit code: 0 success,
// 1 a runtime failure, 2 bad input (with a message on stderr).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flexpert/status.h"

namespace flexpert::cli {

using Args = std::vector<std::string>;

int cmd_generate(const Args& args);
int cmd_synth(const Args& args);
int cmd_bench(const Args& args);
int cmd_serve(const Args& args);
int cmd_worker(const Args& args);
int cmd_eplb(const Args& args);
int cmd_scale(const Args& args);
int cmd_demo(const Args& args);
int cmd_bench_elastic(const Args& args);
int cmd_tokenize(const Args& args);       // cmd_tokenize.cc
int cmd_detokenize(const Args& args);     // cmd_tokenize.cc
int cmd_chat_template(const Args& args);  // cmd_chat_template.cc
int cmd_plan_memory(const Args& args);    // cmd_plan_memory.cc

// Prints the status and returns its exit code (2 for InvalidArgument/NotFound, else 1).
int report_error(const std::string& command, const Status& status);

// A one-line progress display on stderr, redrawn at most every 200 ms.
class Progress {
 public:
  explicit Progress(std::string label);
  void update(uint64_t done, uint64_t total, const char* unit = "");
  void finish();

 private:
  std::string label_;
  int64_t start_ms_ = 0;
  int64_t last_ms_ = -1;
  bool drawn_ = false;
};

}  // namespace flexpert::cli
