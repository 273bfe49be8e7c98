// SPDX-License-Identifier: Apache-2.0
#include "flexpert/status.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace flexpert {
namespace {

TEST(StatusTest, DefaultIsOk) {
  const Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.to_string(), "OK");
  EXPECT_TRUE(Status::ok_status().ok());
}

TEST(StatusTest, OkCodeDropsMessage) {
  const Status s(StatusCode::kOk, "ignored");
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.to_string(), "OK");
}

TEST(StatusTest, FactoriesSetCodeAndMessage) {
  const std::vector<std::pair<Status, StatusCode>> cases = {
      {invalid_argument("m"), StatusCode::kInvalidArgument},
      {not_found("m"), StatusCode::kNotFound},
      {data_loss("m"), StatusCode::kDataLoss},
      {unavailable("m"), StatusCode::kUnavailable},
      {deadline_exceeded("m"), StatusCode::kDeadlineExceeded},
      {failed_precondition("m"), StatusCode::kFailedPrecondition},
      {resource_exhausted("m"), StatusCode::kResourceExhausted},
      {unimplemented("m"), StatusCode::kUnimplemented},
      {internal_error("m"), StatusCode::kInternal},
      {Status(StatusCode::kAborted, "m"), StatusCode::kAborted},
  };
  for (const auto& [status, code] : cases) {
    SCOPED_TRACE(std::string(status_code_name(code)));
    EXPECT_FALSE(status.ok());
    EXPECT_EQ(status.code(), code);
    EXPECT_EQ(status.message(), "m");
    EXPECT_EQ(status.to_string(), std::string(status_code_name(code)) + ": m");
  }
}

TEST(StatusTest, CodeNames) {
  EXPECT_EQ(status_code_name(StatusCode::kOk), "OK");
  EXPECT_EQ(status_code_name(StatusCode::kInvalidArgument), "INVALID_ARGUMENT");
  EXPECT_EQ(status_code_name(StatusCode::kNotFound), "NOT_FOUND");
  EXPECT_EQ(status_code_name(StatusCode::kDataLoss), "DATA_LOSS");
  EXPECT_EQ(status_code_name(StatusCode::kUnavailable), "UNAVAILABLE");
  EXPECT_EQ(status_code_name(StatusCode::kDeadlineExceeded), "DEADLINE_EXCEEDED");
  EXPECT_EQ(status_code_name(StatusCode::kAborted), "ABORTED");
  EXPECT_EQ(status_code_name(StatusCode::kFailedPrecondition), "FAILED_PRECONDITION");
  EXPECT_EQ(status_code_name(StatusCode::kResourceExhausted), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(status_code_name(StatusCode::kUnimplemented), "UNIMPLEMENTED");
  EXPECT_EQ(status_code_name(StatusCode::kInternal), "INTERNAL");
}

TEST(StatusTest, AnnotatePrefixesContextAndKeepsCode) {
  const Status base = data_loss("truncated header");
  const Status annotated = base.annotate("loading layer 3");
  EXPECT_EQ(annotated.code(), StatusCode::kDataLoss);
  EXPECT_EQ(annotated.message(), "loading layer 3: truncated header");
  EXPECT_EQ(annotated.to_string(), "DATA_LOSS: loading layer 3: truncated header");
  EXPECT_EQ(base.message(), "truncated header") << "annotate must not modify the original";
  EXPECT_EQ(annotated.annotate("model").message(), "model: loading layer 3: truncated header");
  EXPECT_TRUE(Status().annotate("context").ok());
}

TEST(StatusTest, DeadRankIsAFieldKeptByAnnotate) {
  EXPECT_EQ(Status().dead_rank(), -1);
  EXPECT_EQ(unavailable("rank 2 (pid 7) died").dead_rank(), -1);
  const Status died = unavailable("rank 2 (pid 7) died").with_dead_rank(2);
  EXPECT_EQ(died.dead_rank(), 2);
  EXPECT_EQ(died.code(), StatusCode::kUnavailable);
  EXPECT_EQ(died.message(), "rank 2 (pid 7) died");
  const Status annotated = died.annotate("layer 3 exchange");
  EXPECT_EQ(annotated.dead_rank(), 2);
  EXPECT_EQ(annotated.message(), "layer 3 exchange: rank 2 (pid 7) died");
  EXPECT_TRUE(Status().with_dead_rank(3).ok());
}

TEST(StatusTest, CopiesAndMovesKeepContents) {
  Status a = unavailable("peer busy");
  const Status b = a;  // NOLINT: testing the copy.
  EXPECT_EQ(b.code(), StatusCode::kUnavailable);
  EXPECT_EQ(b.message(), "peer busy");
  const Status c = std::move(a);
  EXPECT_EQ(c.code(), StatusCode::kUnavailable);
  EXPECT_EQ(c.message(), "peer busy");
  Status d;
  d = c;
  EXPECT_EQ(d.to_string(), "UNAVAILABLE: peer busy");
}

TEST(ResultTest, HoldsValue) {
  Result<int> r = 42;
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r.status().ok());
  EXPECT_EQ(r.value(), 42);
  EXPECT_EQ(*r, 42);
  r.value() = 7;
  EXPECT_EQ(r.value(), 7);
  const Result<int>& cr = r;
  EXPECT_EQ(cr.value(), 7);
}

