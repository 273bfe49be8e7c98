// SPDX-License-Identifier: Apache-2.0
// ClusterEngine's internals, shared by cluster_engine.cc (membership, requests)
// and cluster_eplb.cc (load statistics, rebalancing). Not an API.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include <zmq.h>
#include "cluster/protocol.h"

#include "cluster/membership.h"
#include "cluster/zmq_socket.h"
#include "core/mutex.h"
#include "eplb/load_window.h"
#include "eplb/planner.h"
#include "flexpert/model_config.h"
#include "flexpert/placement.h"
#include "serve/cluster_engine.h"
#include "serve/launcher.h"
#include "serve/metrics.h"

namespace flexpert {

using Clock = std::chrono::steady_clock;

// A rank's state is the membership's (cluster::RankState); /v1/status shows a member of
// a degraded group as "halted" (Impl::rank_state_name).
using RankState = cluster::RankState;

// The group's phase (/v1/status "phase"), owned by cluster::Membership.
using Phase = cluster::Phase;
using cluster::phase_name;

// How long a scale-up's copies or a recovery's reloads may take.
constexpr auto kPullTimeout = std::chrono::seconds(120);
// Degraded, the healer asks for another recovery after kDegradedBackoff, doubling up to
// kDegradedBackoffMax (heal_loop); Retry-After stays within them (ClusterEngine::retry_after_s).
constexpr auto kDegradedBackoff = std::chrono::seconds(1);
constexpr auto kDegradedBackoffMax = std::chrono::seconds(30);

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The ranks of both, sorted, each once.
inline std::vector<int> sorted_union(std::vector<int> a, const std::vector<int>& b) {
  a.insert(a.end(), b.begin(), b.end());
  std::sort(a.begin(), a.end());
  a.erase(std::unique(a.begin(), a.end()), a.end());
  return a;
}

// What the front end keeps of a rank beside the membership's state: its process, its
// address, its reports.
struct RankInfo {
  pid_t pid = 0;         // The worker's process where spawned, 0 before it starts or after reaping.
  bool spawned = false;  // Its process is the launcher's own (ForkLauncher): it kills and reaps it.
  std::string routing_id;  // Of the current incarnation (membership_ numbers it).
  std::string address;
  int running = 0;
  int waiting = 0;
  double step_ms = 0;
  uint64_t steps = 0;
  uint64_t map_version = 0;  // Expert map the rank last reported.
  double max_step_ms = 0;
  uint64_t reports = 0;  // StepReports received.
  std::string last_error;
  uint64_t applied_epoch = 0;  // Last EpochApplied.
  int64_t graph_captures = 0;  // Reported by the worker (CUDA).
  // StepReport's sums since the worker started (its incarnation's; -1: not timed).
  double total_step_ms = 0;
  double total_header_ms = 0;
  double total_exchange_ms = -1;
  bool joining = false;  // Being prepared by a scale-up; not a member yet.
  bool leaving = false;  // Chosen by a scale-down: no new requests.
  bool spare = false;    // Started ahead (--spare-ranks): Ready, not a member.
};

// What the front end keeps of a request so that another rank can re-run it
// (from the prompt plus the tokens already streamed) when its rank leaves or dies.
// Where it runs and at which attempt is the membership's decision (kPlace, kHold);
// `rank` and `attempt` mirror the last one executed.
struct RequestInfo {
  int rank = -1;
  uint32_t attempt = 0;
  CompletionCallback callback;
  std::vector<int32_t> prompt;
  SamplingParams params;
  std::vector<int32_t> streamed;
};

using Calls = std::vector<std::pair<CompletionCallback, CompletionEvent>>;

// Thread safety: the shared state below is GUARDED_BY(mutex_), and the helpers that expect
// it held say REQUIRES(mutex_) (clang checks both: scripts/check_thread_safety.sh). What is
// read without the lock says why next to it.
class ClusterEngine::Impl {
 public:
  explicit Impl(ClusterOptions options)
      : options_(std::move(options)),
        router_(ctx_, ZMQ_ROUTER),
        wake_rx_(ctx_, ZMQ_PAIR),
        wake_tx_(ctx_, ZMQ_PAIR) {}

