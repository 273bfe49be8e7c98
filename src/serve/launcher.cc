// SPDX-License-Identifier: Apache-2.0
#include "serve/launcher.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "flexpert/logging.h"

namespace flexpert {
namespace {

// Starts `argv` with `env` in a process group of its own (terminal signals go to the front
// end, which stops the group in order) and no blocked signals (the front end blocks its stop
// signals for sigwait()). posix_spawn (a vfork, not a fork): the front end calls this with
// its lock held, where fork, which copies its page tables first, took 1.1-1.6 ms per rank on
// the dev VM (a gap in every stream at a scale-up; posix_spawn 0.13-0.37 ms).
Result<pid_t> spawn_process(std::vector<std::string> args, std::vector<std::string> env,
                            const std::string& what) {
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawnattr_t attr;
  if (posix_spawnattr_init(&attr) != 0) return unavailable("posix_spawnattr_init failed");
  sigset_t none;
  sigemptyset(&none);
  int err = posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK);
  if (err == 0) err = posix_spawnattr_setpgroup(&attr, 0);
  if (err == 0) err = posix_spawnattr_setsigmask(&attr, &none);
  pid_t pid = -1;
  if (err == 0) err = posix_spawn(&pid, argv[0], nullptr, &attr, argv.data(), envp.data());
  posix_spawnattr_destroy(&attr);
  if (err != 0) return unavailable("cannot start " + what + ": " + std::strerror(err));
  return pid;
}

std::string exit_reason(int wstatus) {
  return WIFSIGNALED(wstatus) ? "killed by signal " + std::to_string(WTERMSIG(wstatus))
                              : "exited with code " + std::to_string(WEXITSTATUS(wstatus));
}

}  // namespace

std::vector<std::string> launch_environment(const LaunchConfig& config,
                                            const std::vector<std::string>& extra) {
  auto overridden = [&](const std::string& e) {
    if (e.rfind("FLEXPERT_THREADS=", 0) == 0 || e.rfind("FLEXPERT_CLUSTER_KEY=", 0) == 0) {
      return true;
    }
    for (const std::string& x : extra) {
      if (e.compare(0, x.find('=') + 1, x, 0, x.find('=') + 1) == 0) return true;
    }
    return false;
  };
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!overridden(*e)) env.emplace_back(*e);
  }
  env.push_back("FLEXPERT_THREADS=" + std::to_string(config.threads));
  if (!config.cluster_key.empty()) env.push_back("FLEXPERT_CLUSTER_KEY=" + config.cluster_key);
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

Result<pid_t> ForkLauncher::launch(int rank, uint64_t /*incarnation*/) {
  const std::string rank_str = std::to_string(rank);
  // FLEXPERT_PARENT_PID: the worker dies with this process (PR_SET_PDEATHSIG, engine/worker.cc),
  // which only a worker we started wants.
  return spawn_process(
      {config_.binary, "worker", "--join", config_.endpoint, "--rank", rank_str},
      launch_environment(config_, {"FLEXPERT_PARENT_PID=" + std::to_string(getpid())}),
      "rank " + rank_str + " (" + config_.binary + ")");
}

std::optional<std::string> ForkLauncher::reap(pid_t pid) {
  int wstatus = 0;
  const pid_t got = pid > 0 ? waitpid(pid, &wstatus, WNOHANG) : -1;
  if (got == 0) return std::nullopt;
  return got == pid ? exit_reason(wstatus) : "";
}

void ForkLauncher::kill_worker(pid_t pid) {
  if (pid > 0) kill(pid, SIGKILL);
}

Result<pid_t> ExternalLauncher::launch(int rank, uint64_t incarnation) {
  const std::string join = config_.endpoint.substr(config_.endpoint.find("://") + 3);
  if (config_.command.empty()) {
    std::printf("waiting for 1 worker: flexpert worker --join %s --rank %d\n", join.c_str(), rank);
    std::fflush(stdout);
    return pid_t{0};
  }
  // The command's output goes to the front end's stderr (its log), not to stdout, which
  // says where the server listens.
  std::vector<std::string> args = {"/bin/sh", "-c", "exec 1>&2; " + config_.command};
  FLEX_ASSIGN_OR_RETURN(
      const pid_t pid,
      spawn_process(std::move(args),
                    launch_environment(config_, {"FLEXPERT_RANK=" + std::to_string(rank),
                                                 "FLEXPERT_JOIN=" + join}),
                    "the launch command for rank " + std::to_string(rank)));
  commands_[pid] = {rank, incarnation};
  FLEX_LOG(INFO) << "launch command for rank " << rank << " started (pid " << pid << ")";
  return pid_t{0};  // The worker is the orchestrator's, not ours.
}

std::vector<FailedLaunch> ExternalLauncher::poll_failed() {
  std::vector<FailedLaunch> failed;
  for (auto it = commands_.begin(); it != commands_.end();) {
    int wstatus = 0;
    if (waitpid(it->first, &wstatus, WNOHANG) != it->first) {
      ++it;
      continue;
    }
    const auto [rank, incarnation] = it->second;
    if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) {
      FLEX_LOG(INFO) << "launch command for rank " << rank << " done";
    } else {
      const std::string why = "launch command " + exit_reason(wstatus);
      FLEX_LOG(WARN) << "rank " << rank << ": " << why;
      failed.push_back({rank, incarnation, why});
    }
    it = commands_.erase(it);
  }
  return failed;
}

void ExternalLauncher::stop_all() {
  for (const auto& [pid, launched] : commands_) {
    kill(pid, SIGKILL);  // Not its group: a worker it started in the background shares it.
    waitpid(pid, nullptr, 0);
  }
  commands_.clear();
}

std::unique_ptr<Launcher> make_launcher(bool external, LaunchConfig config) {
  if (external) return std::make_unique<ExternalLauncher>(std::move(config));
  return std::make_unique<ForkLauncher>(std::move(config));
}

}  // namespace flexpert
