// SPDX-License-Identifier: Apache-2.0
// The worker's control side: joining the front end, the heartbeat thread, control messages,
// epoch and connect commands, leaving, and the fault injection of tests (worker_impl.h).
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "cluster/protocol.h"
#include "core/thread_name.h"
#include "engine/placement_wire.h"
#include "engine/worker_impl.h"
#include "flexpert/logging.h"

namespace flexpert::engine_detail {
namespace {

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

}  // namespace

namespace {

// FLEXPERT_FAULT=NAME:RANK:STEPS: STEPS for the first incarnation of RANK, else -1.
int rank_fault(const char* name, int rank, uint64_t incarnation) {
  const char* fault = std::getenv("FLEXPERT_FAULT");
  int r = -1, steps = -1;
  if (fault == nullptr || std::strncmp(fault, name, std::strlen(name)) != 0 ||
      std::sscanf(fault + std::strlen(name), ":%d:%d", &r, &steps) != 2) {
    return -1;
  }
  return r == rank && incarnation == 1 ? steps : -1;
}

}  // namespace

int device_lost_fault(int rank, uint64_t incarnation) {
  return rank_fault("device-lost", rank, incarnation);
}

int step_hang_fault(int rank, uint64_t incarnation) {
  return rank_fault("step-hang", rank, incarnation);
}

int64_t stuck_step_limit_ns(int timeout_ms) {
  if (const char* v = std::getenv("FLEXPERT_STUCK_STEP_MS"); v != nullptr && std::atoi(v) > 0) {
    return int64_t{1'000'000} * std::atoi(v);
  }
  return std::max(kStuckStepLimitNs, int64_t{2'000'000} * std::max(timeout_ms, 0));
}

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
  const int64_t stuck_limit_ns = stuck_step_limit_ns(config_.timeout_ms);
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
      const int64_t running = now_ns() - started;
      if (running > stuck_limit_ns) {
        FLEX_LOG(ERROR) << "rank " << options_.rank << ": a step running for "
                        << running / 1'000'000 << " ms, in " << step_part_.load()
                        << ", cannot end; exiting";
        std::abort();
      }
      FLEX_LOG(WARN) << "rank " << options_.rank << ": a step running for " << running / 1'000'000
                     << " ms, in " << step_part_.load();
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
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < cmd.ranks.size(); ++i) {
    const int r = cmd.ranks[i];
    if (r == options_.rank) continue;
    if (cmd.addresses[i].empty()) {
      if (!group_.contains(r)) FLEX_RETURN_IF_ERROR(transport_->disconnect(r));
      continue;
    }
    FLEX_RETURN_IF_ERROR(transport_->connect(r, cmd.addresses[i]));
  }
  const double connect_ms = ms_since(t0);
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
  if (const double ms = ms_since(t0); ms > slow_gap_ms()) {
    FLEX_LOG(INFO) << "rank " << options_.rank << ": connect: transport " << connect_ms
                   << " ms, probes " << ms - connect_ms << " ms";
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
    if (const double ms = ms_since(t0); ms > slow_gap_ms()) {
      FLEX_LOG(INFO) << "rank " << options_.rank << ": control message '" << parts.value()[0]
                     << "' took " << ms << " ms";
    }
    timeout_ms = 0;  // Drain what else is queued, then go.
  }
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

}  // namespace flexpert::engine_detail
