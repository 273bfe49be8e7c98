// SPDX-License-Identifier: Apache-2.0
// Launcher: how the front end gets a worker for a rank id (docs/ARCHITECTURE.md, "Front end").
// The start, scale, heal and replacement paths ask it for the worker of a rank; the worker
// then joins the control socket with a hello like any other. Two implementations:
//   - ForkLauncher: starts `flexpert worker --join ... --rank R` itself (posix_spawn) and
//     owns the process: it signals and reaps it.
//   - ExternalLauncher: starts no worker. With a launch command it runs that command (an
//     orchestrator's) with FLEXPERT_RANK and FLEXPERT_JOIN in its environment; a non-zero
//     exit is a failed launch. Without one it prints the line to start the worker by hand.
// Thread safety: none; the front end calls it from its control thread with its lock held
// (a forked worker dies with the thread that forked it: cluster_engine_impl.h).
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flexpert/status.h"

namespace flexpert {

struct LaunchConfig {
  std::string endpoint;     // The control socket, tcp://HOST:PORT.
  std::string binary;       // The worker executable (ForkLauncher).
  std::string cluster_key;  // Through the environment, never argv (/proc/PID/cmdline).
  int threads = 1;          // FLEXPERT_THREADS of the worker.
  std::string command;      // ExternalLauncher: the orchestrator's command ("": print).
};

// A launch the orchestrator refused: its command exited non-zero (or was killed).
struct FailedLaunch {
  int rank = 0;
  uint64_t incarnation = 0;  // As given to launch().
  std::string why;
};

class Launcher {
 public:
  virtual ~Launcher() = default;
  // Whether launch() gets a worker without anyone's help (fork, or an orchestrator command):
  // only then do recoveries retry with replacements and the healer restore the size.
  virtual bool starts_workers() const = 0;
  // Whether launch() returns the worker's own process, this launcher's to signal and reap.
  virtual bool owns_workers() const = 0;
  // Gets a worker for incarnation `incarnation` of `rank`: its pid where owns_workers(),
  // else 0. An error: nothing was started.
  virtual Result<pid_t> launch(int rank, uint64_t incarnation) = 0;
  // Launches that failed since the last call (their ranks are still starting).
  virtual std::vector<FailedLaunch> poll_failed() { return {}; }
  // An owned worker's exit, without waiting: nullopt while it runs, else how it ended ("" when
  // it was reaped already, by an earlier call).
  virtual std::optional<std::string> reap(pid_t /*pid*/) { return ""; }
  // Kills an owned worker (reap() then sees it end).
  virtual void kill_worker(pid_t /*pid*/) {}
  // Stops what it started that still runs (launch commands); shutdown.
  virtual void stop_all() {}
};

class ForkLauncher : public Launcher {
 public:
  explicit ForkLauncher(LaunchConfig config) : config_(std::move(config)) {}
  bool starts_workers() const override { return true; }
  bool owns_workers() const override { return true; }
  Result<pid_t> launch(int rank, uint64_t incarnation) override;
  std::optional<std::string> reap(pid_t pid) override;
  void kill_worker(pid_t pid) override;

 private:
  LaunchConfig config_;
};

class ExternalLauncher : public Launcher {
 public:
  explicit ExternalLauncher(LaunchConfig config) : config_(std::move(config)) {}
  ~ExternalLauncher() override { stop_all(); }
  bool starts_workers() const override { return !config_.command.empty(); }
  bool owns_workers() const override { return false; }
  Result<pid_t> launch(int rank, uint64_t incarnation) override;
  std::vector<FailedLaunch> poll_failed() override;
  void stop_all() override;

 private:
  LaunchConfig config_;
  std::map<pid_t, std::pair<int, uint64_t>> commands_;  // Running: pid -> (rank, incarnation).
};

// ForkLauncher, or with `external` an ExternalLauncher.
std::unique_ptr<Launcher> make_launcher(bool external, LaunchConfig config);

// The worker's environment: ours, with FLEXPERT_THREADS, FLEXPERT_CLUSTER_KEY and `extra`
// (NAME=VALUE) set. Exposed for tests.
std::vector<std::string> launch_environment(const LaunchConfig& config,
                                            const std::vector<std::string>& extra);

}  // namespace flexpert
