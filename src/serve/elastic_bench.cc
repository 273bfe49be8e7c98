// SPDX-License-Identifier: Apache-2.0
#include "serve/elastic_bench.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

namespace flexpert {
namespace {

using Clock = std::chrono::steady_clock;

// An event's token gaps are those within this long after it (or until it ended, if later).
constexpr double kEventWindowS = 3.0;

double seconds(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

// One token gap of one request: (previous token time, this token time), seconds.
struct Gap {
  double from = 0, to = 0;
};

struct Totals {
  std::mutex mu;
  std::vector<Gap> gaps;
  std::vector<double> token_times;
  std::vector<double> failure_times, rejection_times;
  int completed = 0, failed = 0, rejected = 0, mismatched = 0;
  std::vector<std::string> errors;  // The first few, for the report.
};

// HH:MM:SS.mmm (local time, as the log lines) of `s` seconds after `wall_t0`.
std::string wall_clock(std::chrono::system_clock::time_point wall_t0, double s) {
  const auto t = wall_t0 + std::chrono::duration_cast<std::chrono::system_clock::duration>(
                               std::chrono::duration<double>(s));
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  localtime_r(&secs, &tm);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03d", tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(ms % 1000));
  return buf;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Runs one request to completion; records its token times. False: rejected (not admitted).
bool run_request(ClusterEngine& engine, const ElasticRunOptions& o, size_t p, Clock::time_point t0,
                 Totals* totals) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::vector<int32_t> tokens;
    std::vector<double> times;
    std::string reason;
    Status error;
  };
  auto st = std::make_shared<State>();
  CompletionRequest req;
  req.prompt = o.prompts[p];
  req.params.max_tokens = o.max_tokens;
  req.params.ignore_eos = true;
  auto id = engine.submit(std::move(req), [st, t0](const CompletionEvent& ev) {
    std::lock_guard<std::mutex> lock(st->mu);
    const double t = seconds(t0, Clock::now());
    for (int32_t tok : ev.tokens) {
      st->tokens.push_back(tok);
      st->times.push_back(t);
    }
    if (ev.finished) {
      st->done = true;
      st->reason = ev.finish_reason;
      st->error = ev.error;
      st->cv.notify_all();
    }
  });
  if (!id.ok()) {
    std::lock_guard<std::mutex> lock(totals->mu);
    totals->rejected += 1;
    totals->rejection_times.push_back(seconds(t0, Clock::now()));
    if (totals->errors.size() < 5) totals->errors.push_back(id.status().to_string());
    return false;
  }
  std::unique_lock<std::mutex> lock(st->mu);
  const bool finished = st->cv.wait_for(lock, std::chrono::seconds(120), [&] { return st->done; });
  if (!finished) engine.cancel(id.value());
  std::lock_guard<std::mutex> tl(totals->mu);
  for (size_t i = 0; i < st->times.size(); ++i) {
    totals->token_times.push_back(st->times[i]);
    if (i > 0) totals->gaps.push_back({st->times[i - 1], st->times[i]});
  }
  if (!finished || st->reason == "error" || st->reason == "abort") {
    totals->failed += 1;
    totals->failure_times.push_back(seconds(t0, Clock::now()));
    if (totals->errors.size() < 5) {
      totals->errors.push_back(finished ? st->error.to_string() : "no answer in 120 s");
    }
    return true;
  }
  totals->completed += 1;
  if (!o.expected.empty()) {
    const auto& want = o.expected[p];
    const size_t n = std::min(want.size(), st->tokens.size());
    if (st->tokens.size() != static_cast<size_t>(o.max_tokens) ||
        !std::equal(st->tokens.begin(), st->tokens.begin() + n, want.begin())) {
      totals->mismatched += 1;
    }
  }
  return true;
}

int pid_of_rank(const nlohmann::json& status, int rank) {
  for (const auto& r : status["ranks"]) {
    if (r["rank"] == rank && r["state"] == "serving") return r["pid"];
  }
  return 0;
}

}  // namespace

std::string ElasticEvent::label() const {
  return kind == "scale" ? "scale to " + std::to_string(ranks)
                         : "kill rank " + std::to_string(rank);
}

Result<std::vector<ElasticEvent>> parse_elastic_events(const std::string& spec) {
  std::vector<ElasticEvent> out;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    ElasticEvent ev;
    char kind[16] = {0};
    int n = 0;
    if (std::sscanf(item.c_str(), "%lf:%15[a-z]:%d", &ev.at_s, kind, &n) != 3 || ev.at_s < 0 ||
        n < 0 || (std::string(kind) != "scale" && std::string(kind) != "kill")) {
      return invalid_argument("bad event '" + item +
                              "' (want SECONDS:scale:RANKS or SECONDS:kill:RANK)");
    }
    ev.kind = kind;
    (ev.kind == "scale" ? ev.ranks : ev.rank) = n;
    if (!out.empty() && ev.at_s < out.back().at_s) {
      return invalid_argument("events must be in time order");
    }
    out.push_back(ev);
  }
  return out;
}