  Status start() EXCLUDES(mutex_);
  Status shutdown() EXCLUDES(mutex_);

  // Set by start() before it starts any thread, read-only afterwards: read without the lock.
  ClusterOptions options_;
  ModelConfig model_config_;
  int max_seq_len_ = 0;
  int slots_per_rank_ = 0;
  std::string session_;
  std::string endpoint_;

  mutable Mutex mutex_;
  CondVar cv_;
  // The expert map of the current epoch (EPLB, scale and recovery replace it).
  ExpertPlacement placement_ GUARDED_BY(mutex_);

  ZmqContext ctx_;     // Thread-safe (zmq contexts are).
  ZmqSocket router_;   // The control thread's alone after start() (before: start()'s).
  ZmqSocket wake_rx_;  // Control thread side.
  ZmqSocket wake_tx_ GUARDED_BY(mutex_);
  // Thread handles: started by start() and joined by shutdown(), on the caller's thread.
  std::thread control_;
  // Atomics, read without the lock (waits that watch them poll or are notified).
  std::atomic<bool> stop_{false};
  std::atomic<bool> shutting_down_{false};  // Set first by shutdown(): reconfigurations give up.
  bool halting() const { return stop_.load() || shutting_down_.load(); }

  std::vector<RankInfo> ranks_ GUARDED_BY(mutex_);
  std::map<uint64_t, RequestInfo> requests_ GUARDED_BY(mutex_);
  // When tokens last came in (or a request arrived to an empty engine): a long silence
  // while requests are open is logged (handle), the front end's side of a stall.
  Clock::time_point last_tokens_at_ GUARDED_BY(mutex_){};
  struct Outgoing {
    int rank = 0;
    bool to_heartbeat = false;  // To the rank's heartbeat socket (PeerLost), not its control one.
    std::vector<std::string> parts;  // [type, body]
  };
  std::deque<Outgoing> outbox_ GUARDED_BY(mutex_);
  uint64_t next_request_id_ GUARDED_BY(mutex_) = 1;
  // Phase, members, incarnations and the epoch with its commit rule (src/cluster,
  // pure); the flows below execute it and record their steps in it.
  cluster::Membership membership_ GUARDED_BY(mutex_){cluster::MembershipConfig{}};
  // From the options and placement.
  cluster::MembershipConfig membership_config() const REQUIRES(mutex_);
  uint64_t epoch() const REQUIRES(mutex_) { return membership_.epoch(); }
  const std::vector<int>& members() const REQUIRES(mutex_) { return membership_.members(); }
  Phase phase() const REQUIRES(mutex_) { return membership_.phase(); }
  void enter_phase(Phase p) REQUIRES(mutex_) { membership_.enter(p); }
  // A member was lost and the epoch without it has not committed: the survivors are halted
  // (recover()). The membership's phase alone says so; so does its degraded_reason().
  bool recovering() const REQUIRES(mutex_) { return phase() == Phase::kRecovering; }
  uint64_t incarnation(int rank) const REQUIRES(mutex_) {
    return membership_.rank(rank).incarnation;
  }
  RankState state(int rank) const REQUIRES(mutex_) { return membership_.rank(rank).state; }
  // A member of a degraded group: halted at its last collective until a recovery commits.
  bool halted(int rank) const REQUIRES(mutex_) {
    return state(rank) == RankState::kServing && phase() == Phase::kDegraded;
  }
  const char* rank_state_name(int rank) const REQUIRES(mutex_) {
    return halted(rank) ? "halted" : cluster::rank_state_name(state(rank));
  }
  static int64_t now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
        .count();
  }
  Status start_error_ GUARDED_BY(mutex_);
  bool accepting_ GUARDED_BY(mutex_) = false;

