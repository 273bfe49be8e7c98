// SPDX-License-Identifier: Apache-2.0
// Internal to the engine module (include only from src/engine): the worker's class and the
// helpers its files share. worker.cc holds the step loop, worker_control.cc the control and
// heartbeat side, worker_slots.cc the load and the weight mover. Not API (flexpert/worker.h is).
#pragma once

#include <zmq.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cluster/protocol.h"
#include "cluster/zmq_socket.h"
#include "core/clock.h"
#include "core/mutex.h"
#include "engine/peer_incarnations.h"
#include "flexpert/logging.h"
#include "flexpert/model.h"
#include "flexpert/scheduler.h"
#include "flexpert/worker.h"
#include "moe/ep_executor.h"
#include "moe/memory_plan.h"
#include "transport/transport.h"

namespace flexpert::engine_detail {

// A step (or its header) longer than slow_step_ms() is logged, as are the first steps of an
// epoch: a stall's place in the worker logs. Between two steps of a busy rank (control
// messages handled, reports sent), or one control message's handling, longer than
// slow_gap_ms() is logged: time no token can come. 100 and 50 ms; FLEXPERT_STEP_LOG_MS sets
// both (a stall hunt: docs/deployment.md).
double slow_step_ms();
double slow_gap_ms();
inline constexpr int kLoggedStepsAfterEpoch = 3;

// Set by run_worker's signal handlers (worker.cc), read by the worker's loop.
extern std::atomic<bool> g_terminate;  // SIGINT (and the front end's death): stop now.
extern std::atomic<bool> g_leave;      // SIGTERM: a graceful leave (docs/deployment.md).

// A step running longer is reported by the heartbeat thread, again at this interval.
inline constexpr int64_t kLongStepReportNs = 2'000'000'000;
// A step running longer than this, or twice the transport's timeout if that is more (a
// step may wait that long on a silent peer), ends the process (stuck_step_limit_ns): a
// stepping thread held in a CUDA call never reaches its own watchdog, and a worker whose
// heartbeat goes on would hold the group for good (H200: survivors of a kill once stuck
// for minutes). The group recovers without it, as from any death.
inline constexpr int64_t kStuckStepLimitNs = 60'000'000'000;
// The limit for a worker whose transport waits at most `timeout_ms`; FLEXPERT_STUCK_STEP_MS
// (tests) replaces it. Defined in worker_control.cc.
int64_t stuck_step_limit_ns(int timeout_ms);

// FLEXPERT_FAULT=device-lost:RANK:STEPS (tests): the first incarnation of RANK fails its
// step after STEPS busy steps as a device that failed for good would (Model::device_lost).
// Returns the steps, or -1 when this rank has no such fault. Defined in worker_control.cc.
int device_lost_fault(int rank, uint64_t incarnation);
// FLEXPERT_FAULT=step-hang:RANK:STEPS (tests): the first incarnation of RANK never ends its
// busy step after STEPS of them (a stepping thread held in a driver call), its heartbeat
// going on. The same return as device_lost_fault.
int step_hang_fault(int rank, uint64_t incarnation);

static_assert(kAutoRank == proto::Hello::kAnyRank);

// The per-step header every member contributes to the all-gather.
struct StepHeader {
  uint32_t num_tokens = 0;
  uint32_t stopping = 0;      // 1: this rank was told to shut down.
  uint64_t acked_epoch = 0;   // Highest epoch command this rank holds.
  uint64_t acked_map = 0;     // Highest expert-map version this rank holds.
  uint32_t device_ready = 0;  // 1: this rank's model can run a device exchange with the group.
  uint32_t pad = 0;
};
// plan-memory sizes the gather mailboxes by it (moe/memory_plan.h).
static_assert(sizeof(StepHeader) == kStepHeaderBytes);

template <typename T>
Status send_msg(ZmqSocket& socket, const T& msg) {
  return socket.send({T::kType, proto::encode(msg)});
}

// One rank's worker process: attaches to the front end, loads, then steps with its group.
//
// Thread safety: three threads. The thread that calls run() owns every member without an
// annotation (the control socket, the scheduler, the group, the step state) and is the only
// one that steps the model or sends on control_. The heartbeat thread (started once config_
// is set, which it then only reads) uses its own socket, the members under heartbeat_mutex_
// (through lost_sink_ it calls Transport::mark_peer_lost, which any thread may) and the
// step_started_ns_/step_part_ atomics. The mover thread (started after load(), so model_ and
// transport_ are set) takes PullCommands and leaves PullDones under mover_mutex_, and calls
// only what Model and Transport allow beside a step: load_expert, copy_slot, slots_written,
// local_slots' slots free in the current map, and read(). ZmqContext is thread-safe.
class Worker {
 public:
  explicit Worker(const WorkerOptions& options) : options_(options), control_(ctx_, ZMQ_DEALER) {}

  int run();

