// SPDX-License-Identifier: Apache-2.0
#include "serve/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "flexpert/logging.h"

namespace flexpert::metrics {
namespace {

// Exposition format escaping: label values escape \ " and newline; HELP text only \ and newline.
std::string escape(const std::string& s, bool quote) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quote) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

// Label set `inner` ("a=\"x\"") plus one more label, braces included.
std::string with_label(const std::string& inner, const std::string& name,
                       const std::string& value) {
  std::string out = "{" + inner;
  if (!inner.empty()) out += ",";
  return out + name + "=\"" + value + "\"}";
}

std::string braces(const std::string& inner) { return inner.empty() ? "" : "{" + inner + "}"; }

// The label set without braces: the key families are stored under.
std::string label_key(const Labels& labels) {
  const std::string s = format_labels(labels);
  return s.empty() ? s : s.substr(1, s.size() - 2);
}

}  // namespace

std::string format_value(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // Counters of tokens and requests read better without "e+06"; doubles hold them exactly.
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    return std::to_string(static_cast<int64_t>(value));
  }
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), value);  // Shortest round-trip form.
  return std::string(buf, res.ptr);
}

std::string format_labels(const Labels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i > 0) out += ",";
    out += labels[i].first + "=\"" + escape(labels[i].second, true) + "\"";
  }
  return out + "}";
}

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  FLEX_CHECK(std::is_sorted(bounds_.begin(), bounds_.end()) &&
             std::adjacent_find(bounds_.begin(), bounds_.end()) == bounds_.end())
      << "histogram bounds must increase strictly";
  counts_ = std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1);
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::observe(double value) {
  if (std::isnan(value)) return;
  // Bucket `le` holds value <= bound: the first bound not below the value.
  const size_t idx = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  counts_[idx].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot snap;
  uint64_t acc = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    acc += counts_[i].load(std::memory_order_relaxed);
    snap.cumulative.push_back(acc);
  }
  snap.count = acc;
  snap.sum = sum_.load(std::memory_order_relaxed);
  return snap;
}

std::vector<double> latency_buckets_seconds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

Registry::Family& Registry::family(const std::string& name, const std::string& help, Type type,
                                   const std::vector<double>& bounds) {
  for (auto& f : families_) {
    if (f->name != name) continue;
    FLEX_CHECK(f->type == type && f->bounds == bounds)
        << "metric " << name << " registered twice with different types or buckets";
    return *f;
  }
  families_.push_back(std::make_unique<Family>(Family{name, help, type, bounds, {}, {}, {}}));
  return *families_.back();
}

Counter& Registry::counter(const std::string& name, const std::string& help, const Labels& labels) {
  MutexLock lock(mu_);
  auto& slot = family(name, help, Type::kCounter, {}).counters[label_key(labels)];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& Registry::gauge(const std::string& name, const std::string& help, const Labels& labels) {
  MutexLock lock(mu_);
  auto& slot = family(name, help, Type::kGauge, {}).gauges[label_key(labels)];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& Registry::histogram(const std::string& name, const std::string& help,
                               const std::vector<double>& upper_bounds, const Labels& labels) {
  MutexLock lock(mu_);
  auto& slot = family(name, help, Type::kHistogram, upper_bounds).histograms[label_key(labels)];
  if (!slot) slot = std::make_unique<Histogram>(upper_bounds);
  return *slot;
}

std::string Registry::render() const {
  MutexLock lock(mu_);
  std::string out;
  for (const auto& f : families_) {
    static const char* kTypeNames[] = {"counter", "gauge", "histogram"};
    out += "# HELP " + f->name + " " + escape(f->help, false) + "\n";
    out += "# TYPE " + f->name + " " + kTypeNames[static_cast<int>(f->type)] + "\n";
    for (const auto& [key, c] : f->counters) {
      out += f->name + braces(key) + " " + format_value(c->value()) + "\n";
    }
    for (const auto& [key, g] : f->gauges) {
      out += f->name + braces(key) + " " + format_value(g->value()) + "\n";
    }
    for (const auto& [key, h] : f->histograms) {
      const Histogram::Snapshot snap = h->snapshot();
      for (size_t i = 0; i <= f->bounds.size(); ++i) {
        const std::string le = i < f->bounds.size() ? format_value(f->bounds[i]) : "+Inf";
        out += f->name + "_bucket" + with_label(key, "le", le) + " " +
               std::to_string(snap.cumulative[i]) + "\n";
      }
      out += f->name + "_sum" + braces(key) + " " + format_value(snap.sum) + "\n";
      out += f->name + "_count" + braces(key) + " " + std::to_string(snap.count) + "\n";
    }
  }
  return out;
}

}  // namespace flexpert::metrics