Result<nlohmann::json> run_elastic(const ElasticRunOptions& o) {
  if (o.prompts.empty()) return invalid_argument("no prompts");
  auto log = [&](const std::string& line) {
    if (o.log) o.log(line);
  };
  log("starting " + std::to_string(o.cluster.ranks) + " ranks (" + o.cluster.reconfigure + ")");
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<ClusterEngine> engine, ClusterEngine::start(o.cluster));
  const auto t0 = Clock::now();
  const auto wall_t0 = std::chrono::system_clock::now();  // To place gaps in the workers' logs.
  const auto end =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration_s));
  Totals totals;
  std::atomic<size_t> next_prompt{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < o.concurrency; ++c) {
    clients.emplace_back([&] {
      while (Clock::now() < end) {
        const size_t p = next_prompt++ % o.prompts.size();
        if (!run_request(*engine, o, p, t0, &totals)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));  // A client's back-off.
        }
      }
    });
  }
  nlohmann::json events = nlohmann::json::array();
  for (const ElasticEvent& ev : o.events) {
    std::this_thread::sleep_until(
        t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(ev.at_s)));
    const double at = seconds(t0, Clock::now());
    nlohmann::json rec = {{"label", ev.label()}, {"at_s", at}};
    log(std::to_string(at).substr(0, 5) + " s: " + ev.label());
    if (ev.kind == "scale") {
      ScaleTarget target;
      target.ranks = ev.ranks;
      auto report = engine->scale(target);
      rec["end_s"] = seconds(t0, Clock::now());
      if (report.ok()) {
        rec["status"] = "ok";
        for (const char* key : {"prepare_s", "commit_s", "total_s", "load_s", "copy_s"}) {
          if (report->contains(key)) rec[key] = (*report)[key];
        }
      } else {
        rec["status"] = report.status().to_string();
      }
    } else {
      const nlohmann::json status = engine->status();
      const uint64_t epoch = status["epoch"];
      const int pid = pid_of_rank(status, ev.rank);
      if (pid <= 0) {
        rec["status"] = "rank " + std::to_string(ev.rank) + " is not serving";
        rec["end_s"] = at;
      } else {
        const size_t size = status["members"].size();
        kill(pid, SIGKILL);
        // Recovered: a later epoch that serves (in place, or with a replacement rank);
        // healed: back to the size before the kill (the healer's scale-up, if needed).
        const auto deadline = Clock::now() + std::chrono::seconds(60);
        nlohmann::json now;
        bool recovered = false;
        while (Clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          now = engine->status();
          if (!recovered && now["epoch"].get<uint64_t>() > epoch && now["phase"] == "serving") {
            recovered = true;
            rec["recovered_s"] = seconds(t0, Clock::now());
          }
          if (recovered && now["members"].size() == size &&
              !now["reconfiguration"]["in_progress"].get<bool>()) {
            break;
          }
        }
        rec["end_s"] = seconds(t0, Clock::now());
        rec["status"] = !recovered                      ? "not recovered"
                        : now["members"].size() == size ? "ok"
                                                        : "recovered, not healed";
        rec["recovery"] = now["reconfiguration"]["last_recovery"];
        const nlohmann::json& replaced = rec["recovery"].contains("replacements")
                                             ? rec["recovery"]["replacements"]
                                             : nlohmann::json::array();
        rec["recovery_kind"] = replaced.empty() ? "in place, then healed" : "replacement";
      }
    }
    log("  " + rec.dump());
    events.push_back(rec);
  }
  for (auto& t : clients) t.join();
  const nlohmann::json final_status = engine->status();
  (void)engine->shutdown();
  engine.reset();

  // Timeline in 250 ms bins; steady state = bins away from every event.
  const double bin = 0.25;
  const int num_bins = static_cast<int>(o.duration_s / bin) + 1;
  std::vector<double> tokens(num_bins, 0), max_gap(num_bins, 0);
  for (double t : totals.token_times) {
    const int b = static_cast<int>(t / bin);
    if (b >= 0 && b < num_bins) tokens[b] += 1;
  }
  for (const Gap& g : totals.gaps) {
    const int b = static_cast<int>(g.to / bin);
    if (b >= 0 && b < num_bins) max_gap[b] = std::max(max_gap[b], (g.to - g.from) * 1e3);
  }
  auto near_event = [&](double from, double to) {
    for (const auto& e : events) {
      if (to >= e["at_s"].get<double>() - 0.25 && from <= e["end_s"].get<double>() + 1.0) {
        return true;
      }
    }
    return false;
  };
  std::vector<double> steady_gaps, steady_rates;
  for (int b = 2; b + 1 < num_bins; ++b) {  // Skip ramp-up and the tail.
    if (near_event(b * bin, (b + 1) * bin)) continue;
    steady_gaps.push_back(max_gap[b]);
    steady_rates.push_back(tokens[b] / bin);
  }
  const double steady_gap = median(steady_gaps);
  // Service gap: the longest time without any token from the whole group.
  std::vector<double> all_tokens = totals.token_times;
  std::sort(all_tokens.begin(), all_tokens.end());
  for (size_t i = 0; i < events.size(); ++i) {
    nlohmann::json& e = events[i];
    // From the event to 3 s after it or its end, whichever is later (what follows a commit,
    // a leaver's disconnect, counts too), but not into the next event.
    const double from = e["at_s"];
    double to = std::max(e["end_s"].get<double>(), from + kEventWindowS);
    if (i + 1 < events.size()) to = std::min(to, events[i + 1]["at_s"].get<double>());
    to = std::max(to, e["end_s"].get<double>());
    e["window_end_s"] = to;
    double worst = 0, service_gap = 0;
    std::vector<Gap> near;
    for (const Gap& g : totals.gaps) {
      if (g.to >= from && g.from <= to) {
        worst = std::max(worst, (g.to - g.from) * 1e3);
        near.push_back(g);
      }
    }
    // The longest few, at the log's clock (a stall's place in the workers' logs).
    std::sort(near.begin(), near.end(),
              [](const Gap& a, const Gap& b) { return a.to - a.from > b.to - b.from; });
    e["longest_gaps"] = nlohmann::json::array();
    for (size_t i = 0; i < near.size() && i < 3; ++i) {
      e["longest_gaps"].push_back({{"ms", (near[i].to - near[i].from) * 1e3},
                                   {"from", wall_clock(wall_t0, near[i].from)},
                                   {"to", wall_clock(wall_t0, near[i].to)}});
    }
    for (size_t i = 1; i < all_tokens.size(); ++i) {
      if (all_tokens[i] >= from && all_tokens[i - 1] <= to) {
        service_gap = std::max(service_gap, (all_tokens[i] - all_tokens[i - 1]) * 1e3);
      }
    }
    e["service_gap_ms"] = service_gap;
    int failed = 0;
    int rejected = 0;
    for (double t : totals.failure_times) failed += t >= from && t <= to + 1.0;
    for (double t : totals.rejection_times) rejected += t >= from && t <= to + 1.0;
    e["rejected_requests"] = rejected;
    e["max_gap_ms"] = worst;
    e["stall_ms"] = std::max(0.0, worst - steady_gap);
    e["failed_requests"] = failed;
  }
  nlohmann::json timeline = {{"bin_s", bin},
                             {"t", nlohmann::json::array()},
                             {"tokens_per_s", nlohmann::json::array()},
                             {"max_gap_ms", nlohmann::json::array()}};
  for (int b = 0; b < num_bins; ++b) {
    timeline["t"].push_back(b * bin);
    timeline["tokens_per_s"].push_back(tokens[b] / bin);
    timeline["max_gap_ms"].push_back(max_gap[b]);
  }
  return nlohmann::json{
      {"mode", o.cluster.reconfigure},
      {"duration_s", o.duration_s},
      {"concurrency", o.concurrency},
      {"max_tokens", o.max_tokens},
      {"start_ranks", o.cluster.ranks},
      {"max_ranks", o.cluster.max_ranks},
      {"requests",
       {{"completed", totals.completed},
        {"failed", totals.failed},
        {"rejected", totals.rejected},
        {"mismatched", totals.mismatched},
        {"checked", !o.expected.empty()},
        {"first_errors", totals.errors}}},
      {"steady", {{"tokens_per_s", median(steady_rates)}, {"max_gap_ms", steady_gap}}},
      {"events", events},
      {"final_members", final_status["members"]},
      {"timeline", timeline}};
}

