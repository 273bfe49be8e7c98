// SPDX-License-Identifier: Apache-2.0
// The metrics registry: Prometheus text rendering and concurrent updates.
#include "serve/metrics.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

namespace flexpert::metrics {
namespace {

TEST(MetricsTest, RendersCountersAndGaugesWithLabels) {
  Registry r;
  r.counter("req_total", "Requests.", {{"status", "ok"}}).inc();
  r.counter("req_total", "Requests.", {{"status", "ok"}}).inc(2);
  r.counter("req_total", "Requests.", {{"status", "error"}}).inc();
  r.gauge("in_flight", "In flight.").set(3);
  r.gauge("in_flight", "In flight.").add(-1.5);
  EXPECT_EQ(r.render(),
            "# HELP req_total Requests.\n"
            "# TYPE req_total counter\n"
            "req_total{status=\"error\"} 1\n"
            "req_total{status=\"ok\"} 3\n"
            "# HELP in_flight In flight.\n"
            "# TYPE in_flight gauge\n"
            "in_flight 1.5\n");
}

TEST(MetricsTest, RendersHistogramsCumulatively) {
  Registry r;
  Histogram& h = r.histogram("lat_seconds", "Latency.", {0.125, 1}, {{"rank", "0"}});
  h.observe(0.0625);
  h.observe(0.125);  // On a bound: counts in that bucket (le is inclusive).
  h.observe(0.5);
  h.observe(7);
  h.observe(std::nan(""));  // Dropped.
  EXPECT_EQ(r.render(),
            "# HELP lat_seconds Latency.\n"
            "# TYPE lat_seconds histogram\n"
            "lat_seconds_bucket{rank=\"0\",le=\"0.125\"} 2\n"
            "lat_seconds_bucket{rank=\"0\",le=\"1\"} 3\n"
            "lat_seconds_bucket{rank=\"0\",le=\"+Inf\"} 4\n"
            "lat_seconds_sum{rank=\"0\"} 7.6875\n"
            "lat_seconds_count{rank=\"0\"} 4\n");
}

TEST(MetricsTest, EscapesLabelValuesAndHelp) {
  Registry r;
  r.counter("x_total", "a\\b\nc", {{"path", "q\"\\\n"}}).inc();
  EXPECT_EQ(r.render(),
            "# HELP x_total a\\\\b\\nc\n"
            "# TYPE x_total counter\n"
            "x_total{path=\"q\\\"\\\\\\n\"} 1\n");
}

TEST(MetricsTest, FormatsValues) {
  EXPECT_EQ(format_value(0), "0");
  EXPECT_EQ(format_value(123456789), "123456789");
  EXPECT_EQ(format_value(0.25), "0.25");
  EXPECT_EQ(format_value(1e20), "1e+20");
  EXPECT_EQ(format_value(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(format_value(std::nan("")), "NaN");
  EXPECT_EQ(format_labels({}), "");
  EXPECT_EQ(format_labels({{"a", "1"}, {"b", "2"}}), "{a=\"1\",b=\"2\"}");
}

TEST(MetricsTest, LatencyBucketsSpan1msTo60s) {
  const std::vector<double> b = latency_buckets_seconds();
  EXPECT_EQ(b.front(), 0.001);
  EXPECT_EQ(b.back(), 60.0);
  EXPECT_TRUE(std::is_sorted(b.begin(), b.end()));
}

TEST(MetricsTest, ConcurrentUpdatesAreNotLost) {
  Registry r;
  Counter& c = r.counter("c_total", "C.");
  Histogram& h = r.histogram("h", "H.", {1.0});
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10000; ++i) {
        c.inc();
        h.observe(t % 2 == 0 ? 0.5 : 2.0);
        // Lookups race with updates and renders too.
        if (i % 1000 == 0) (void)r.counter("c_total", "C.", {{"t", std::to_string(t)}});
        if (i % 2500 == 0) (void)r.render();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(c.value(), 80000);
  const Histogram::Snapshot s = h.snapshot();
  EXPECT_EQ(s.count, 80000u);
  EXPECT_EQ(s.cumulative[0], 40000u);
  EXPECT_DOUBLE_EQ(s.sum, 40000 * 0.5 + 40000 * 2.0);
}

}  // namespace
}  // namespace flexpert::metrics
