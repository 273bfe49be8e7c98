// SPDX-License-Identifier: Apache-2.0
// ClusterEngine's internals, shared by cluster_engine.cc (membership, requests)
// and cluster_eplb.cc (load statistics, rebalancing). Not an API.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <zmq.h>
#include "cluster/protocol.h"

#include "cluster/membership.h"
#include "cluster/zmq_socket.h"
#include "eplb/planner.h"
#include "flexpert/model_config.h"
#include "flexpert/placement.h"
#include "serve/cluster_engine.h"
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
  pid_t pid = 0;
  bool spawned = false;
  std::string routing_id;  // Of the current incarnation (membership_ numbers it).
  std::string address;
  int running = 0;
  int waiting = 0;
  double step_ms = 0;
  uint64_t steps = 0;
  uint64_t map_version = 0;  // Expert map the rank last reported.
  double max_step_ms = 0;
  uint64_t reports = 0;  // StepReports received.
  Clock::time_point last_seen{};
  std::string last_error;
  uint64_t applied_epoch = 0;  // Last EpochApplied.
  int64_t graph_captures = 0;  // Reported by the worker (CUDA).
  bool joining = false;        // Being prepared by a scale-up; not a member yet.
  bool leaving = false;        // Chosen by a scale-down: no new requests.
  bool spare = false;          // Started ahead (--spare-ranks): Ready, not a member.
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

class ClusterEngine::Impl {
 public:
  explicit Impl(ClusterOptions options)
      : options_(std::move(options)),
        router_(ctx_, ZMQ_ROUTER),
        wake_rx_(ctx_, ZMQ_PAIR),
        wake_tx_(ctx_, ZMQ_PAIR) {}

  Status start();
  Status shutdown();

  ClusterOptions options_;
  ModelConfig model_config_;
  int max_seq_len_ = 0;
  int slots_per_rank_ = 0;
  std::string session_;
  ExpertPlacement placement_;
  std::string endpoint_;