namespace {

const char kPlotScript[] = R"PY(
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
reports = json.load(open(sys.argv[1]))
fig, axes = plt.subplots(2 * len(reports), 1, figsize=(11, 3.2 * 2 * len(reports)), sharex=True)
for i, r in enumerate(reports):
    tl = r["timeline"]
    a, b = axes[2 * i], axes[2 * i + 1]
    a.plot(tl["t"], tl["tokens_per_s"], color="tab:blue")
    a.set_ylabel("tokens/s")
    req = r["requests"]
    a.set_title("%s: %d completed, %d failed, %d rejected, %d mismatched" % (
        r["mode"], req["completed"], req["failed"], req["rejected"], req["mismatched"]))
    b.plot(tl["t"], tl["max_gap_ms"], color="tab:red")
    b.set_ylabel("longest inter-token gap (ms)")
    b.set_yscale("log")
    for ax in (a, b):
        for e in r["events"]:
            ax.axvspan(e["at_s"], max(e["end_s"], e["at_s"] + 0.02), color="orange", alpha=0.3)
    for e in r["events"]:
        a.annotate("%s\nstall %.0f ms\nno tokens %.0f ms" % (
                       e["label"], e["stall_ms"], e["service_gap_ms"]), (e["at_s"], 0),
                   xycoords=("data", "axes fraction"), fontsize=8, va="bottom")
axes[-1].set_xlabel("seconds")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=100)
)PY";

}  // namespace

