// SPDX-License-Identifier: Apache-2.0
#include "flexpert/logging.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>

namespace flexpert {
namespace {

LogLevel threshold_from_env() {
  const char* env = std::getenv("FLEXPERT_LOG");
  if (env == nullptr) return LogLevel::kInfo;
  std::string v(env);
  if (v == "debug") return LogLevel::kDebug;
  if (v == "warn") return LogLevel::kWarn;
  if (v == "error") return LogLevel::kError;
  return LogLevel::kInfo;
}

std::atomic<int>& threshold() {
  static std::atomic<int> t{static_cast<int>(threshold_from_env())};
  return t;
}

std::mutex& log_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

LogLevel log_threshold() { return static_cast<LogLevel>(threshold().load()); }
void set_log_threshold(LogLevel level) { threshold().store(static_cast<int>(level)); }

LogMessage::LogMessage(LogLevel level, const char* file, int line) : level_(level) {
  using namespace std::chrono;
  auto now = system_clock::now();
  std::time_t t = system_clock::to_time_t(now);
  auto ms = duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03d", tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(ms));
  const char* base = std::strrchr(file, '/');
  static const char kLetters[] = {'D', 'I', 'W', 'E', 'F'};
  stream_ << '[' << kLetters[static_cast<int>(level)] << ' ' << buf << ' '
          << (base ? base + 1 : file) << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  {
    std::lock_guard<std::mutex> lock(log_mutex());
    std::fputs(stream_.str().c_str(), stderr);
    std::fflush(stderr);
  }
  if (level_ == LogLevel::kFatal) std::abort();
}

}  // namespace flexpert