  // EPLB (cluster_eplb.cc). The load window, shaped by start().
  eplb::LoadWindow load_ GUARDED_BY(mutex_){0, 0, 0, 0};
  bool rebalancing_ GUARDED_BY(mutex_) = false;
  uint64_t rebalance_epoch_ GUARDED_BY(mutex_) = 0;  // The epoch a running rebalance started in.
  bool cancel_rebalance_ GUARDED_BY(mutex_) = false;
  uint64_t map_version_ GUARDED_BY(mutex_) = 0;
  uint64_t next_pull_id_ GUARDED_BY(mutex_) = 1;
  std::map<uint64_t, proto::PullDone> pulls_done_ GUARDED_BY(mutex_);
  // Longest step any rank reported during a rebalance.
  double rebalance_max_step_ms_ GUARDED_BY(mutex_) = 0;
  // PullDone::seconds of every move_layer pull so far.
  double pull_seconds_ GUARDED_BY(mutex_) = 0;
  nlohmann::json last_rebalance_ GUARDED_BY(mutex_);
  std::thread eplb_thread_;  // As control_.
  CondVar eplb_cv_;

  // A rank's rows per slot of a step into load_ (by the slots' logical experts) and the
  // per-slot metrics.
  void record_load(int rank, const std::vector<int64_t>& slot_counts) REQUIRES(mutex_);
  // The planner's input over `ranks` from `load` (+ `prior` per expert, so that a group
  // without load yet still spreads its experts) and the current placement; no skip
  // threshold (min_gain 0).
  eplb::PlanInput plan_input(const std::vector<int>& ranks, std::vector<std::vector<double>> load,
                             double prior) const REQUIRES(mutex_);
  // The replicas every expert keeps in a group of `members` (ClusterOptions::min_replicas).
  int min_replicas_for(int members) const REQUIRES(mutex_);
  // Expert copies (PullCommands), one command per (destination rank, layer): the
  // scale-up's joiners, the EPLB mover and the recovery's reloads build them alike.
  using Pulls = std::map<std::pair<int, int>, proto::PullCommand>;
  // Fill global slot `dst_slot` of `layer` from local slot `src_slot` of `src_rank`
  // (or, with src_rank kFromCheckpoint, logical expert `src_slot` from the checkpoint).
  void add_pull(Pulls* pulls, int layer, int dst_slot, int src_rank, int src_slot) const;
  struct PullTotals {
    uint64_t num_bytes = 0;
    uint64_t device_copies = 0;
    double seconds = 0;  // Summed over the commands (mover time).
    int commands = 0;
    int slots = 0;  // Slot copies (a command fills one or more slots).
  };
  // Posts the commands (ids assigned) and waits, lock held, until every one answered,
  // `stop` holds or `timeout` passes. Answers are consumed; the first failed pull's
  // status, Cancelled when stopped, DeadlineExceeded on timeout.
  Status run_pulls(Pulls pulls, Clock::duration timeout, const std::function<bool()>& stop,
                   PullTotals* totals) REQUIRES(mutex_);
  Result<nlohmann::json> rebalance(const std::string& trigger) EXCLUDES(mutex_);
  // Moves `layer` to `target` in transition steps; their pulls are added to `moved`.
  Status move_layer(int layer, const std::vector<int>& target, PullTotals* moved) EXCLUDES(mutex_);
  Status commit_map(ExpertPlacement next) EXCLUDES(mutex_);
  void eplb_loop() EXCLUDES(mutex_);
  nlohmann::json eplb_status() const EXCLUDES(mutex_);
  void update_eplb_gauges() const REQUIRES(mutex_);  // Balancedness per layer.

