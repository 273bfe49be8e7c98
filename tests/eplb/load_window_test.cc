// SPDX-License-Identifier: Apache-2.0
#include "eplb/load_window.h"

#include <gtest/gtest.h>

#include <chrono>

#include "eplb/planner.h"

namespace flexpert::eplb {
namespace {

using std::chrono::milliseconds;
using Table = LoadWindow::Table;

// Rows at `t`, as a report of the ranks brings them.
void report(LoadWindow& w, LoadWindow::Clock::time_point t, int layer, int expert, double rows) {
  w.at(t);
  w.add(layer, expert, rows);
}

TEST(LoadWindowTest, SumsRowsOverTheWindowAndDropsBucketsThatLeftIt) {
  LoadWindow w(2, 3, /*window_s=*/2.0, /*smoothing=*/0);
  const auto t0 = LoadWindow::Clock::time_point() + std::chrono::hours(1);
  EXPECT_EQ(w.sum(), Table(2, std::vector<double>(3, 0)));
  w.add(0, 0, 9);  // Before the first report: no bucket, not counted.
  report(w, t0, 0, 1, 5);
  report(w, t0 + milliseconds(999), 0, 1, 2);   // Same bucket.
  report(w, t0 + milliseconds(1000), 1, 2, 4);  // A new one.
  EXPECT_EQ(w.sum(), (Table{{0, 7, 0}, {0, 0, 4}}));
  // At 3.5 s the first bucket (started at 0) has left the 2-s window, the second (1 s) too.
  report(w, t0 + milliseconds(3500), 0, 0, 1);
  EXPECT_EQ(w.sum(), (Table{{1, 0, 0}, {0, 0, 0}}));
  // Rows of a layer or expert outside the table are not counted.
  w.add(2, 0, 9);
  w.add(0, 3, 9);
  w.add(-1, 0, 9);
  EXPECT_EQ(w.sum(), (Table{{1, 0, 0}, {0, 0, 0}}));
}

// Reports without rows (an idle group) still move the window: old load leaves it.
TEST(LoadWindowTest, TheWindowSlidesWithoutRows) {
  LoadWindow w(1, 2, /*window_s=*/2.0, /*smoothing=*/0);
  const auto t0 = LoadWindow::Clock::time_point() + std::chrono::hours(1);
  report(w, t0, 0, 1, 5);
  w.at(t0 + milliseconds(1500));
  EXPECT_EQ(w.sum(), (Table{{0, 5}}));
  w.at(t0 + milliseconds(2500));
  EXPECT_EQ(w.sum(), (Table{{0, 0}}));
}

TEST(LoadWindowTest, WithoutSmoothingThePlannedLoadIsTheWindow) {
  LoadWindow w(1, 2, 30.0, 0);
  report(w, LoadWindow::Clock::now(), 0, 0, 3);
  EXPECT_EQ(w.smoothed(), w.sum());
  EXPECT_EQ(w.advance(), w.sum());
  EXPECT_TRUE(w.shares().empty());
}

// The kept shares move only with advance(): smoothed() plans on them without changing them,
// and both equal smooth_load applied to the window with the shares kept so far.
TEST(LoadWindowTest, OnlyARebalanceAdvancesTheSmoothing) {
  const double weight = 0.5;
  LoadWindow w(1, 2, 30.0, weight);
  const auto t0 = LoadWindow::Clock::now();
  report(w, t0, 0, 0, 30);
  report(w, t0, 0, 1, 10);
  Table first = w.sum();
  const Table kept = smooth_load({}, weight, first);  // `first` becomes the smoothed load.
  EXPECT_EQ(w.advance(), first);
  EXPECT_EQ(w.shares(), kept);
  // The load moves to expert 1: the planned load keeps part of the old shares.
  report(w, t0 + milliseconds(1500), 0, 1, 60);
  Table expect = w.sum();
  const Table next = smooth_load(kept, weight, expect);
  const Table planned = w.smoothed();
  EXPECT_EQ(planned, expect);
  EXPECT_LT(planned[0][1], w.sum()[0][1]);  // Not the window alone.
  EXPECT_EQ(w.shares(), kept);              // Unchanged by smoothed().
  EXPECT_EQ(w.smoothed(), planned);
  EXPECT_EQ(w.advance(), planned);
  EXPECT_EQ(w.shares(), next);
}

}  // namespace
}  // namespace flexpert::eplb
