// SPDX-License-Identifier: Apache-2.0
// Logging to stderr and FLEX_CHECK for bugs.
//
// FLEX_LOG(INFO) << "..."; writes one line "[I hh:mm:ss.mmm file:line] ..."
// when the level is at or above the threshold (FLEXPERT_LOG=debug|info|warn|error,
// default info). Lines are written whole under a lock: thread-safe.
// FLEX_CHECK(cond) << "why"; aborts with file:line when cond is false: it marks
// broken invariants (bugs), never bad input or a dead peer (those are Status).
#pragma once

#include <sstream>

namespace flexpert {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kFatal = 4 };

LogLevel log_threshold();
void set_log_threshold(LogLevel level);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();  // Emits the line; aborts for kFatal.
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

// Swallows the stream expression when a log line is disabled.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace flexpert

#define FLEX_LOG_LEVEL_DEBUG ::flexpert::LogLevel::kDebug
#define FLEX_LOG_LEVEL_INFO ::flexpert::LogLevel::kInfo
#define FLEX_LOG_LEVEL_WARN ::flexpert::LogLevel::kWarn
#define FLEX_LOG_LEVEL_ERROR ::flexpert::LogLevel::kError

#define FLEX_LOG(level)                                  \
  (FLEX_LOG_LEVEL_##level < ::flexpert::log_threshold()) \
      ? (void)0                                          \
      : ::flexpert::LogVoidify() &                       \
            ::flexpert::LogMessage(FLEX_LOG_LEVEL_##level, __FILE__, __LINE__).stream()

#define FLEX_CHECK(cond)                                                                         \
  (cond) ? (void)0                                                                               \
         : ::flexpert::LogVoidify() &                                                            \
               ::flexpert::LogMessage(::flexpert::LogLevel::kFatal, __FILE__, __LINE__).stream() \
                   << "Check failed: " #cond " "