  // Elastic membership (cluster_scale.cc).
  bool reconfiguring_ GUARDED_BY(mutex_) = false;
  std::string reconfig_step_ GUARDED_BY(mutex_);  // What a running reconfiguration does (status).
  nlohmann::json last_reconfig_ GUARDED_BY(mutex_);
  uint64_t next_connect_id_ GUARDED_BY(mutex_) = 1;
  // Answers to the connect commands connect_all() waits for; others (a detach after a
  // rollback, answers arriving after connect_all gave up) are dropped on arrival.
  std::set<uint64_t> connects_awaited_ GUARDED_BY(mutex_);
  std::map<uint64_t, proto::Connected> connects_done_ GUARDED_BY(mutex_);
  // Members lost so far: a recovery attempt restarts when it moves.
  uint64_t losses_ GUARDED_BY(mutex_) = 0;
  // The size the operator asked for; the healer restores it.
  int target_ranks_ GUARDED_BY(mutex_) = 0;
  // Members that asked to leave (LeaveRequest: a worker's SIGTERM), with when they asked;
  // the healer scales each down once no reconfiguration runs (serve_leaves()).
  std::deque<std::pair<int, Clock::time_point>> leave_requests_ GUARDED_BY(mutex_);
  // Runs the oldest leave request (healer thread); false when none could run.
  bool serve_leaves() REQUIRES(mutex_);
  // The last recovery's report (status: "recovery").
  nlohmann::json last_recovery_ GUARDED_BY(mutex_) = nlohmann::json::object();
  // Degraded with a launcher that starts workers: the healer asks for another recovery at
  // degraded_retry_at_, backing off from one failed retry to the next (heal_loop).
  Clock::time_point degraded_retry_at_ GUARDED_BY(mutex_){};
  std::chrono::milliseconds degraded_backoff_ GUARDED_BY(mutex_){0};
  uint64_t degraded_retries_ GUARDED_BY(mutex_) = 0;  // Since the group was last serving.
  // Whether the healer retries out of degraded on its own (fork, or a launch command).
  bool retries_degraded() const REQUIRES(mutex_) {
    return launcher_->starts_workers() && options_.reconfigure == "live";
  }
  // Degraded: asks for another recovery once the backoff has passed (healer thread).
  void retry_degraded() REQUIRES(mutex_);
  // Degraded with the healer retrying: the seconds until its next attempt (0 when due);
  // nullopt otherwise (serving, recovering, or degraded until an operator's scale).
  std::optional<double> degraded_retry_in_s() const REQUIRES(mutex_) {
    if (phase() != Phase::kDegraded || !retries_degraded()) return std::nullopt;
    return std::max(0.0, std::chrono::duration<double>(degraded_retry_at_ - Clock::now()).count());
  }
  // /metrics (thread-safe on its own). Recovery outcomes: in_place (the survivors'
  // slots), replacement (new ranks), failed (degraded).
  mutable metrics::Registry registry_;  // Thread-safe; created on first use.
  metrics::Counter& recoveries(const std::string& outcome) const {
    return registry_.counter("flexpert_recoveries_total", "Recoveries from lost ranks, by outcome.",
                             {{"outcome", outcome}});
  }
  metrics::Histogram& recovery_seconds() const {
    return registry_.histogram("flexpert_recovery_seconds",
                               "From a rank's loss to the epoch without it (or the failure).",
                               {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60});
  }
  metrics::Counter& reconfigurations() const {
    return registry_.counter("flexpert_reconfigurations_total",
                             "Committed membership changes (scale, recovery).");
  }
  metrics::Counter& reruns() const {
    return registry_.counter("flexpert_requests_rerun_total",
                             "Requests moved to another rank and re-run.");
  }
  metrics::Counter& rebalances() const {
    return registry_.counter("flexpert_eplb_rebalances_total", "Completed rebalances.");
  }
  metrics::Counter& moved_bytes() const {
    return registry_.counter("flexpert_eplb_moved_bytes_total",
                             "Expert weight bytes moved between slots.");
  }
  // Every family, in a fixed order (created at start), so that /metrics is stable.
  void create_metrics() const;
  // Sets the gauges that are read off the state.
  void update_gauges() const REQUIRES(mutex_);
  metrics::Counter& held_total() const {
    return registry_.counter("flexpert_requests_held_total",
                             "Requests held at the front end while a recovery ran.");
  }
  std::thread healer_;  // Runs recover() and heal-ups. As control_.
  void heal_loop() EXCLUDES(mutex_);
  // Commits an epoch of the survivors (plus replacement ranks where their slots cannot
  // hold every expert) with the lost experts reloaded. Healer thread; the waits release
  // the lock, and the commit does not: the caller writes the report and then runs `calls`
  // (the held requests' events) without the lock.
  Status recover(nlohmann::json* report, Calls* calls) REQUIRES(mutex_);
  // Starts `joiners` (launcher_; an external one may only say how) and waits until each is
  // Ready; `changed` ends the wait early. Rolls back nothing.
  Status start_joiners(const std::vector<int>& joiners, const std::function<bool()>& changed)
      REQUIRES(mutex_);
  // ConnectCommands that attach `joiners` and `members` to each other.
  std::map<int, proto::ConnectCommand> joiner_connects(const std::vector<int>& members,
                                                       const std::vector<int>& joiners) const
      REQUIRES(mutex_);
  void enter_degraded(const std::string& why, Calls* calls) REQUIRES(mutex_);
  // Stop-the-world recovery after a loss. Assigned by the control thread with mutex_ held
  // (on_rank_lost); joined by shutdown() without it, once the phase is stopping, after
  // which on_rank_lost assigns it no more.
  std::thread restart_thread_;

