// SPDX-License-Identifier: Apache-2.0
// A scratch directory for one test (under the system's temporary directory, named by a
// tag and the process id), removed with it; write() puts a file in it.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace flexpert_test {

class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag)
      : dir_(std::filesystem::temp_directory_path() / (tag + "_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(dir_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return dir_; }
  // Writes `text` to `name` in the directory; returns the file's path.
  std::string write(const std::string& name, const std::string& text) const {
    const std::filesystem::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }

 private:
  std::filesystem::path dir_;
};

}  // namespace flexpert_test
