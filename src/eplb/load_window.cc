// SPDX-License-Identifier: Apache-2.0
#include "eplb/load_window.h"

#include "eplb/planner.h"

namespace flexpert::eplb {
namespace {

constexpr auto kBucket = std::chrono::seconds(1);

}  // namespace

LoadWindow::LoadWindow(int layers, int experts, double window_s, double smoothing)
    : layers_(layers),
      experts_(experts),
      window_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(window_s))),
      smoothing_(smoothing) {}

void LoadWindow::at(Clock::time_point now) {
  if (!buckets_.empty() && now - buckets_.back().start < kBucket) return;
  buckets_.push_back(Bucket{now, Table(layers_, std::vector<double>(experts_, 0))});
  while (now - buckets_.front().start > window_) buckets_.pop_front();
}

void LoadWindow::add(int layer, int expert, double rows) {
  if (buckets_.empty() || layer < 0 || layer >= layers_ || expert < 0 || expert >= experts_) {
    return;
  }
  buckets_.back().rows[layer][expert] += rows;
}

LoadWindow::Table LoadWindow::sum() const {
  Table total(layers_, std::vector<double>(experts_, 0));
  for (const Bucket& b : buckets_) {
    for (int l = 0; l < layers_; ++l) {
      for (int e = 0; e < experts_; ++e) total[l][e] += b.rows[l][e];
    }
  }
  return total;
}

LoadWindow::Table LoadWindow::smoothed() const {
  Table load = sum();
  if (smoothing_ > 0) (void)smooth_load(shares_, smoothing_, load);
  return load;
}

LoadWindow::Table LoadWindow::advance() {
  Table load = sum();
  if (smoothing_ > 0) shares_ = smooth_load(shares_, smoothing_, load);
  return load;
}

}  // namespace flexpert::eplb