  // `kind` names the report ("heal" for the healer's); empty: scale-up or scale-down.
  Result<nlohmann::json> scale(const ScaleTarget& target, const std::string& kind = "")
      EXCLUDES(mutex_);
  // POST /v1/scale while degraded: another recovery, with room for target.ranks.
  Result<nlohmann::json> retry_recovery(const ScaleTarget& target) REQUIRES(mutex_);
  Status scale_up(const std::vector<int>& joiners, nlohmann::json* report) EXCLUDES(mutex_);
  Status scale_down(const std::vector<int>& leavers, nlohmann::json* report) EXCLUDES(mutex_);
  Status restart_group(int num_ranks, nlohmann::json* report) EXCLUDES(mutex_);
  void rollback_joiners(const std::vector<int>& joiners) REQUIRES(mutex_);
  // Sends the commands and waits for every answer; `failed` ends the wait early.
  Status connect_all(const std::map<int, proto::ConnectCommand>& cmds,
                     const std::function<bool()>& failed) REQUIRES(mutex_);
  Status wait_applied(const std::vector<int>& ranks, uint64_t epoch) REQUIRES(mutex_);
  std::vector<int> free_ranks() const REQUIRES(mutex_);
  // A hello's rank id, or for Hello::kAnyRank the lowest open id not reserved for a process we
  // spawned, admitted by the membership: {rank, incarnation}.
  Result<std::pair<int, uint64_t>> admit(int rank, int pid) REQUIRES(mutex_);
  std::vector<int> spare_ranks() const REQUIRES(mutex_);  // Ready spares.
  // Ids a scale-up or a recovery may take: Ready spares first, then free ids.
  std::vector<int> joiner_candidates() const REQUIRES(mutex_);
  // Starts spares at free ids until --spare-ranks are Ready or starting.
  void keep_spares() REQUIRES(mutex_);
  // Executes the membership's request actions: kPlace (cancelled where it ran before,
  // re-run from its prompt plus the streamed tokens; one with nothing left to generate
  // gets its final event in `calls`), kHold, kFail; others are ignored. Requests
  // answered here are marked kFinishedRank and erased before it returns.
  void run_requests(const cluster::Actions& actions, Calls* calls) REQUIRES(mutex_);
  int in_flight(int rank) const REQUIRES(mutex_) { return membership_.rank(rank).in_flight; }
  static constexpr int kFinishedRank = -2;
  static constexpr int kHeldRank = -3;  // Held at the front end until an epoch commits.
  void sweep_finished() REQUIRES(mutex_);
  void fail_all(const std::string& why, Calls* calls) REQUIRES(mutex_);
  void fail_request(RequestInfo& req, const std::string& why, Calls* calls) REQUIRES(mutex_);
  void unlink_rank_segments(int rank, uint64_t incarnation) const;
  nlohmann::json reconfig_status() const REQUIRES(mutex_);

