// SPDX-License-Identifier: Apache-2.0
// ClusterEngine's internals, shared by cluster_engine.cc (membership, requests)
// and cluster_eplb.cc (load statistics, rebalancing). Not an API.
#pragma once

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

#include "cluster/zmq_socket.h"
#include "eplb/planner.h"
#include "flexpert/model_config.h"
#include "flexpert/placement.h"
#include "serve/cluster_engine.h"

namespace flexpert {

using Clock = std::chrono::steady_clock;

enum class RankState { kEmpty, kStarting, kReady, kServing, kHalted, kDead, kStopped };

const char* state_name(RankState s);

struct RankInfo {
  RankState state = RankState::kEmpty;
  pid_t pid = 0;
  bool spawned = false;
  std::string routing_id;
  uint64_t incarnation = 0;
  std::string address;
  int in_flight = 0;
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
};

// What the front end keeps of a request so that another rank can re-run it
// (from the prompt plus the tokens already streamed) when its rank leaves or dies.
struct RequestInfo {
  int rank = -1;
  CompletionCallback callback;
  std::vector<int32_t> prompt;
  SamplingParams params;
  std::vector<int32_t> streamed;
  int reruns = 0;
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
  std::deque<std::pair<int, std::vector<std::string>>> outbox_;  // (rank, [type, body])
  uint64_t next_request_id_ = 1;
  uint64_t epoch_ = 0;
  std::vector<int> members_;
  std::string phase_ = "starting";
  Status start_error_;
  bool accepting_ = false;

  // EPLB (cluster_eplb.cc), guarded by mutex_.
  struct LoadBucket {
    Clock::time_point start;
    std::vector<std::vector<double>> load;  // [layer][logical expert]
  };
  std::deque<LoadBucket> load_window_;
  std::vector<std::vector<double>> slot_tokens_total_;  // [layer][slot], since start.
  std::vector<std::vector<double>> smoothed_shares_;    // [layer][expert], eplb_smoothing.
  bool rebalancing_ = false;
  uint64_t rebalance_epoch_ = 0;  // The epoch a running rebalance started in.
  bool cancel_rebalance_ = false;
  uint64_t map_version_ = 0;
  uint64_t next_pull_id_ = 1;
  std::map<uint64_t, proto::PullDone> pulls_done_;
  double rebalance_max_step_ms_ = 0;  // Longest step any rank reported during a rebalance.
  double pull_seconds_ = 0;           // PullDone::seconds of every move_layer pull so far.
  nlohmann::json last_rebalance_;
  uint64_t num_rebalances_ = 0;
  uint64_t moved_bytes_total_ = 0;
  std::thread eplb_thread_;
  std::condition_variable eplb_cv_;

  void record_load(int rank, const std::vector<int64_t>& slot_counts);
  std::vector<std::vector<double>> window_load() const;
  // The planner's input over `ranks` from the load window (+ `prior` per expert, so
  // that a group without load yet still spreads its experts) and the current
  // placement. Caller holds mutex_.
  eplb::PlanInput plan_input(const std::vector<int>& ranks, double prior) const;
  Result<nlohmann::json> rebalance(const std::string& trigger);
  Status move_layer(int layer, const std::vector<int>& target, uint64_t* bytes, int* pulls);
  Status commit_map(ExpertPlacement next);
  void eplb_loop();
  nlohmann::json eplb_status() const;
  std::string eplb_metrics() const;

  // Elastic membership (cluster_scale.cc), guarded by mutex_.
  bool reconfiguring_ = false;
  std::string reconfig_step_;  // What a running reconfiguration is doing (status).
  nlohmann::json last_reconfig_;
  uint64_t num_reconfigs_ = 0;
  uint64_t num_reruns_ = 0;
  uint64_t next_connect_id_ = 1;
  // Answers to the connect commands connect_all() waits for; others (a detach after a
  // rollback, answers arriving after connect_all gave up) are dropped on arrival.
  std::set<uint64_t> connects_awaited_;
  std::map<uint64_t, proto::Connected> connects_done_;
  struct Recovery {
    bool active = false;
    std::vector<int> survivors;
    ExpertPlacement placement;
    std::map<uint64_t, int> pulls;  // Outstanding reload id -> the rank doing it.
    Clock::time_point start;
    int reloaded = 0;
  } recovery_;
  std::thread restart_thread_;  // Stop-the-world recovery after a loss.

  Result<nlohmann::json> scale(const ScaleTarget& target);
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
  // Places a request on the least-loaded serving member (not `avoid`); one placed
  // before is cancelled there and re-run from its prompt plus the streamed tokens
  // (one with nothing left to generate gets its final event in `calls` and is
  // marked kFinishedRank for sweep_finished()). False if no member can take it.
  bool rehome(uint64_t id, RequestInfo& req, int avoid, Calls* calls);
  static constexpr int kFinishedRank = -2;
  void sweep_finished();
  void start_recovery(const std::vector<int>& survivors, Calls* calls);
  void finish_recovery(const proto::PullDone& done, Calls* calls);
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
  void flush_outbox();

  // Any thread, with mutex_ held.
  template <typename T>
  void post(int rank, const T& msg) {
    outbox_.push_back({rank, {T::kType, proto::encode(msg)}});
  }
  void wake();
  Status spawn(int rank);
  // Has the control thread spawn `rank` (workers die with the thread that forked
  // them: PR_SET_PDEATHSIG, so only a thread that lives as long as the group may).
  void request_spawn(int rank);
  std::vector<int> spawn_queue_;  // Guarded by mutex_.
  int rank_of_routing_id(const std::string& id) const;
};

}  // namespace flexpert