Status plot_elastic(const std::vector<nlohmann::json>& reports, const std::string& png_path) {
  char dir[] = "/tmp/flexpert-plot-XXXXXX";
  if (mkdtemp(dir) == nullptr) return unavailable("mkdtemp failed");
  const std::string script = std::string(dir) + "/plot.py", data = std::string(dir) + "/data.json";
  std::ofstream(script) << kPlotScript;
  std::ofstream(data) << nlohmann::json(reports).dump();
  // Debian's interpreter first: its python3-matplotlib is what scripts/setup.sh installs
  // (a python3 earlier on PATH, e.g. pyenv's, may lack it).
  const std::string python = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
  const std::string cmd =
      python + " " + script + " " + data + " '" + png_path + "' 2>" + std::string(dir) + "/err";
  const int rc = std::system(cmd.c_str());
  std::ifstream err_in(std::string(dir) + "/err");
  std::string err((std::istreambuf_iterator<char>(err_in)), std::istreambuf_iterator<char>());
  std::remove(script.c_str());
  std::remove(data.c_str());
  std::remove((std::string(dir) + "/err").c_str());
  rmdir(dir);
  if (rc != 0) {
    return unavailable("no plot (needs python3 with matplotlib: scripts/setup.sh installs it): " +
                       err.substr(err.size() > 300 ? err.size() - 300 : 0));
  }
  return Status();
}

}  // namespace flexpert