 private:
  Status connect_and_configure();
  Status load();
  Status apply_epoch(const proto::EpochCommand& cmd);
  Status connect_peers(const proto::ConnectCommand& cmd);
  // Handles control messages for up to timeout_ms (0: only what is queued).
  Status poll_control(int timeout_ms);
  Status handle(const std::vector<std::string>& parts);
  Status step();
  void report(bool force);
  // The weight mover: a thread that copies experts into free slots beside serving.
  void mover_loop();
  proto::PullDone pull(const proto::PullCommand& cmd);
  void send_pull_results();
  void report_error(const Status& s) {
    FLEX_LOG(WARN) << "rank " << options_.rank << ": " << s.to_string();
    proto::WorkerError err{group_.epoch, static_cast<int>(s.code()), s.message()};
    (void)send_msg(control_, err);
    exit_if_device_lost();
  }
  // After a failure: a device that can run nothing more (Model::device_lost) ends the
  // process, which the group replaces as any lost rank; staying would fail every step.
  void exit_if_device_lost();
  // Beats on a socket of its own every kHeartbeatIntervalMs, whatever the step does, and
  // takes the front end's PeerLost there (the stepping thread may be waiting on that peer).
  void heartbeat_loop(std::string routing_id);
  void on_peer_lost(const std::vector<std::string>& parts);
  void stop_heartbeat() {
    {
      MutexLock lock(heartbeat_mutex_);
      heartbeat_stop_ = true;
    }
    if (heartbeat_.joinable()) heartbeat_.join();
  }
  void stop_mover() {
    {
      MutexLock lock(mover_mutex_);
      mover_stop_ = true;
    }
    mover_cv_.notify_all();
    if (mover_.joinable()) mover_.join();
  }

  WorkerOptions options_;
  ZmqContext ctx_;
  ZmqSocket control_;
  proto::WorkerConfig config_;
  ModelConfig model_config_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<EpMoeExecutor> executor_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Scheduler> scheduler_;
  Group group_;
  bool has_pending_ = false;
  proto::EpochCommand pending_;
  bool stopping_ = false;
  bool leaving_ = false;  // Exit once an epoch without this rank is applied.
  bool halted_ = false;
  bool idle_ = true;
  Tensor logits_;
  std::vector<int32_t> tokens_;  // Per batch row: Model::forward_step's token.
  std::vector<TokenEvent> events_;
  std::unordered_map<uint64_t, uint32_t> attempts_;  // Request id -> AddRequest::attempt.
  uint64_t steps_ = 0;
  double busy_ms_ = 0;
  double max_step_ms_ = 0;
  int log_steps_ = 0;  // Steps still logged after an epoch change (its first few).
  uint64_t busy_steps_ = 0;
  // Sums over the busy steps since start (StepReport's totals).
  double total_step_ms_ = 0;
  double total_header_ms_ = 0;
  std::chrono::steady_clock::time_point last_report_{};
  std::chrono::steady_clock::time_point last_step_end_{};  // Of the last busy step.
  // The step running now (its start, steady_clock ns; 0 between steps) and its part: the
  // heartbeat thread reports a step that runs on for seconds (where a rank hangs).
  std::atomic<int64_t> step_started_ns_{0};
  std::atomic<const char*> step_part_{""};
  int device_lost_after_ = -1;  // FLEXPERT_FAULT=device-lost: busy steps left, or -1.
  int step_hang_after_ = -1;    // FLEXPERT_FAULT=step-hang: busy steps left, or -1.
  // Expert map switching (same agreement rule as epochs).
  uint64_t map_version_ = 0;
  bool has_pending_map_ = false;
  proto::MapCommand pending_map_;
  // Mover thread and its queues.
  std::thread mover_;
  Mutex mover_mutex_;
  CondVar mover_cv_;
  std::deque<proto::PullCommand> pulls_ GUARDED_BY(mover_mutex_);
  std::deque<proto::PullDone> pulled_ GUARDED_BY(mover_mutex_);
  bool mover_stop_ GUARDED_BY(mover_mutex_) = false;
  std::thread heartbeat_;
  Mutex heartbeat_mutex_;
  bool heartbeat_stop_ GUARDED_BY(heartbeat_mutex_) = false;
  // transport_, once created, for the heartbeat thread's mark_peer_lost (any thread).
  Transport* lost_sink_ GUARDED_BY(heartbeat_mutex_) = nullptr;
  // The incarnation of each peer attached (or being attached): a PeerLost of an earlier one
  // is stale. Updated before each connect, under the mutex the heartbeat thread checks and
  // marks under, so a stale PeerLost either marks the old attachment (which the connect then
  // replaces) or is dropped; it never marks the new one.
  PeerIncarnations peer_incarnations_ GUARDED_BY(heartbeat_mutex_);
  bool fenced_ = false;  // Declared lost by the front end: exit, touch nothing.
  // SIGTERM: a LeaveRequest went out; the front end's scale-down ends it (Shutdown{kLeave})
  // or, past the deadline, the worker exits 1 on its own.
  bool leave_requested_ = false;
  std::chrono::steady_clock::time_point leave_deadline_{};
  // Whether to stop stepping now for a SIGTERM (false: keep serving until the leave commits).
  bool leave_now();

 public:
  ~Worker() {
    stop_heartbeat();
    stop_mover();
  }
};

}  // namespace flexpert::engine_detail
