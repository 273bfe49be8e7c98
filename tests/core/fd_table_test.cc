// SPDX-License-Identifier: Apache-2.0
// reserve_fd_table against the kernel's own account of the table (FDSize in
// /proc/self/status).
#include "core/fd_table.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <fstream>
#include <string>

namespace flexpert {
namespace {

int fd_table_size() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("FDSize:", 0) == 0) return std::stoi(line.substr(7));
  }
  return -1;
}

TEST(FdTableTest, GrowsTheTableOnceToTheReservedSize) {
  const int before = fd_table_size();
  ASSERT_GT(before, 0) << "no FDSize in /proc/self/status";
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  const int want = before * 8;
  if (limit.rlim_max < static_cast<rlim_t>(want)) {
    GTEST_SKIP() << "the hard descriptor limit " << limit.rlim_max << " is below " << want;
  }
  const int got = reserve_fd_table(want);
  EXPECT_EQ(got, want);
  EXPECT_GE(fd_table_size(), want);
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  EXPECT_GE(limit.rlim_cur, static_cast<rlim_t>(want));
  // A smaller request leaves the table as it is.
  EXPECT_EQ(reserve_fd_table(4), 4);
  EXPECT_GE(fd_table_size(), want);
}

TEST(FdTableTest, RefusesNothingToReserve) { EXPECT_EQ(reserve_fd_table(0), 0); }

}  // namespace
}  // namespace flexpert
