// SPDX-License-Identifier: Apache-2.0
// The expert load the serving path plans on (docs/ARCHITECTURE.md, "Expert load balancing"):
// rows per (layer, logical expert) in buckets of one second over a sliding window, and the
// shares that --eplb-smoothing keeps across rebalances (smooth_load, planner.h). Not
// thread-safe: its owner (the cluster front end) holds its lock around every call.
#pragma once

#include <chrono>
#include <deque>
#include <vector>

namespace flexpert::eplb {

class LoadWindow {
 public:
  using Clock = std::chrono::steady_clock;
  using Table = std::vector<std::vector<double>>;  // [layer][logical expert]

  // A window of `window_s` seconds; `smoothing` in [0, 1) the weight of the kept shares (0:
  // none). Tables are layers x experts.
  LoadWindow(int layers, int experts, double window_s, double smoothing);

  // Moves the window to `now` (each report of the ranks, rows or none): a new bucket when
  // the last is a second old or there is none, and the buckets that left the window dropped.
  void at(Clock::time_point now);
  // Adds `rows` of `expert` in `layer` to the current bucket (none before the first at();
  // rows outside the table are not counted).
  void add(int layer, int expert, double rows);

  // Rows per expert over the window (zeros when empty).
  Table sum() const;
  // The load the next plan uses: sum() smoothed with the kept shares, which only advance()
  // moves; sum() alone without smoothing. Membership changes plan on it, so that one noisy
  // window does not place their experts.
  Table smoothed() const;
  // A rebalance's load: sum() smoothed, and the kept shares advanced to it.
  Table advance();
  // The kept shares ([layer][expert]; empty before the first advance or without smoothing).
  const Table& shares() const { return shares_; }

 private:
  struct Bucket {
    Clock::time_point start;
    Table rows;
  };
  int layers_, experts_;
  Clock::duration window_;
  double smoothing_;
  std::deque<Bucket> buckets_;
  Table shares_;
};

}  // namespace flexpert::eplb