  // Control thread.
  void control_loop() EXCLUDES(mutex_);
  void handle(const std::string& routing_id, const std::string& type, const std::string& body,
              Calls* calls) EXCLUDES(mutex_);
  void check_workers(Calls* calls) EXCLUDES(mutex_);
  // A rank is gone (process exit, heartbeat, a peer's report): its requests are re-run
  // on survivors, which commit an epoch without it (reloading experts left without
  // a replica first).
  void on_rank_lost(int rank, const std::string& why, Calls* calls) REQUIRES(mutex_);
  // What the driver does once the membership declared incarnation `lost_incarnation` of
  // `rank` lost (`decided`: its actions, from lost() or tick()): kill or fence the process,
  // tell the peers, hold its requests; a member's loss starts the recovery (or, in the
  // stop-the-world baseline, the restart).
  void execute_loss(int rank, uint64_t lost_incarnation, const std::string& why, bool was_member,
                    const cluster::Actions& decided, Calls* calls) REQUIRES(mutex_);
  // Whether new requests can be placed (serving, or a reconfiguration in progress).
  bool admitting() const REQUIRES(mutex_);
  // Commits `members` (and the current placement_) as the next epoch; `also` are
  // old members leaving, who take part in the switch and then stop stepping.
  void commit_epoch(std::vector<int> members, const std::vector<int>& also = {}) REQUIRES(mutex_);
  // Sends a commit the membership decided (EpochCommand to members and leavers).
  void send_epoch(const cluster::Action& commit) REQUIRES(mutex_);
  // A rank whose process is gone (reaped, or never ours): its id may take a new incarnation.
  void rank_reaped(int rank) REQUIRES(mutex_);
  void flush_outbox() EXCLUDES(mutex_);

  // Any thread.
  template <typename T>
  void post(int rank, const T& msg) REQUIRES(mutex_) {
    outbox_.push_back({rank, false, {T::kType, proto::encode(msg)}});
  }
  // Tells every other rank that said hello that `rank` is lost (proto::PeerLost), so their
  // transports end waits on it now (docs/ARCHITECTURE.md, "Membership, epochs, failure").
  void announce_lost(int rank, uint64_t lost_incarnation, const std::string& why) REQUIRES(mutex_);
  void wake() REQUIRES(mutex_);
  // Gets a worker for `rank`'s current incarnation from launcher_ (serve/launcher.h).
  // Control thread, or start() before it runs: forked workers die with the thread that
  // forked them (PR_SET_PDEATHSIG), so only a thread that lives as long as the group may.
  Status launch(int rank) REQUIRES(mutex_);
  // Has the control thread launch `rank`.
  void request_launch(int rank) REQUIRES(mutex_);
  std::vector<int> launch_queue_ GUARDED_BY(mutex_);
  // Fork or external (ClusterOptions::spawn_workers), created by start() once the control
  // socket is bound.
  std::unique_ptr<Launcher> launcher_ GUARDED_BY(mutex_);
  // Launches the launcher saw fail (an orchestrator's command exited non-zero): as a failed
  // process start, the rank is lost before it said hello. Control thread.
  void fail_launches() REQUIRES(mutex_);
  int rank_of_routing_id(const std::string& id) const REQUIRES(mutex_);
};

}  // namespace flexpert