TEST(ResultTest, HoldsError) {
  const Result<std::string> r = not_found("tensor w");
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(), "tensor w");
}

TEST(ResultTest, ArrowAndMoveOnlyValues) {
  Result<std::string> s = std::string("hello");
  EXPECT_EQ(s->size(), 5u);
  const Result<std::string>& cs = s;
  EXPECT_EQ(cs->front(), 'h');

  Result<std::unique_ptr<int>> p = std::make_unique<int>(5);
  ASSERT_TRUE(p.ok());
  std::unique_ptr<int> taken = std::move(p).value();
  ASSERT_NE(taken, nullptr);
  EXPECT_EQ(*taken, 5);
}

// Helpers for the macros: each counts its calls so the tests can see short-circuiting.
struct Calls {
  int produced = 0;
  int after = 0;
};

Status step(Status s, Calls* calls) {
  ++calls->produced;
  return s;
}

Status run_two_steps(Status first, Status second, Calls* calls) {
  FLEX_RETURN_IF_ERROR(step(std::move(first), calls));
  FLEX_RETURN_IF_ERROR(step(std::move(second), calls));
  ++calls->after;
  return Status();
}

TEST(MacroTest, ReturnIfErrorPassesOkThrough) {
  Calls calls;
  EXPECT_TRUE(run_two_steps(Status(), Status(), &calls).ok());
  EXPECT_EQ(calls.produced, 2);
  EXPECT_EQ(calls.after, 1);
}

TEST(MacroTest, ReturnIfErrorReturnsFirstError) {
  Calls calls;
  const Status s = run_two_steps(unavailable("first"), internal_error("second"), &calls);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "first");
  EXPECT_EQ(calls.produced, 1) << "the expression after the error must not run";
  EXPECT_EQ(calls.after, 0);

  Calls calls2;
  const Status s2 = run_two_steps(Status(), internal_error("second"), &calls2);
  EXPECT_EQ(s2.code(), StatusCode::kInternal);
  EXPECT_EQ(calls2.produced, 2);
  EXPECT_EQ(calls2.after, 0);
}

Result<int> parse_positive(int v, Calls* calls) {
  ++calls->produced;
  if (v <= 0) return invalid_argument("not positive: " + std::to_string(v));
  return v;
}

// Two uses in one scope (distinct temporaries), one assigning to an existing variable.
Result<int> add_positive(int a, int b, Calls* calls) {
  FLEX_ASSIGN_OR_RETURN(const int x, parse_positive(a, calls));
  int y = 0;
  FLEX_ASSIGN_OR_RETURN(y, parse_positive(b, calls));
  ++calls->after;
  return x + y;
}

Status check_sum(int a, int b, int* out, Calls* calls) {
  FLEX_ASSIGN_OR_RETURN(*out, add_positive(a, b, calls));
  return Status();
}

TEST(MacroTest, AssignOrReturnBindsValues) {
  Calls calls;
  const Result<int> r = add_positive(2, 3, &calls);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.value(), 5);
  EXPECT_EQ(calls.produced, 2);
  EXPECT_EQ(calls.after, 1);

  int out = 0;
  EXPECT_TRUE(check_sum(4, 5, &out, &calls).ok());
  EXPECT_EQ(out, 9);
}

TEST(MacroTest, AssignOrReturnPropagatesError) {
  Calls calls;
  const Result<int> r = add_positive(-1, 3, &calls);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "not positive: -1");
  EXPECT_EQ(calls.produced, 1);
  EXPECT_EQ(calls.after, 0);

  int out = -99;
  const Status s = check_sum(1, 0, &out, &calls);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "not positive: 0");
  EXPECT_EQ(out, -99) << "the target must not be assigned on error";
}

Result<std::unique_ptr<int>> make_box(int v) {
  if (v < 0) return invalid_argument("negative");
  return std::make_unique<int>(v);
}

Result<int> unbox(int v) {
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<int> box, make_box(v));
  return *box + 1;
}

TEST(MacroTest, AssignOrReturnMovesMoveOnlyValues) {
  const Result<int> ok = unbox(41);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok.value(), 42);
  EXPECT_EQ(unbox(-1).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flexpert
