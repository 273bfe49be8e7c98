// SPDX-License-Identifier: Apache-2.0
// Status and Result<T>: the one error type of flexpert.
//
// A Status is OK or carries a code telling the caller what to do, plus a
// message saying which call failed with what. Bugs are not errors: they abort
// through FLEX_CHECK (logging.h). Exceptions never cross module boundaries.
// Both types are cheap to move, immutable once built, and thread-compatible.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace flexpert {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,     // The caller's input is wrong; do not retry as is.
  kNotFound,            // A named thing (file, tensor, request) does not exist.
  kDataLoss,            // A file or message is truncated or corrupt.
  kUnavailable,         // Transient: retry.
  kDeadlineExceeded,    // A wait on a peer timed out.
  kAborted,             // The membership epoch changed: redo the step.
  kFailedPrecondition,  // Not in a state to do this (e.g. not a member).
  kResourceExhausted,   // Out of memory, slots or capacity.
  kUnimplemented,       // A configuration this build does not support.
  kInternal,            // An invariant of a dependency broke.
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message);

  static Status ok_status() { return Status(); }

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return ok() ? StatusCode::kOk : state_->code; }
  const std::string& message() const;
  // "CODE: message", or "OK".
  std::string to_string() const;
  // Prefixes context to the message ("loading layer 3: ..."), keeps the code and fields.
  Status annotate(std::string_view context) const;
  // A peer rank whose process a transport saw end, or -1: carried as a number (to the
  // front end in WorkerError::dead_rank), never parsed out of the message.
  int dead_rank() const { return ok() ? -1 : state_->dead_rank; }
  Status with_dead_rank(int rank) const;

 private:
  struct State {
    StatusCode code;
    std::string message;
    int dead_rank = -1;
  };
  std::shared_ptr<const State> state_;  // Shared by copies; immutable.
};

Status invalid_argument(std::string message);
Status not_found(std::string message);
Status data_loss(std::string message);
Status unavailable(std::string message);
Status deadline_exceeded(std::string message);
Status aborted(std::string message);
Status failed_precondition(std::string message);
Status resource_exhausted(std::string message);
Status unimplemented(std::string message);
Status internal_error(std::string message);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design.
  // An OK status carries no value: that is a bug of the caller, kept as an error.
  Result(Status status)  // NOLINT: implicit by design.
      : v_(status.ok() ? internal_error("Result built from an OK Status") : std::move(status)) {}

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<Status, T> v_;
};

}  // namespace flexpert

#define FLEX_CONCAT_INNER_(a, b) a##b
#define FLEX_CONCAT_(a, b) FLEX_CONCAT_INNER_(a, b)

// Returns the Status of `expr` from the enclosing function when it is not OK.
#define FLEX_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::flexpert::Status flex_status_ = (expr);    \
    if (!flex_status_.ok()) return flex_status_; \
  } while (0)

// `FLEX_ASSIGN_OR_RETURN(auto x, make_x());` binds the value or returns the error.
#define FLEX_ASSIGN_OR_RETURN(lhs, expr) \
  FLEX_ASSIGN_OR_RETURN_IMPL_(FLEX_CONCAT_(flex_result_, __LINE__), lhs, expr)
#define FLEX_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