  ZmqContext ctx_;
  ZmqSocket router_;   // Owned by the control thread after start().
  ZmqSocket wake_rx_;  // Control thread side.
  ZmqSocket wake_tx_;  // Guarded by mutex_.
  std::thread control_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> shutting_down_{false};  // Set first by shutdown(): reconfigurations give up.
  bool halting() const { return stop_.load() || shutting_down_.load(); }

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  // Guarded by mutex_:
  std::vector<RankInfo> ranks_;
  std::map<uint64_t, RequestInfo> requests_;
  struct Outgoing {
    int rank = 0;
    bool to_heartbeat = false;  // To the rank's heartbeat socket (PeerLost), not its control one.
    std::vector<std::string> parts;  // [type, body]
  };
  std::deque<Outgoing> outbox_;
  uint64_t next_request_id_ = 1;
  // Phase, members, incarnations and the epoch with its commit rule (src/cluster,
  // pure); the flows below execute it and record their steps in it.
  cluster::Membership membership_{cluster::MembershipConfig{}};
  cluster::MembershipConfig membership_config() const;  // From the options and placement.
  uint64_t epoch() const { return membership_.epoch(); }
  const std::vector<int>& members() const { return membership_.members(); }
  Phase phase() const { return membership_.phase(); }
  void enter_phase(Phase p) { membership_.enter(p); }
  uint64_t incarnation(int rank) const { return membership_.rank(rank).incarnation; }
  RankState state(int rank) const { return membership_.rank(rank).state; }
  // A member of a degraded group: halted at its last collective until a recovery commits.
  bool halted(int rank) const {
    return state(rank) == RankState::kServing && phase() == Phase::kDegraded;
  }
  const char* rank_state_name(int rank) const {
    return halted(rank) ? "halted" : cluster::rank_state_name(state(rank));
  }
  static int64_t now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
        .count();
  }
  Status start_error_;
  bool accepting_ = false;

  // EPLB (cluster_eplb.cc), guarded by mutex_.
  struct LoadBucket {
    Clock::time_point start;
    std::vector<std::vector<double>> load;  // [layer][logical expert]
  };
  std::deque<LoadBucket> load_window_;
  std::vector<std::vector<double>> smoothed_shares_;  // [layer][expert], eplb_smoothing.
  bool rebalancing_ = false;
  uint64_t rebalance_epoch_ = 0;  // The epoch a running rebalance started in.
  bool cancel_rebalance_ = false;
  uint64_t map_version_ = 0;
  uint64_t next_pull_id_ = 1;
  std::map<uint64_t, proto::PullDone> pulls_done_;
  double rebalance_max_step_ms_ = 0;  // Longest step any rank reported during a rebalance.
  double pull_seconds_ = 0;           // PullDone::seconds of every move_layer pull so far.
  nlohmann::json last_rebalance_;
  std::thread eplb_thread_;
  std::condition_variable eplb_cv_;

  void record_load(int rank, const std::vector<int64_t>& slot_counts);
  std::vector<std::vector<double>> window_load() const;
  // The load the next plan uses: the window smoothed with smoothed_shares_ (eplb_smoothing),
  // which only a rebalance advances; the window alone when smoothing is off. Membership
  // changes plan on it, so that one noisy window does not place their experts.
  std::vector<std::vector<double>> smoothed_load() const;
  // The planner's input over `ranks` from `load` (+ `prior` per expert, so that a group
  // without load yet still spreads its experts) and the current placement; no skip
  // threshold (min_gain 0). Caller holds mutex_.
  eplb::PlanInput plan_input(const std::vector<int>& ranks, std::vector<std::vector<double>> load,
                             double prior) const;
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
  };
  // Posts the commands (ids assigned) and waits, lock held, until every one answered,
  // `stop` holds or `timeout` passes. Answers are consumed; the first failed pull's
  // status, Cancelled when stopped, DeadlineExceeded on timeout.
  Status run_pulls(Pulls pulls, std::unique_lock<std::mutex>& lock, Clock::duration timeout,
                   const std::function<bool()>& stop, PullTotals* totals);
  Result<nlohmann::json> rebalance(const std::string& trigger);
  Status move_layer(int layer, const std::vector<int>& target, uint64_t* bytes, int* pulls_made);
  Status commit_map(ExpertPlacement next);
  void eplb_loop();
  nlohmann::json eplb_status() const;
  void update_eplb_gauges() const;  // Balancedness per layer; caller holds mutex_.

  // Elastic membership (cluster_scale.cc), guarded by mutex_.
  bool reconfiguring_ = false;
  std::string reconfig_step_;  // What a running reconfiguration is doing (status).
  nlohmann::json last_reconfig_;
  uint64_t next_connect_id_ = 1;
  // Answers to the connect commands connect_all() waits for; others (a detach after a
  // rollback, answers arriving after connect_all gave up) are dropped on arrival.
  std::set<uint64_t> connects_awaited_;
  std::map<uint64_t, proto::Connected> connects_done_;
  // A lost rank: survivors are halted until the next epoch commits (recover()).
  struct Recovery {
    bool active = false;  // A member was lost; the epoch without it has not committed.
    std::vector<int> lost;
    Clock::time_point start;
  } recovery_;
  uint64_t losses_ = 0;   // Members lost so far: a recovery attempt restarts when it moves.
  int target_ranks_ = 0;  // The size the operator asked for; the healer restores it.
  // Members that asked to leave (LeaveRequest: a worker's SIGTERM), with when they asked;
  // the healer scales each down once no reconfiguration runs (serve_leaves()).
  std::deque<std::pair<int, Clock::time_point>> leave_requests_;
  // Runs the oldest leave request (healer thread, lock held); false when none could run.
  bool serve_leaves(std::unique_lock<std::mutex>& lock);
  std::string degraded_reason_;
  nlohmann::json last_recovery_ =
      nlohmann::json::object();  // The last recovery's report (status: "recovery").
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
  // Sets the gauges that are read off the state (caller holds mutex_).
  void update_gauges() const;
  metrics::Counter& held_total() const {
    return registry_.counter("flexpert_requests_held_total",
                             "Requests held at the front end while a recovery ran.");
  }
  std::thread healer_;  // Runs recover() and heal-ups.
  void heal_loop();
  // Commits an epoch of the survivors (plus replacement ranks where their slots cannot
  // hold every expert) with the lost experts reloaded. Healer thread, lock held.
  Status recover(std::unique_lock<std::mutex>& lock, nlohmann::json* report);
  // Starts `joiners` (spawned, or waits for hand-started ones) and waits until each is
  // Ready; `changed` ends the wait early. Lock held; rolls back nothing.
  Status start_joiners(const std::vector<int>& joiners, std::unique_lock<std::mutex>& lock,
                       const std::function<bool()>& changed);
  // ConnectCommands that attach `joiners` and `members` to each other.
  std::map<int, proto::ConnectCommand> joiner_connects(const std::vector<int>& members,
                                                       const std::vector<int>& joiners) const;
  void enter_degraded(const std::string& why, Calls* calls);
  std::thread restart_thread_;  // Stop-the-world recovery after a loss.

  // `kind` names the report ("heal" for the healer's); empty: scale-up or scale-down.
  Result<nlohmann::json> scale(const ScaleTarget& target, const std::string& kind = "");
  // POST /v1/scale while degraded: another recovery, with room for target.ranks.
  Result<nlohmann::json> retry_recovery(const ScaleTarget& target,
                                        std::unique_lock<std::mutex>& lock);
  Status scale_up(const std::vector<int>& joiners, nlohmann::json* report);
  Status scale_down(const std::vector<int>& leavers, nlohmann::json* report);
  Status restart_group(int num_ranks, nlohmann::json* report);
  void rollback_joiners(const std::vector<int>& joiners);
  // Sends the commands and waits for every answer; `failed` ends the wait early.
  Status connect_all(const std::map<int, proto::ConnectCommand>& cmds,
                     std::unique_lock<std::mutex>& lock, const std::function<bool()>& failed);
  Status wait_applied(const std::vector<int>& ranks, uint64_t epoch,
                      std::unique_lock<std::mutex>& lock);
  std::vector<int> free_ranks() const;
  // A hello's rank id, or for Hello::kAnyRank the lowest open id not reserved for a process we
  // spawned, admitted by the membership: {rank, incarnation}. Lock held.
  Result<std::pair<int, uint64_t>> admit(int rank, int pid);
  std::vector<int> spare_ranks() const;  // Ready spares.
  // Ids a scale-up or a recovery may take: Ready spares first, then free ids.
  std::vector<int> joiner_candidates() const;
  // Starts spares at free ids until --spare-ranks are Ready or starting. Lock held.
  void keep_spares();
  // Executes the membership's request actions: kPlace (cancelled where it ran before,
  // re-run from its prompt plus the streamed tokens; one with nothing left to generate
  // gets its final event in `calls`), kHold, kFail; others are ignored. Requests
  // answered here are marked kFinishedRank and erased before it returns.
  void run_requests(const cluster::Actions& actions, Calls* calls);
  int in_flight(int rank) const { return membership_.rank(rank).in_flight; }
  static constexpr int kFinishedRank = -2;
  static constexpr int kHeldRank = -3;  // Held at the front end until an epoch commits.
  void sweep_finished();
  void fail_all(const std::string& why, Calls* calls);
  void fail_request(RequestInfo& req, const std::string& why, Calls* calls);
  void unlink_rank_segments(int rank, uint64_t incarnation) const;
  nlohmann::json reconfig_status() const;

  // Control thread.
  void control_loop();
  void handle(const std::string& routing_id, const std::string& type, const std::string& body,
              Calls* calls);
  void check_workers(Calls* calls);
  // A rank is gone (process exit, heartbeat, a peer's report): its requests are re-run
  // on survivors, which commit an epoch without it (reloading experts left without
  // a replica first).
  void on_rank_lost(int rank, const std::string& why, Calls* calls);
  // Whether new requests can be placed (serving, or a reconfiguration in progress).
  bool admitting() const;
  // Commits `members` (and the current placement_) as the next epoch; `also` are
  // old members leaving, who take part in the switch and then stop stepping.
  void commit_epoch(std::vector<int> members, const std::vector<int>& also = {});
  // Sends a commit the membership decided (EpochCommand to members and leavers).
  void send_epoch(const cluster::Action& commit);
  // A rank whose process is gone (reaped, or never ours): its id may take a new incarnation.
  void rank_reaped(int rank);
  void flush_outbox();

  // Any thread, with mutex_ held.
  template <typename T>
  void post(int rank, const T& msg) {
    outbox_.push_back({rank, false, {T::kType, proto::encode(msg)}});
  }
  // Tells every other rank that said hello that `rank` is lost (proto::PeerLost), so their
  // transports end waits on it now (docs/ARCHITECTURE.md, "Membership, epochs, failure").
  void announce_lost(int rank, uint64_t lost_incarnation, const std::string& why);
  void wake();
  Status spawn(int rank);
  // Has the control thread spawn `rank` (workers die with the thread that forked
  // them: PR_SET_PDEATHSIG, so only a thread that lives as long as the group may).
  void request_spawn(int rank);
  std::vector<int> spawn_queue_;  // Guarded by mutex_.
  int rank_of_routing_id(const std::string& id) const;
};

}  // namespace flexpert
