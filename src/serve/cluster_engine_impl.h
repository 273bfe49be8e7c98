// SPDX-License-Identifier: Apache-2.0
// ClusterEngine's internals, shared by cluster_engine.cc (membership, requests)
// and cluster_eplb.cc (load statistics, rebalancing). Not an API.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include <zmq.h>
#include "cluster/protocol.h"

#include "cluster/zmq_socket.h"
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
  Clock::time_point last_seen{};
  std::string last_error;
};

struct RequestInfo {
  int rank = -1;
  CompletionCallback callback;
};

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
  bool rebalancing_ = false;
  uint64_t rebalance_epoch_ = 0;  // The epoch a running rebalance started in.
  bool cancel_rebalance_ = false;
  uint64_t map_version_ = 0;
  uint64_t next_pull_id_ = 1;
  std::map<uint64_t, proto::PullDone> pulls_done_;
  double rebalance_max_step_ms_ = 0;  // Longest step any rank reported during a rebalance.
  nlohmann::json last_rebalance_;
  uint64_t num_rebalances_ = 0;
  uint64_t moved_bytes_total_ = 0;
  std::thread eplb_thread_;
  std::condition_variable eplb_cv_;

  void record_load(int rank, const std::vector<int64_t>& slot_counts);
  std::vector<std::vector<double>> window_load() const;
  Result<nlohmann::json> rebalance(const std::string& trigger);
  Status move_layer(int layer, const std::vector<int>& target, uint64_t* bytes, int* pulls);
  Status commit_map(ExpertPlacement next);
  void eplb_loop();
  nlohmann::json eplb_status() const;
  std::string eplb_metrics() const;

  // Control thread.
  void control_loop();
  void handle(const std::string& routing_id, const std::string& type, const std::string& body,
              std::vector<std::pair<CompletionCallback, CompletionEvent>>* calls);
  void check_workers(std::vector<std::pair<CompletionCallback, CompletionEvent>>* calls);
  void on_rank_lost(int rank, const std::string& why,
                    std::vector<std::pair<CompletionCallback, CompletionEvent>>* calls);
  void commit_epoch(std::vector<int> members);
  void flush_outbox();

  // Any thread, with mutex_ held.
  template <typename T>
  void post(int rank, const T& msg) {
    outbox_.push_back({rank, {T::kType, proto::encode(msg)}});
  }
  void wake();
  Status spawn(int rank);
  int rank_of_routing_id(const std::string& id) const;
};

}  // namespace flexpert
