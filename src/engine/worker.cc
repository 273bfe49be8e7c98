// SPDX-License-Identifier: Apache-2.0
#include "flexpert/worker.h"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <thread>
#include <unordered_map>

#include "cluster/protocol.h"
#include "cluster/zmq_socket.h"
#include "core/mutex.h"
#include "core/thread_name.h"
#include "engine/peer_incarnations.h"
#include "engine/placement_wire.h"
#include "flexpert/logging.h"
#include "flexpert/model.h"
#include "flexpert/scheduler.h"
#include "flexpert/thread_pool.h"
#include "moe/ep_executor.h"
#include "moe/expert_slots.h"
#include "moe/memory_plan.h"
#include "transport/transport.h"

namespace flexpert {
namespace {

// A step (or its header) longer than this is logged, as are the first steps of an epoch:
// a stall's place in the worker logs.
constexpr double kSlowStepMs = 100;
constexpr int kLoggedStepsAfterEpoch = 3;
// Between two steps of a busy rank (control messages handled, reports sent), or one
// control message's handling, longer than this is logged: time no token can come.
constexpr double kSlowGapMs = 50;

std::atomic<bool> g_terminate{false};  // SIGINT (and the front end's death): stop now.
std::atomic<bool> g_leave{false};      // SIGTERM: a graceful leave (docs/deployment.md).

// The CUDA ordinal a --device names ("cuda" is 0, "cuda:N" is N); -1 for the CPU (or a spec
// the model load rejects with its own message).
// A step running longer is reported by the heartbeat thread, again at this interval.
constexpr int64_t kLongStepReportNs = 2'000'000'000;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

int gpu_ordinal(const std::string& device) {
  if (device == "cuda") return 0;
  if (device.rfind("cuda:", 0) != 0 || device.size() == 5 || device.size() > 9) return -1;
  const std::string digits = device.substr(5);
  if (digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoi(digits);
}

// Fault injection for tests of scale-up rollback (FLEXPERT_FAULT, inherited by
// spawned workers): "join-crash" kills a joining worker during its preparation,
// "join-delay:MS" stalls it. Initial ranks are members before any connect command.
void inject_join_fault() {
  const char* fault = std::getenv("FLEXPERT_FAULT");
  if (fault == nullptr) return;
  int ms = 0;
  if (std::strcmp(fault, "join-crash") == 0) {
    FLEX_LOG(WARN) << "FLEXPERT_FAULT=join-crash: exiting during the preparation";
    _exit(3);
  }
  if (std::sscanf(fault, "join-delay:%d", &ms) == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  }
}

// FLEXPERT_FAULT=device-lost:RANK:STEPS (tests): the first incarnation of RANK fails its
// step after STEPS busy steps as a device that failed for good would (Model::device_lost).
// Returns the steps, or -1 when this rank has no such fault.
int device_lost_fault(int rank, uint64_t incarnation) {
  const char* fault = std::getenv("FLEXPERT_FAULT");
  int r = -1, steps = -1;
  if (fault == nullptr || std::sscanf(fault, "device-lost:%d:%d", &r, &steps) != 2) return -1;
  return r == rank && incarnation == 1 ? steps : -1;
}

void on_terminate(int) { g_terminate.store(true); }
void on_leave(int) { g_leave.store(true); }

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

Status Worker::connect_and_configure() {
  std::mt19937_64 rng(std::random_device{}());
  const std::string routing_id = "r" + std::to_string(options_.rank) + "-" +
                                 std::to_string(getpid()) + "-" + std::to_string(rng() % 1000000);
  FLEX_RETURN_IF_ERROR(control_.set_routing_id(routing_id));
  FLEX_RETURN_IF_ERROR(control_.connect(options_.endpoint));
  proto::Hello hello;
  hello.rank = options_.rank;
  hello.pid = getpid();
  hello.key = options_.cluster_key;
  FLEX_RETURN_IF_ERROR(send_msg(control_, hello));
  FLEX_ASSIGN_OR_RETURN(auto parts, control_.recv(options_.connect_timeout_ms));
  if (parts.size() != 2 || parts[0] != proto::WorkerConfig::kType) {
    if (parts.size() == 2 && parts[0] == proto::WorkerError::kType) {
      FLEX_ASSIGN_OR_RETURN(auto err, proto::decode<proto::WorkerError>(parts[1]));
      return failed_precondition("front end refused the hello: " + err.message);
    }
    return data_loss("expected a configuration from the front end");
  }
  FLEX_ASSIGN_OR_RETURN(config_, proto::decode<proto::WorkerConfig>(parts[1]));
  if (options_.rank == kAutoRank) {
    options_.rank = config_.rank;
    FLEX_LOG(INFO) << "joined as rank " << options_.rank;
  }
  heartbeat_ = std::thread([this, routing_id] {
    name_this_thread("fx-heartbeat");
    heartbeat_loop(routing_id);
  });
  return Status();
}

void Worker::heartbeat_loop(std::string routing_id) {
  ZmqSocket socket(ctx_, ZMQ_DEALER);
  if (!socket.set_routing_id(routing_id + proto::Heartbeat::kHeartbeatSuffix).ok() ||
      !socket.connect(options_.endpoint).ok()) {
    FLEX_LOG(ERROR) << "rank " << options_.rank << ": no heartbeat socket";
    return;
  }
  const proto::Heartbeat beat{options_.rank, config_.incarnation};
  constexpr int kPollMs = 20;  // How long stop_heartbeat() may wait for this thread.
  auto next_beat = std::chrono::steady_clock::now();
  int64_t next_step_report = 0;
  for (;;) {
    {
      MutexLock lock(heartbeat_mutex_);
      if (heartbeat_stop_) return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_beat) {
      (void)send_msg(socket, beat);
      next_beat = now + std::chrono::milliseconds(proto::Heartbeat::kHeartbeatIntervalMs);
    }
    if (const int64_t started = step_started_ns_.load();
        started != 0 && now_ns() - started > kLongStepReportNs && now_ns() >= next_step_report) {
      FLEX_LOG(WARN) << "rank " << options_.rank << ": a step running for "
                     << (now_ns() - started) / 1'000'000 << " ms, in " << step_part_.load();
      next_step_report = now_ns() + kLongStepReportNs;
    }
    auto parts = socket.recv(kPollMs);
    if (parts.ok()) on_peer_lost(parts.value());
  }
}

void Worker::on_peer_lost(const std::vector<std::string>& parts) {
  if (parts.size() != 2 || parts[0] != proto::PeerLost::kType) return;
  auto msg = proto::decode<proto::PeerLost>(parts[1]);
  // Our own loss comes as Shutdown{kFenced} on the control socket.
  if (!msg.ok() || msg->rank == options_.rank) return;
  MutexLock lock(heartbeat_mutex_);
  if (lost_sink_ == nullptr) return;  // Not loaded yet: nothing waits on anyone.
  if (!peer_incarnations_.applies(*msg)) {
    // Sent before the id's next incarnation joined; we attached that one already.
    FLEX_LOG(INFO) << "rank " << options_.rank << ": ignoring a stale loss of peer " << msg->rank
                   << " incarnation " << msg->incarnation << " (attached: incarnation "
                   << peer_incarnations_.attached(msg->rank) << ")";
    return;
  }
  const Status s =
      lost_sink_->mark_peer_lost(msg->rank, "the front end declared it lost (" + msg->why + ")");
  FLEX_LOG(INFO) << "rank " << options_.rank << ": peer " << msg->rank << " incarnation "
                 << msg->incarnation << " lost: " << msg->why
                 << (s.ok() ? "" : " (" + s.to_string() + ")");
}

Status Worker::load() {
  FLEX_ASSIGN_OR_RETURN(model_config_, ModelConfig::load(config_.model_dir));
  TransportOptions topts;
  topts.session = config_.session;
  topts.rank = options_.rank;
  topts.incarnation = config_.incarnation;
  topts.max_ranks = config_.max_ranks;
  topts.max_gather_bytes = sizeof(StepHeader);
  // A step carries at most the token budget, or one decode token per sequence when
  // more sequences run than the budget: the worst case of one rank to one peer.
  topts.max_exchange_bytes = EpMoeExecutor::max_exchange_bytes(
      std::max(config_.max_tokens_per_step, config_.max_sequences),
      model_config_.num_experts_per_tok, model_config_.hidden_size);
  topts.timeout_ms = config_.timeout_ms;
  std::string backend = config_.transport;
  if ((backend == "shm" || backend == "hier") && gpu_ordinal(config_.device) >= 0) {
    // A GPU rank: the device exchange and slot copies read peers' GPU memory through the
    // transport's mapped peer buffers (docs/ARCHITECTURE.md), which cuda_ipc has; its
    // collectives and regions stay in host shared memory, as shm's. hier takes cuda_ipc so
    // within the host (its peers on other hosts are not mappable: host paths).
    if (backend == "shm") backend = "cuda_ipc";
    topts.host_collectives = true;
    topts.device = gpu_ordinal(config_.device);
  }
  FLEX_ASSIGN_OR_RETURN(transport_, create_transport(backend, topts));
  {
    MutexLock lock(heartbeat_mutex_);
    lost_sink_ = transport_.get();
  }
  ThreadPool& pool = ThreadPool::global();
  executor_ = std::make_unique<EpMoeExecutor>(*transport_, config_.slots_per_rank, pool);
  executor_->set_timing(config_.step_timing);

  ModelOptions mopts;
  FLEX_ASSIGN_OR_RETURN(mopts.expert_placement,
                        from_wire(config_.placement, model_config_.num_hidden_layers,
                                  std::max(1, model_config_.num_experts)));
  mopts.max_sequences = config_.max_sequences;
  mopts.max_seq_len = config_.max_seq_len;
  mopts.first_slot = options_.rank * config_.slots_per_rank;
  mopts.num_local_slots = config_.slots_per_rank;
  mopts.allocate_slots = [this](int layer, size_t bytes) -> Result<void*> {
    FLEX_ASSIGN_OR_RETURN(Region region, transport_->allocate_region(layer, bytes));
    return region.data;
  };
  mopts.moe_executor = executor_.get();
  mopts.device = config_.device;
  mopts.device_dtype = config_.device_f32 ? DType::kF32 : DType::kBF16;
  mopts.quantization = config_.quantization;
  FLEX_ASSIGN_OR_RETURN(model_, Model::load(config_.model_dir, mopts));
  // Before Ready: a joiner captures its graphs while the group serves without it.
  const auto t0 = std::chrono::steady_clock::now();
  FLEX_RETURN_IF_ERROR(model_->warm_up().annotate("warm-up"));
  const double warm_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (model_->num_graph_captures() > 0) {
    FLEX_LOG(INFO) << "rank " << options_.rank << " warmed up: " << model_->num_graph_captures()
                   << " graphs captured in " << warm_ms << " ms";
  }
  scheduler_ = std::make_unique<Scheduler>(
      SchedulerLimits{model_config_.vocab_size, model_->max_sequences(), model_->max_seq_len(),
                      config_.max_tokens_per_step, model_config_.eos_token_ids});
  proto::Ready ready;
  ready.rank = options_.rank;
  ready.incarnation = config_.incarnation;
  ready.transport_address = transport_->address();
  ready.vocab_size = model_config_.vocab_size;
  ready.max_seq_len = model_->max_seq_len();
  return send_msg(control_, ready);
}

Status Worker::apply_epoch(const proto::EpochCommand& cmd) {
  const bool member = Group{cmd.epoch, cmd.members}.contains(options_.rank);
  if (!member) {
    // Left out (scale-down): stop stepping; the front end moved our requests.
    for (int r : group_.ranks) {
      if (r != options_.rank) (void)transport_->disconnect(r);
    }
    group_ = Group{cmd.epoch, {}};
    executor_->set_group(group_);
    halted_ = false;
    has_pending_ = false;
    FLEX_LOG(INFO) << "rank " << options_.rank << " left the group in epoch " << cmd.epoch;
    return send_msg(control_, proto::EpochApplied{cmd.epoch, false});
  }
  {
    MutexLock lock(heartbeat_mutex_);
    peer_incarnations_.attach(cmd);
  }
  for (int r : cmd.members) {
    if (r == options_.rank) continue;
    if (r < 0 || r >= static_cast<int>(cmd.addresses.size()) || cmd.addresses[r].empty()) {
      return invalid_argument("epoch " + std::to_string(cmd.epoch) + " has no address for rank " +
                              std::to_string(r));
    }
    FLEX_RETURN_IF_ERROR(transport_->connect(r, cmd.addresses[r]));
  }
  for (int r : group_.ranks) {
    if (r != options_.rank && !Group{cmd.epoch, cmd.members}.contains(r)) {
      (void)transport_->disconnect(r);  // A departed peer: nothing left to read from it.
    }
  }
  if (!cmd.placement.empty()) {
    FLEX_ASSIGN_OR_RETURN(ExpertPlacement next,
                          from_wire(cmd.placement, model_config_.num_hidden_layers,
                                    std::max(1, model_config_.num_experts)));
    FLEX_RETURN_IF_ERROR(model_->set_placement(std::move(next)));
    map_version_ = std::max(map_version_, cmd.map_version);
    if (has_pending_map_ && pending_map_.version <= map_version_) has_pending_map_ = false;
  }
  group_ = Group{cmd.epoch, cmd.members};
  executor_->set_group(group_);
  halted_ = false;
  // A command held for a header agreement that can no longer happen is settled.
  if (has_pending_ && pending_.epoch <= cmd.epoch) has_pending_ = false;
  FLEX_LOG(INFO) << "rank " << options_.rank << " in epoch " << cmd.epoch << " with "
                 << cmd.members.size() << " members";
  log_steps_ = kLoggedStepsAfterEpoch;
  return send_msg(control_, proto::EpochApplied{cmd.epoch, true});
}

Status Worker::connect_peers(const proto::ConnectCommand& cmd) {
  if (cmd.ranks.size() != cmd.addresses.size()) return invalid_argument("bad connect command");
  {
    MutexLock lock(heartbeat_mutex_);
    peer_incarnations_.attach(cmd);
  }
  for (size_t i = 0; i < cmd.ranks.size(); ++i) {
    const int r = cmd.ranks[i];
    if (r == options_.rank) continue;
    if (cmd.addresses[i].empty()) {
      if (!group_.contains(r)) FLEX_RETURN_IF_ERROR(transport_->disconnect(r));
      continue;
    }
    FLEX_RETURN_IF_ERROR(transport_->connect(r, cmd.addresses[i]));
  }
  // Every connect before any probe: a probe may wait until the peer has connected back (over
  // UCX it needs the peer's region announcement), and a member answers its own command only
  // between steps, which wait on the members still probing. Probing as each connect is made
  // let a member wait on a joiner that waited on another member stuck in a step with it.
  for (size_t i = 0; i < cmd.ranks.size() && cmd.probe_region >= 0; ++i) {
    const int r = cmd.ranks[i];
    if (r == options_.rank || cmd.addresses[i].empty()) continue;
    // Exercise the attachment: a one-sided read of the peer's first expert bytes.
    char probe[64];
    FLEX_RETURN_IF_ERROR(
        transport_->read(r, cmd.probe_region, 0, probe, sizeof(probe)).annotate("probe"));
  }
  return Status();
}

Status Worker::handle(const std::vector<std::string>& parts) {
  if (parts.size() != 2)
    return data_loss("control message with " + std::to_string(parts.size()) + " frames");
  const std::string& type = parts[0];
  if (type == proto::AddRequest::kType) {
    FLEX_ASSIGN_OR_RETURN(auto req, proto::decode<proto::AddRequest>(parts[1]));
    Status valid = scheduler_->validate(req.prompt, req.params);
    if (!valid.ok()) {
      // The front end validates first; this only guards against a mismatch.
      proto::TokenBatch batch;
      batch.ids.push_back(req.id);
      batch.tokens.push_back(-1);
      batch.finish_reasons.push_back("error: " + valid.message());
      batch.attempts.push_back(req.attempt);
      return send_msg(control_, batch);
    }
    attempts_[req.id] = req.attempt;
    scheduler_->add(req.id, std::move(req.prompt), std::move(req.params), req.num_generated);
  } else if (type == proto::CancelRequest::kType) {
    FLEX_ASSIGN_OR_RETURN(auto req, proto::decode<proto::CancelRequest>(parts[1]));
    scheduler_->cancel(req.id);
    attempts_.erase(req.id);
  } else if (type == proto::EpochCommand::kType) {
    FLEX_ASSIGN_OR_RETURN(auto cmd, proto::decode<proto::EpochCommand>(parts[1]));
    if (cmd.epoch <= group_.epoch) return Status();  // Stale.
    if (halted_ || group_.ranks.empty()) {
      // Not stepping with anyone: switch now. (A halted rank's peers are halted too.)
      return apply_epoch(cmd);
    }
    pending_ = std::move(cmd);
    has_pending_ = true;
  } else if (type == proto::PullCommand::kType) {
    FLEX_ASSIGN_OR_RETURN(auto cmd, proto::decode<proto::PullCommand>(parts[1]));
    {
      MutexLock lock(mover_mutex_);
      pulls_.push_back(std::move(cmd));
    }
    mover_cv_.notify_one();
  } else if (type == proto::MapCommand::kType) {
    FLEX_ASSIGN_OR_RETURN(auto cmd, proto::decode<proto::MapCommand>(parts[1]));
    if (cmd.version <= map_version_) return Status();
    pending_map_ = std::move(cmd);
    has_pending_map_ = true;
  } else if (type == proto::ConnectCommand::kType) {
    FLEX_ASSIGN_OR_RETURN(auto cmd, proto::decode<proto::ConnectCommand>(parts[1]));
    if (group_.ranks.empty()) inject_join_fault();
    Status s = connect_peers(cmd);
    return send_msg(
        control_, proto::Connected{cmd.id, static_cast<int>(s.code()), s.ok() ? "" : s.message()});
  } else if (type == proto::Shutdown::kType) {
    FLEX_ASSIGN_OR_RETURN(auto cmd, proto::decode<proto::Shutdown>(parts[1]));
    if (cmd.reason == proto::Shutdown::kLeave) {
      leaving_ = true;
    } else if (cmd.reason == proto::Shutdown::kFenced) {
      fenced_ = true;
    } else {
      stopping_ = true;
    }
  } else {
    FLEX_LOG(WARN) << "rank " << options_.rank << " ignores control message '" << type << "'";
  }
  return Status();
}

Status Worker::poll_control(int timeout_ms) {
  for (;;) {
    auto parts = control_.recv(timeout_ms);
    if (!parts.ok()) {
      if (parts.status().code() == StatusCode::kDeadlineExceeded) return Status();
      return parts.status();
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (Status s = handle(parts.value()); !s.ok()) {
      // A bad or unusable command is reported, not fatal: the front end decides.
      report_error(s);
      halted_ = !group_.ranks.empty();
    }
    if (const double ms = ms_since(t0); ms > kSlowGapMs) {
      FLEX_LOG(INFO) << "rank " << options_.rank << ": control message '" << parts.value()[0]
                     << "' took " << ms << " ms";
    }
    timeout_ms = 0;  // Drain what else is queued, then go.
  }
}

void Worker::report(bool force) {
  const auto now = std::chrono::steady_clock::now();
  if (!force && now - last_report_ < std::chrono::milliseconds(200)) return;
  last_report_ = now;
  proto::StepReport r;
  r.epoch = group_.epoch;
  r.steps = steps_;
  r.step_ms = busy_steps_ ? busy_ms_ / static_cast<double>(busy_steps_) : 0.0;
  r.max_step_ms = max_step_ms_;
  r.running = static_cast<int>(scheduler_->num_running());
  r.waiting = static_cast<int>(scheduler_->num_waiting());
  r.map_version = map_version_;
  r.graph_captures = model_->num_graph_captures();
  r.total_step_ms = total_step_ms_;
  r.total_header_ms = total_header_ms_;
  r.total_exchange_ms = executor_->timing() ? executor_->exchange_ms() : -1;
  const auto& counts = model_->slot_counts();
  const int first = options_.rank * config_.slots_per_rank;
  for (const auto& layer : counts) {
    for (int i = 0; i < config_.slots_per_rank; ++i) r.slot_counts.push_back(layer[first + i]);
  }
  model_->reset_slot_counts();
  busy_ms_ = 0;
  max_step_ms_ = 0;
  busy_steps_ = 0;
  (void)send_msg(control_, r);
}

Status Worker::step() {
  const std::vector<SequenceChunk>& batch = scheduler_->build_step();
  StepHeader header;
  for (const auto& chunk : batch) header.num_tokens += static_cast<uint32_t>(chunk.tokens.size());
  header.stopping = stopping_ ? 1 : 0;
  header.acked_epoch = has_pending_ ? pending_.epoch : group_.epoch;
  header.acked_map = has_pending_map_ ? pending_map_.version : map_version_;
  header.device_ready = executor_->device_ready() ? 1 : 0;
  // Three clock reads a step (tens of nanoseconds against steps of milliseconds).
  const auto header_start = std::chrono::steady_clock::now();
  step_part_.store("its header's all_gather");
  if (!idle_ && last_step_end_ != std::chrono::steady_clock::time_point{}) {
    if (const double gap = ms_since(last_step_end_); gap > kSlowGapMs) {
      FLEX_LOG(INFO) << "rank " << options_.rank << " epoch " << group_.epoch << ": " << gap
                     << " ms since its last busy step";
    }
  }
  FLEX_ASSIGN_OR_RETURN(std::vector<ByteSpan> headers,
                        transport_->all_gather(group_, {&header, sizeof(header)}));
  const double header_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - header_start)
          .count();
  uint64_t total_tokens = 0;
  bool any_stopping = false;
  bool all_acked = has_pending_;
  bool map_acked = has_pending_map_;
  bool device_ready = true;
  for (int r : group_.ranks) {
    StepHeader h;
    std::memcpy(&h, headers[r].data, sizeof(h));
    total_tokens += h.num_tokens;
    any_stopping |= h.stopping != 0;
    device_ready = device_ready && h.device_ready != 0;
    // Equality, not >=: ranks holding different commands must all decide the same.
    if (has_pending_ && h.acked_epoch != pending_.epoch) all_acked = false;
    if (has_pending_map_ && h.acked_map != pending_map_.version) map_acked = false;
  }
  if (any_stopping) {
    stopping_ = true;
    return Status();
  }
  idle_ = total_tokens == 0;
  const bool log_this = log_steps_ > 0;
  if (log_this && idle_) {
    FLEX_LOG(INFO) << "rank " << options_.rank << " epoch " << group_.epoch
                   << ": an idle step, its header " << header_ms << " ms";
  }
  log_steps_ = std::max(0, log_steps_ - 1);
  executor_->set_step_tokens(static_cast<int64_t>(total_tokens));
  executor_->set_group_device_ready(device_ready);
  if (!idle_) {
    const auto t0 = std::chrono::steady_clock::now();
    step_part_.store("the forward pass");
    if (device_lost_after_ > 0 && --device_lost_after_ == 0) {
      return internal_error("FLEXPERT_FAULT=device-lost: an injected device failure");
    }
    FLEX_RETURN_IF_ERROR(
        model_->forward_step(batch, scheduler_->row_outputs(), &logits_, &tokens_));
    events_.clear();
    scheduler_->complete_step(logits_, tokens_, &events_);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (ms > kSlowStepMs || header_ms > kSlowStepMs || log_this) {
      FLEX_LOG(INFO) << "rank " << options_.rank << " epoch " << group_.epoch << ": a step of "
                     << header.num_tokens << " tokens (group " << total_tokens << ") took " << ms
                     << " ms, its header " << header_ms << " ms";
    }
    last_step_end_ = std::chrono::steady_clock::now();
    busy_ms_ += ms;
    total_step_ms_ += ms;
    total_header_ms_ += header_ms;
    max_step_ms_ = std::max(max_step_ms_, ms);
    ++busy_steps_;
    ++steps_;
    if (!events_.empty()) {
      proto::TokenBatch out;
      const bool any_logprobs = std::any_of(events_.begin(), events_.end(),
                                            [](const TokenEvent& ev) { return ev.has_logprob; });
      for (const TokenEvent& ev : events_) {
        if (any_logprobs) out.logprobs.push_back(ev.logprob);
        out.ids.push_back(ev.request_id);
        out.tokens.push_back(ev.token);
        out.finish_reasons.push_back(ev.finished ? ev.finish_reason : "");
        auto a = attempts_.find(ev.request_id);
        out.attempts.push_back(a == attempts_.end() ? 0 : a->second);
        if (ev.finished && a != attempts_.end()) attempts_.erase(a);
      }
      FLEX_RETURN_IF_ERROR(send_msg(control_, out));
    }
  }
  // Every member saw the same headers: all switch at this boundary, or none.
  if (map_acked) {
    has_pending_map_ = false;
    FLEX_ASSIGN_OR_RETURN(ExpertPlacement next,
                          from_wire(pending_map_.placement, model_config_.num_hidden_layers,
                                    std::max(1, model_config_.num_experts)));
    FLEX_RETURN_IF_ERROR(model_->set_placement(std::move(next)));
    map_version_ = pending_map_.version;
    FLEX_RETURN_IF_ERROR(send_msg(control_, proto::MapApplied{map_version_}));
  }
  if (all_acked) {
    has_pending_ = false;
    FLEX_RETURN_IF_ERROR(apply_epoch(pending_));
  }
  return Status();
}

proto::PullDone Worker::pull(const proto::PullCommand& cmd) {
  proto::PullDone done;
  done.id = cmd.id;
  const auto t0 = std::chrono::steady_clock::now();
  ExpertSlots* slots = model_->local_slots(cmd.layer);
  Status s;
  if (slots == nullptr || cmd.dst_slots.size() != cmd.src_ranks.size() ||
      cmd.dst_slots.size() != cmd.src_slots.size()) {
    s = invalid_argument("bad pull command for layer " + std::to_string(cmd.layer));
  }
  for (size_t i = 0; s.ok() && i < cmd.dst_slots.size(); ++i) {
    const int dst = cmd.dst_slots[i];
    const bool from_checkpoint = cmd.src_ranks[i] == proto::PullCommand::kFromCheckpoint;
    if (dst < 0 || dst >= slots->num_slots() || cmd.src_slots[i] < 0 ||
        (!from_checkpoint && cmd.src_slots[i] >= slots->num_slots())) {
      s = invalid_argument("pull slot out of range");
      break;
    }
    const size_t bytes = slots->slot_bytes();
    // Regions are per layer; a slot's weights are one contiguous block in it.
    if (cmd.src_ranks[i] == proto::PullCommand::kFromCheckpoint) {
      s = model_->load_expert(cmd.layer, cmd.src_slots[i], dst);
    } else {
      // Device to device where the model can (GPU ranks: a copy engine reads the peer's
      // slot through CUDA IPC), else through the host mirrors.
      s = model_->copy_slot(cmd.layer, dst, cmd.src_ranks[i], cmd.src_slots[i]);
      if (s.code() != StatusCode::kUnimplemented) {
        if (s.ok()) ++done.device_copies;
      } else if (cmd.src_ranks[i] == options_.rank) {
        std::memcpy(slots->slot_data(dst), slots->slot_data(cmd.src_slots[i]), bytes);
        s = model_->slots_written(cmd.layer, dst);
      } else {
        s = transport_->read(cmd.src_ranks[i], cmd.layer, cmd.src_slots[i] * bytes,
                             slots->slot_data(dst), bytes);
        // A GPU model uploads the slot now: PullDone (and so any map using it) comes after.
        if (s.ok()) s = model_->slots_written(cmd.layer, dst);
      }
    }
    if (s.ok()) done.num_bytes += bytes;
  }
  done.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  done.code = static_cast<int>(s.code());
  done.message = s.ok() ? "" : s.message();
  return done;
}

void Worker::mover_loop() {
  MutexLock lock(mover_mutex_);
  for (;;) {
    mover_cv_.wait(lock, [&]() REQUIRES(mover_mutex_) { return mover_stop_ || !pulls_.empty(); });
    if (mover_stop_) return;
    proto::PullCommand cmd = std::move(pulls_.front());
    pulls_.pop_front();
    lock.unlock();
    proto::PullDone done = pull(cmd);  // Destination slots are free in the current map.
    lock.lock();
    pulled_.push_back(std::move(done));
  }
}

void Worker::send_pull_results() {
  std::deque<proto::PullDone> done;
  {
    MutexLock lock(mover_mutex_);
    done.swap(pulled_);
  }
  for (const auto& d : done) (void)send_msg(control_, d);
}

bool Worker::leave_now() {
  if (!g_leave.load()) return false;
  // Not a member (a spare, a joiner, or already left): nothing to hand over.
  if (group_.ranks.empty()) return true;
  if (!leave_requested_) {
    // Longer than the front end waits for a scale to become possible (serve_leaves()).
    constexpr auto kLeaveTimeout = std::chrono::seconds(90);
    FLEX_LOG(INFO) << "rank " << options_.rank << ": SIGTERM, asking the front end to leave";
    (void)send_msg(control_, proto::LeaveRequest{options_.rank, config_.incarnation});
    leave_requested_ = true;
    leave_deadline_ = std::chrono::steady_clock::now() + kLeaveTimeout;
    return false;
  }
  return std::chrono::steady_clock::now() > leave_deadline_;
}

void Worker::exit_if_device_lost() {
  if (model_ == nullptr) return;
  const Status lost = device_lost_after_ == 0
                          ? internal_error("FLEXPERT_FAULT=device-lost: an injected device failure")
                          : model_->device_lost();
  if (lost.ok()) return;
  FLEX_LOG(ERROR) << "rank " << options_.rank << ": its device failed for good ("
                  << lost.to_string() << "); exiting so that the group replaces it";
  // No destructors or joins: they would call into the failed context (a thread may be
  // waiting in it).
  _exit(5);
}

int Worker::run() {
  if (Status s = connect_and_configure(); !s.ok()) {
    FLEX_LOG(ERROR) << "rank " << options_.rank << ": " << s.to_string();
    return 1;
  }
  if (Status s = load(); !s.ok()) {
    FLEX_LOG(ERROR) << "rank " << options_.rank << " failed to load: " << s.to_string();
    proto::WorkerError err{0, static_cast<int>(s.code()), s.message()};
    (void)send_msg(control_, err);
    return 1;
  }
  device_lost_after_ = device_lost_fault(options_.rank, config_.incarnation);
  mover_ = std::thread([this] {
    name_this_thread("fx-mover");
    mover_loop();
  });
  int exit_code = 0;
  while (!g_terminate.load()) {
    if (leave_now()) {
      if (leave_requested_ && !group_.ranks.empty()) {
        FLEX_LOG(ERROR) << "rank " << options_.rank << ": the front end did not remove us in "
                        << "time; exiting while still a member";
        exit_code = 1;
      }
      break;
    }
    send_pull_results();
    // Idle or halted ranks wait on the control socket; busy ones only drain it.
    // Halted ranks and non-members (joiners, spares) wait for commands: a recovery waits
    // for their PullDone and epoch acknowledgements, so they answer within 1 ms.
    const int wait_ms = halted_ || group_.ranks.empty() ? 1 : (idle_ ? 2 : 0);
    if (Status s = poll_control(wait_ms); !s.ok()) {
      FLEX_LOG(ERROR) << "rank " << options_.rank << " lost the front end: " << s.to_string();
      break;
    }
    if (fenced_) {
      // Replaced while silent (stopped, cut off): the group goes on without us.
      FLEX_LOG(WARN) << "rank " << options_.rank << " incarnation " << config_.incarnation
                     << " was declared lost; exiting";
      stop_heartbeat();
      stop_mover();
      _exit(4);
    }
    if (halted_ && has_pending_) {
      // An epoch command that arrived before the step failed: nobody can agree on
      // it in the old epoch any more; the front end sent it to every member.
      proto::EpochCommand cmd = pending_;
      has_pending_ = false;
      if (Status s = apply_epoch(cmd); !s.ok()) report_error(s);
    }
    if (halted_ || group_.ranks.empty()) {
      if (stopping_ || (leaving_ && group_.ranks.empty())) break;
      // Not stepping: peers may still read our slots (a member probing a joiner, a replacement
      // probing a halted survivor), which over UCX's TCP needs our progress.
      if (transport_) transport_->progress();
      report(false);
      continue;
    }
    step_started_ns_.store(now_ns());
    Status s = step();
    step_started_ns_.store(0);
    if (stopping_) break;
    if (!s.ok()) {
      // A dead or silent peer, or an epoch change we were not part of: report and
      // wait for the front end's decision (a new epoch or a shutdown).
      FLEX_LOG(WARN) << "rank " << options_.rank << " step failed in epoch " << group_.epoch << ": "
                     << s.to_string();
      halted_ = true;
      proto::WorkerError err{group_.epoch, static_cast<int>(s.code()), s.message()};
      err.dead_rank = s.dead_rank();  // A peer whose process the transport saw end.
      (void)send_msg(control_, err);
      exit_if_device_lost();
    }
    report(false);
  }
  report(true);
  stop_heartbeat();
  stop_mover();  // Before the slot regions it writes into are unmapped.
  if (transport_) (void)transport_->shutdown();
  return exit_code;
}

}  // namespace

int run_worker(const WorkerOptions& options) {
  // A worker the front end started (serve/launcher.cc sets FLEXPERT_PARENT_PID) dies with it
  // (no orphans): SIGINT, not SIGTERM, since with no front end there is nobody to ask for a
  // leave. A hand-started or orchestrated one outlives whatever started it (a launch
  // command's shell exits at once).
  if (const char* parent = std::getenv("FLEXPERT_PARENT_PID");
      parent != nullptr && std::atoi(parent) == static_cast<int>(getppid())) {
    prctl(PR_SET_PDEATHSIG, SIGINT);
    if (getppid() != std::atoi(parent)) return 1;  // The front end ended before the prctl.
  }
  struct sigaction sa {};
  sa.sa_handler = on_terminate;
  sigaction(SIGINT, &sa, nullptr);
  struct sigaction leave {};
  leave.sa_handler = on_leave;
  sigaction(SIGTERM, &leave, nullptr);
  sigset_t stop_signals;  // A blocked mask may be inherited from whoever started us.
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
  Worker worker(options);
  return worker.run();
}

}  // namespace flexpert
