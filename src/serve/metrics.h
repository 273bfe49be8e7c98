// SPDX-License-Identifier: Apache-2.0
// A small metrics registry: counters, gauges and fixed-bucket histograms with
// labels, rendered in the Prometheus text exposition format (version 0.0.4).
//
// A metric is created once per (name, labels) through the Registry, which owns it:
// the returned reference stays valid for the Registry's lifetime, so hot paths
// keep it and update it without a lookup. Updates are lock-free atomics; creation
// and render() take the registry's mutex. Everything here is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/mutex.h"

namespace flexpert::metrics {

// Label name/value pairs, rendered in the order given.
using Labels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void inc(double amount = 1.0) { value_.fetch_add(amount, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void set(double value) { value_.store(value, std::memory_order_relaxed); }
  void add(double amount) { value_.fetch_add(amount, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // Upper bounds, strictly increasing; a +Inf bucket is implicit.
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);  // NaN is dropped.

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // One per bound, then +Inf (== count).
    double sum = 0.0;
    uint64_t count = 0;
  };
  // NOTE: taken bucket by bucket while others may observe; `count` is derived from
  // the buckets so that the rendered histogram is always self-consistent.
  Snapshot snapshot() const;
  const std::vector<double>& upper_bounds() const { return bounds_; }

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // Per bucket (not cumulative).
  std::atomic<double> sum_{0.0};
};

// 1 ms .. 60 s, for request latencies.
std::vector<double> latency_buckets_seconds();

class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Returns the metric of `name` with `labels`, creating it (and its family, with
  // `help`) on first use. Reusing a name with another type or buckets is a bug.
  Counter& counter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge& gauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram& histogram(const std::string& name, const std::string& help,
                       const std::vector<double>& upper_bounds, const Labels& labels = {});

  // Every family in creation order, each with its # HELP and # TYPE lines.
  std::string render() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    std::string name;
    std::string help;
    Type type;
    std::vector<double> bounds;  // Histograms only.
    // Keyed by the rendered label set, so a render is sorted and stable.
    std::map<std::string, std::unique_ptr<Counter>> counters;
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::unique_ptr<Histogram>> histograms;
  };
  Family& family(const std::string& name, const std::string& help, Type type,
                 const std::vector<double>& bounds) REQUIRES(mu_);

  mutable Mutex mu_;
  std::vector<std::unique_ptr<Family>> families_ GUARDED_BY(mu_);
};

// Prometheus sample value: integers without a fraction, "+Inf", "NaN".
std::string format_value(double value);
// `{a="x",b="y"}` with values escaped; "" for no labels.
std::string format_labels(const Labels& labels);

}  // namespace flexpert::metrics
