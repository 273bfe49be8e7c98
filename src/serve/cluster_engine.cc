// SPDX-License-Identifier: Apache-2.0
#include "serve/cluster_engine.h"
#include "serve/cluster_engine_impl.h"

#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <thread>

#include "cluster/protocol.h"
#include "cluster/zmq_socket.h"
#include "core/secret.h"
#include "core/thread_name.h"
#include "engine/placement_wire.h"
#include "flexpert/generate.h"
#include "flexpert/logging.h"
#include "flexpert/model.h"
#include "flexpert/model_config.h"
#include "flexpert/placement.h"

namespace flexpert {
namespace {

// A control-loop iteration's work, or a silence of the workers' tokens while requests are
// open, longer than this is logged (where a stall sits in the front end).
constexpr double kSilenceLogMs = 100;

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "flexpert";
}

}  // namespace

Status ClusterEngine::Impl::launch(int rank) {
  FLEX_ASSIGN_OR_RETURN(const pid_t pid, launcher_->launch(rank, incarnation(rank)));
  ranks_[rank].pid = pid;
  ranks_[rank].spawned = launcher_->owns_workers();
  return Status();
}

void ClusterEngine::Impl::fail_launches() {
  for (const FailedLaunch& f : launcher_->poll_failed()) {
    RankInfo& info = ranks_[f.rank];
    // Only while that incarnation still waits for its worker.
    if (incarnation(f.rank) != f.incarnation || state(f.rank) != RankState::kStarting ||
        !info.routing_id.empty()) {
      continue;
    }
    info.last_error = f.why;
    if (epoch() == 0 && start_error_.ok()) {
      start_error_ = unavailable("rank " + std::to_string(f.rank) + ": " + f.why);
    }
    membership_.mark_lost(f.rank);
    rank_reaped(f.rank);  // Nothing of it runs.
    cv_.notify_all();
  }
}

Status ClusterEngine::Impl::start() {
  create_metrics();
  FLEX_ASSIGN_OR_RETURN(model_config_, ModelConfig::load(options_.model_dir));
  FLEX_RETURN_IF_ERROR(check_quantization(options_.device, options_.quantization));
  if (options_.ranks < 1) return invalid_argument("--ranks must be >= 1");
  if (options_.max_ranks == 0) options_.max_ranks = options_.ranks;
  if (options_.max_ranks < options_.ranks)
    return invalid_argument("--max-ranks must be >= --ranks");
  if (options_.spare_ranks < 0 || options_.ranks + options_.spare_ranks > options_.max_ranks) {
    return invalid_argument("--spare-ranks must be in [0, --max-ranks - --ranks]");
  }
  if (const char* loading = std::getenv("CUDA_MODULE_LOADING");
      options_.device.rfind("cuda", 0) == 0 && loading != nullptr &&
      std::string(loading) == "EAGER") {
    // Measured on an H200 (docs/benchmarks.md): 34-36 ms against 9-11 ms at a scale-up.
    FLEX_LOG(WARN) << "CUDA_MODULE_LOADING=EAGER: a joining rank loads every kernel while it "
                      "prepares, which stalls the serving ranks; serve with lazy loading";
  }
  const int E = std::max(1, model_config_.num_experts);
  std::vector<int> members;
  for (int r = 0; r < options_.ranks; ++r) members.push_back(r);
  int extra = 0;
  uint64_t seed = 0;
  const std::string& spec = options_.placement;
  if (spec.rfind("replicate:", 0) == 0) {
    unsigned s = 0;
    if (std::sscanf(spec.c_str(), "replicate:%d:%u", &extra, &s) < 1 || extra < 0) {
      return invalid_argument("bad --placement '" + spec + "' (want replicate:R[:SEED])");
    }
    seed = s;
  }
  // --min-replicas from the start: a lost rank then needs no reload.
  const bool spread = spec.empty() || spec == "identity" || extra > 0;
  if (options_.min_replicas > 1 && spread) {
    extra = std::max(extra, E * (options_.min_replicas - 1));
  }
  // No other thread runs yet: the lock costs nothing and keeps placement_ under its rule.
  MutexLock lock(mutex_);
  if (spec.empty() || spec == "identity" || spec.rfind("replicate:", 0) == 0) {
    // Capacity for the smallest group it may shrink to (docs/ARCHITECTURE.md, "Capacity").
    slots_per_rank_ = options_.slots_per_rank > 0
                          ? options_.slots_per_rank
                          : expert_slots_per_rank(E, extra, options_.ranks, options_.min_ranks,
                                                  options_.eplb_spare_slots);
    // --min-replicas auto: the second replicas go into slots sized for a smaller group.
    if (spread) extra = std::max(extra, E * (min_replicas_for(options_.ranks) - 1));
    FLEX_ASSIGN_OR_RETURN(
        placement_, ExpertPlacement::spread(model_config_.num_hidden_layers, E, options_.max_ranks,
                                            slots_per_rank_, members, extra, seed));
  } else {
    FLEX_ASSIGN_OR_RETURN(placement_,
                          ExpertPlacement::parse(spec, model_config_.num_hidden_layers, E));
    if (placement_.num_slots() % options_.max_ranks != 0) {
      return invalid_argument("placement has " + std::to_string(placement_.num_slots()) +
                              " slots, not a multiple of --max-ranks " +
                              std::to_string(options_.max_ranks));
    }
    slots_per_rank_ = placement_.num_slots() / options_.max_ranks;
  }
  load_ = eplb::LoadWindow(placement_.num_layers(), placement_.num_experts(),
                           options_.eplb_window_s, options_.eplb_smoothing);
  lock.unlock();
  max_seq_len_ = options_.max_seq_len > 0 ? options_.max_seq_len
                                          : std::min(model_config_.max_position_embeddings, 4096);
  session_ = std::to_string(getpid()) + "-" +
             std::to_string(Clock::now().time_since_epoch().count() % 1000000007);
  if (options_.cluster_key.empty() && options_.spawn_workers) {
    std::random_device rd;  // 128 bits from the kernel.
    char key[33];
    std::snprintf(key, sizeof(key), "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
    options_.cluster_key = key;
  }
  FLEX_RETURN_IF_ERROR(router_.bind(
      "tcp://" + options_.control_host + ":" +
      (options_.control_port ? std::to_string(options_.control_port) : std::string("*"))));
  FLEX_ASSIGN_OR_RETURN(endpoint_, router_.last_endpoint());
  if (options_.on_listening) options_.on_listening(endpoint_);
  const std::string wake = "inproc://wake-" + session_;
  FLEX_RETURN_IF_ERROR(wake_rx_.bind(wake));
  lock.lock();
  FLEX_RETURN_IF_ERROR(wake_tx_.connect(wake));
  LaunchConfig launch_config;
  launch_config.endpoint = endpoint_;
  launch_config.binary = options_.worker_binary.empty() ? self_exe() : options_.worker_binary;
  launch_config.cluster_key = options_.cluster_key;
  launch_config.threads =
      options_.threads_per_worker > 0
          ? options_.threads_per_worker
          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / options_.ranks);
  launch_config.command = options_.launch_command;
  launcher_ = make_launcher(!options_.spawn_workers, std::move(launch_config));
  ranks_.assign(static_cast<size_t>(options_.max_ranks), RankInfo{});
  membership_ = cluster::Membership(membership_config());
  (void)membership_.start(now_ms());  // Opens the initial ranks; spawned below.
  if (launcher_->starts_workers()) {
    for (int r : members) FLEX_RETURN_IF_ERROR(launch(r));
  }
  lock.unlock();
  FLEX_LOG(INFO) << "control plane at " << endpoint_ << "; waiting for " << options_.ranks
                 << " ranks (" << slots_per_rank_ << " expert slots each)";
  control_ = std::thread([this] { control_loop(); });
  lock.lock();
  const bool done =
      cv_.wait_for(lock, std::chrono::milliseconds(options_.start_timeout_ms),
                   [&]() REQUIRES(mutex_) { return epoch() > 0 || !start_error_.ok(); });
  if (!start_error_.ok()) return start_error_;
  if (!done)
    return deadline_exceeded("ranks did not become ready within " +
                             std::to_string(options_.start_timeout_ms) + " ms");
  accepting_ = true;
  target_ranks_ = options_.ranks;
  healer_ = std::thread([this] { heal_loop(); });
  if (options_.eplb) eplb_thread_ = std::thread([this] { eplb_loop(); });
  return Status();
}

void ClusterEngine::Impl::request_launch(int rank) {
  ranks_[rank].spawned = launcher_->owns_workers();
  launch_queue_.push_back(rank);
  wake();
}

int ClusterEngine::Impl::rank_of_routing_id(const std::string& id) const {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (ranks_[r].routing_id == id) return static_cast<int>(r);
  }
  return -1;
}

void ClusterEngine::Impl::wake() { (void)wake_tx_.send({"w"}); }

void ClusterEngine::Impl::commit_epoch(std::vector<int> members, const std::vector<int>& also) {
  std::vector<std::vector<int>> maps;
  for (int l = 0; l < placement_.num_layers(); ++l) maps.push_back(placement_.slot_map(l));
  // Every expert on a member of the new epoch, nothing on other ranks (the membership's rule).
  const Status m = membership_.record_maps(std::move(maps), members);
  FLEX_CHECK(m.ok()) << m.to_string();
  cluster::Actions actions;
  const Status s = membership_.commit_members(std::move(members), also, &actions);
  FLEX_CHECK(s.ok()) << s.to_string();  // The flows commit only ranks they saw Ready.
  for (const cluster::Action& a : actions) {
    if (a.kind == cluster::ActionKind::kCommit) send_epoch(a);
  }
}

void ClusterEngine::Impl::rank_reaped(int rank) {
  (void)membership_.reaped(rank, now_ms());  // Flows here open ids themselves.
}

void ClusterEngine::Impl::send_epoch(const cluster::Action& commit) {
  const std::vector<int>& members = commit.ranks;
  const std::vector<int>& also = commit.also;
  proto::EpochCommand cmd;
  cmd.epoch = commit.epoch;
  cmd.members = members;
  cmd.addresses.assign(ranks_.size(), "");
  cmd.incarnations.assign(ranks_.size(), 0);  // A stale PeerLost is told apart by it.
  for (int r : members) {
    cmd.addresses[r] = ranks_[r].address;
    cmd.incarnations[r] = incarnation(r);
  }
  cmd.placement = to_wire(placement_);
  cmd.map_version = ++map_version_;
  for (int r : members) {
    post(r, cmd);                          // The membership made it serving with the commit.
    ranks_[r].map_version = map_version_;  // Applied with the epoch.
  }
  for (int r : also) post(r, cmd);
  wake();
  cv_.notify_all();  // Waiters on acks of the old epoch give up.
  FLEX_LOG(INFO) << "epoch " << commit.epoch << ": " << members.size() << " serving ranks";
}

void ClusterEngine::Impl::flush_outbox() {
  std::deque<Outgoing> out;
  {
    MutexLock lock(mutex_);
    out.swap(outbox_);
  }
  for (auto& [rank, to_heartbeat, parts] : out) {
    std::string id;
    {
      MutexLock lock(mutex_);
      id = ranks_[rank].routing_id;
    }
    if (id.empty()) continue;
    if (to_heartbeat) id += proto::Heartbeat::kHeartbeatSuffix;
    parts.insert(parts.begin(), id);
    Status s = router_.send(parts);
    if (!s.ok()) {
      // A rank that left or died may be gone before its last messages.
      MutexLock lock(mutex_);
      const RankState st = state(rank);
      if (st == RankState::kStopped || st == RankState::kDead) {
        FLEX_LOG(DEBUG) << "send to departed rank " << rank << ": " << s.to_string();
      } else {
        FLEX_LOG(WARN) << "send to rank " << rank << ": " << s.to_string();
      }
    }
  }
}

std::string rank_device(const ClusterOptions& options, int rank) {
  if (options.device != "cuda" || options.gpus <= 1) return options.device;
  return "cuda:" + std::to_string(rank % options.gpus);
}

void ClusterEngine::Impl::handle(const std::string& routing_id, const std::string& type,
                                 const std::string& body, Calls* calls) {
  MutexLock lock(mutex_);
  if (type == proto::Hello::kType) {
    auto hello = proto::decode<proto::Hello>(body);
    if (!hello.ok()) return;
    // Who may join is decided by the key, not by a pid (which /proc shows to anyone).
    if (!options_.cluster_key.empty() && !same_secret(hello->key, options_.cluster_key)) {
      FLEX_LOG(WARN) << "refused a hello for rank " << hello->rank << " without the cluster key";
      proto::WorkerError err{epoch(), static_cast<int>(StatusCode::kFailedPrecondition),
                             "missing or wrong cluster key (FLEXPERT_CLUSTER_KEY or "
                             "--cluster-key-file)"};
      (void)router_.send({routing_id, proto::WorkerError::kType, proto::encode(err)});
      return;
    }
    Result<std::pair<int, uint64_t>> admitted = admit(hello->rank, hello->pid);
    if (!admitted.ok()) {
      proto::WorkerError err{epoch(), static_cast<int>(StatusCode::kFailedPrecondition),
                             admitted.status().message()};
      (void)router_.send({routing_id, proto::WorkerError::kType, proto::encode(err)});
      return;
    }
    const auto [r, incarnation] = admitted.value();
    RankInfo& info = ranks_[r];
    info.routing_id = routing_id;
    info.pid = hello->pid;  // Heard from now (hello() started its heartbeat clock).
    proto::WorkerConfig cfg;
    cfg.rank = r;
    cfg.incarnation = incarnation;
    cfg.session = session_;
    cfg.model_dir = options_.model_dir;
    cfg.max_ranks = options_.max_ranks;
    cfg.slots_per_rank = slots_per_rank_;
    cfg.placement = to_wire(placement_);
    cfg.max_sequences = options_.max_sequences;
    cfg.max_tokens_per_step = options_.max_tokens_per_step;
    cfg.max_seq_len = max_seq_len_;
    cfg.timeout_ms = options_.transport_timeout_ms;
    cfg.device = rank_device(options_, r);
    cfg.device_f32 = options_.device_f32;
    cfg.quantization = options_.quantization;
    cfg.transport = options_.transport;
    cfg.step_timing = options_.step_timing;
    post(r, cfg);
    return;
  }
  const std::string suffix = proto::Heartbeat::kHeartbeatSuffix;
  const bool heartbeat =
      type == proto::Heartbeat::kType && routing_id.size() > suffix.size() &&
      routing_id.compare(routing_id.size() - suffix.size(), suffix.size(), suffix) == 0;
  const std::string sender =
      heartbeat ? routing_id.substr(0, routing_id.size() - suffix.size()) : routing_id;
  const int rank = rank_of_routing_id(sender);
  if (rank < 0 || !membership_.accepts(rank, incarnation(rank))) {
    // An incarnation declared lost (silent too long, or replaced): it must not act.
    FLEX_LOG(DEBUG) << "fencing the sender of '" << type << "': an unknown or lost incarnation";
    (void)router_.send(
        {sender, proto::Shutdown::kType, proto::encode(proto::Shutdown{proto::Shutdown::kFenced})});
    return;
  }
  RankInfo& info = ranks_[rank];
  // Any message is a sign of life; silence past --heartbeat-timeout-ms is the membership's
  // to judge (check_workers: tick).
  (void)membership_.heartbeat(rank, incarnation(rank), now_ms());
  if (heartbeat) return;
  if (type == proto::Ready::kType) {
    auto ready = proto::decode<proto::Ready>(body);
    if (!ready.ok() || ready->incarnation != incarnation(rank)) return;
    if (state(rank) != RankState::kStarting) return;  // E.g. a joiner already rolled back.
    info.address = ready->transport_address;
    // Ready (the membership's state); the first epoch commits once every initial rank is.
    for (const cluster::Action& a : membership_.ready(rank, ready->incarnation, now_ms())) {
      if (a.kind == cluster::ActionKind::kCommit) send_epoch(a);
    }
    cv_.notify_all();  // A scale-up waits for its joiners.
  } else if (type == proto::TokenBatch::kType) {
    auto batch = proto::decode<proto::TokenBatch>(body);
    if (!batch.ok() || batch->tokens.size() != batch->ids.size() ||
        batch->finish_reasons.size() != batch->ids.size()) {
      return;
    }
    if (const double ms = seconds_since(last_tokens_at_) * 1e3;
        ms > kSilenceLogMs && !requests_.empty()) {
      FLEX_LOG(INFO) << "tokens again after " << ms << " ms without any (" << requests_.size()
                     << " requests open; these from rank " << rank << ")";
    }
    last_tokens_at_ = Clock::now();
    for (size_t i = 0; i < batch->ids.size(); ++i) {
      auto it = requests_.find(batch->ids[i]);
      if (it == requests_.end()) continue;  // Cancelled.
      // Moved to another rank, which re-runs it (also A -> B -> A: the attempt differs).
      if (it->second.rank != rank) continue;
      if (i < batch->attempts.size() && batch->attempts[i] != it->second.attempt) continue;
      CompletionEvent ev;
      const std::string& reason = batch->finish_reasons[i];
      if (batch->tokens[i] >= 0) {
        ev.tokens.push_back(batch->tokens[i]);
        it->second.streamed.push_back(batch->tokens[i]);
        if (it->second.params.logprobs >= 0 && i < batch->logprobs.size()) {
          ev.logprobs.push_back(batch->logprobs[i]);
        }
      }
      if (!reason.empty()) {
        ev.finished = true;
        if (reason.rfind("error: ", 0) == 0) {
          ev.finish_reason = "error";
          ev.error = invalid_argument(reason.substr(7));
        } else {
          ev.finish_reason = reason;
        }
      }
      calls->push_back({it->second.callback, ev});
      if (ev.finished) {
        (void)membership_.finished(it->first, rank, it->second.attempt);
        requests_.erase(it);
        if (reconfiguring_) cv_.notify_all();  // A drain waits (every request, or a leaver's).
      }
    }
  } else if (type == proto::StepReport::kType) {
    auto rep = proto::decode<proto::StepReport>(body);
    if (!rep.ok()) return;
    info.running = rep->running;
    info.waiting = rep->waiting;
    info.steps = rep->steps;
    if (rep->step_ms > 0) info.step_ms = rep->step_ms;
    info.max_step_ms = rep->max_step_ms;
    info.graph_captures = rep->graph_captures;
    info.total_step_ms = rep->total_step_ms;
    info.total_header_ms = rep->total_header_ms;
    info.total_exchange_ms = rep->total_exchange_ms;
    if (rebalancing_) {
      rebalance_max_step_ms_ = std::max(rebalance_max_step_ms_, rep->max_step_ms);
      cv_.notify_all();  // The end of a rebalance waits for a report from every member.
    }
    ++info.reports;
    if (rep->map_version > info.map_version) {
      info.map_version = rep->map_version;
      cv_.notify_all();
    }
    record_load(rank, rep->slot_counts);
  } else if (type == proto::PullDone::kType) {
    auto done = proto::decode<proto::PullDone>(body);
    if (!done.ok()) return;
    pulls_done_[done->id] = done.value();
    cv_.notify_all();
  } else if (type == proto::Connected::kType) {
    auto done = proto::decode<proto::Connected>(body);
    if (!done.ok() || !connects_awaited_.count(done->id)) return;
    connects_done_[done->id] = done.value();
    cv_.notify_all();
  } else if (type == proto::EpochApplied::kType) {
    auto applied = proto::decode<proto::EpochApplied>(body);
    if (!applied.ok()) return;
    info.applied_epoch = std::max(info.applied_epoch, applied->epoch);
    membership_.applied(rank, incarnation(rank), applied->epoch);
    cv_.notify_all();
  } else if (type == proto::LeaveRequest::kType) {
    FLEX_LOG(INFO) << "rank " << rank << " asks to leave";
    leave_requests_.push_back({rank, Clock::now()});
    cv_.notify_all();
  } else if (type == proto::MapApplied::kType) {
    auto applied = proto::decode<proto::MapApplied>(body);
    if (!applied.ok()) return;
    info.map_version = std::max(info.map_version, applied->version);
    cv_.notify_all();
  } else if (type == proto::WorkerError::kType) {
    auto err = proto::decode<proto::WorkerError>(body);
    if (!err.ok()) return;
    info.last_error = err->message;
    FLEX_LOG(WARN) << "rank " << rank << " reports: " << err->message;
    if (epoch() == 0 && state(rank) == RankState::kStarting) {
      start_error_ =
          unavailable("rank " + std::to_string(rank) + " failed to start: " + err->message);
      cv_.notify_all();
    } else if (info.joining &&
               (state(rank) == RankState::kStarting || state(rank) == RankState::kReady)) {
      on_rank_lost(rank, "failed to prepare: " + err->message, calls);  // Rolls back.
    } else if (err->dead_rank >= 0 && err->dead_rank < static_cast<int>(ranks_.size()) &&
               state(err->dead_rank) == RankState::kServing && !halted(err->dead_rank)) {
      // The transport saw the peer's process end: no need to wait for waitpid or
      // a heartbeat (a hand-started worker has no parent here).
      on_rank_lost(err->dead_rank, "reported dead by rank " + std::to_string(rank), calls);
    } else if (err->dead_rank < 0 && state(rank) == RankState::kServing && !halted(rank) &&
               !recovering()) {
      // A member halted without a dead peer (a timeout, an aborted collective): the
      // membership re-commits the members when it halted in the current epoch.
      for (const cluster::Action& a :
           membership_.halted(rank, incarnation(rank), err->epoch, now_ms())) {
        if (a.kind != cluster::ActionKind::kCommit) continue;
        FLEX_LOG(WARN) << "re-synchronising the group after rank " << rank << " halted";
        send_epoch(a);
      }
    }
  }
}

void ClusterEngine::Impl::check_workers(Calls* calls) {
  MutexLock lock(mutex_);
  for (size_t r = 0; r < ranks_.size(); ++r) {
    RankInfo& info = ranks_[r];
    if (info.spawned && info.pid > 0) {
      // Reaped already ("": shutdown() may reap first) is left to whoever reaped it.
      if (const std::string why = launcher_->reap(info.pid).value_or(""); !why.empty()) {
        info.pid = 0;
        unlink_rank_segments(static_cast<int>(r), incarnation(static_cast<int>(r)));
        cv_.notify_all();  // Waiters for exits (scale-up reusing the id, restarts).
        if (epoch() == 0 && start_error_.ok()) {
          start_error_ = unavailable("rank " + std::to_string(r) + " " + why +
                                     (info.last_error.empty() ? "" : ": " + info.last_error));
          cv_.notify_all();
        }
        on_rank_lost(static_cast<int>(r), why, calls);
        rank_reaped(static_cast<int>(r));
      }
    }
  }
  fail_launches();
  // Every rank that said hello beats (a thread of its own): silence past
  // --heartbeat-timeout-ms is a loss, which the membership decides on this clock (tick).
  if (options_.reconfigure == "stop-the-world") {
    // The baseline restarts the group itself: the membership only names the silent ones.
    for (const auto& [r, silent_incarnation] : membership_.silent(now_ms())) {
      on_rank_lost(r, "no heartbeat for " + std::to_string(options_.heartbeat_timeout_ms) + " ms",
                   calls);
    }
    return;
  }
  const std::vector<int> members_before = members();
  const cluster::Actions ticked = membership_.tick(now_ms());
  // tick() is lost() for each silent incarnation in turn: its kFence, then what that loss
  // decided (no proposal deadline: membership_config() sets none).
  for (size_t i = 0; i < ticked.size();) {
    size_t end = i + 1;
    while (end < ticked.size() && ticked[end].kind != cluster::ActionKind::kFence) ++end;
    const cluster::Action& fence = ticked[i];
    if (fence.kind == cluster::ActionKind::kFence) {
      const bool was_member = std::find(members_before.begin(), members_before.end(), fence.rank) !=
                              members_before.end();
      execute_loss(fence.rank, fence.incarnation, fence.reason, was_member,
                   cluster::Actions(ticked.begin() + static_cast<long>(i),
                                    ticked.begin() + static_cast<long>(end)),
                   calls);
    }
    i = end;
  }
}

void ClusterEngine::Impl::control_loop() {
  name_this_thread("fx-control");
  Calls calls;
  auto last_check = Clock::now();
  while (!stop_.load()) {
    // Each part's time; an iteration whose work (not its poll) is long is logged: every
    // token waits for this loop.
    const auto t_start = Clock::now();
    {
      MutexLock lock(mutex_);
      for (int r : launch_queue_) {
        if (state(r) != RankState::kStarting || ranks_[r].pid != 0) continue;
        if (Status s = launch(r); !s.ok()) {
          membership_.mark_lost(r);
          rank_reaped(r);  // Nothing was started.
          ranks_[r].last_error = s.to_string();
          cv_.notify_all();
        }
      }
      launch_queue_.clear();
    }
    const auto t_launched = Clock::now();
    flush_outbox();
    const auto t_flushed = Clock::now();
    auto ready = zmq_poll_readable({&router_, &wake_rx_}, 20);
    if (!ready.ok()) break;
    const auto t_polled = Clock::now();
    for (int i : ready.value()) {
      if (i == 1) {
        while (wake_rx_.recv(0).ok()) {
        }
        continue;
      }
      for (;;) {
        auto parts = router_.recv(0);
        if (!parts.ok()) break;
        if (parts->size() == 3) handle((*parts)[0], (*parts)[1], (*parts)[2], &calls);
      }
    }
    const auto t_handled = Clock::now();
    if (t_handled - last_check > std::chrono::milliseconds(20)) {
      check_workers(&calls);
      last_check = Clock::now();
    }
    const auto t_checked = Clock::now();
    for (auto& [cb, ev] : calls) cb(ev);  // Outside the lock: callbacks may call back in.
    calls.clear();
    const auto t_end = Clock::now();
    auto ms = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    if (const double work = ms(t_start, t_end) - ms(t_flushed, t_polled); work > kSilenceLogMs) {
      FLEX_LOG(INFO) << "control loop: " << work << " ms of work (launches "
                     << ms(t_start, t_launched) << ", sends " << ms(t_launched, t_flushed)
                     << ", messages " << ms(t_polled, t_handled) << ", worker checks "
                     << ms(t_handled, t_checked) << ", callbacks " << ms(t_checked, t_end) << ")";
    }
  }
  flush_outbox();
}

Status ClusterEngine::Impl::shutdown() {
  Calls calls;
  std::vector<pid_t> children;
  {
    MutexLock lock(mutex_);
    if (phase() == Phase::kStopped) return Status();
    shutting_down_.store(true);
    cv_.notify_all();  // A reconfiguration waiting for workers gives up.
    accepting_ = false;
    enter_phase(Phase::kStopping);
    for (auto& [id, req] : requests_) {
      CompletionEvent ev;
      ev.finished = true;
      ev.finish_reason = "abort";
      calls.push_back({req.callback, ev});
    }
    requests_.clear();
    for (size_t r = 0; r < ranks_.size(); ++r) {
      if (!ranks_[r].routing_id.empty() && state(r) != RankState::kDead) {
        post(static_cast<int>(r), proto::Shutdown{});
      }
      if (ranks_[r].spawned && ranks_[r].pid > 0) children.push_back(ranks_[r].pid);
    }
    wake();
  }
  for (auto& [cb, ev] : calls) cb(ev);
  // Workers stop together at their next step boundary; give them a moment, then insist.
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  for (pid_t pid : children) {
    for (;;) {
      MutexLock lock(mutex_);
      if (launcher_->reap(pid).has_value()) break;  // Ended (or check_workers reaped it).
      if (Clock::now() > deadline) {
        launcher_->kill_worker(pid);
        while (!launcher_->reap(pid).has_value()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        break;
      }
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  {
    MutexLock lock(mutex_);
    if (launcher_) launcher_->stop_all();  // None when start() failed before the bind.
  }
  {
    MutexLock lock(mutex_);
    stop_.store(true);
  }
  eplb_cv_.notify_all();
  cv_.notify_all();
  if (eplb_thread_.joinable()) eplb_thread_.join();
  if (restart_thread_.joinable()) restart_thread_.join();
  if (healer_.joinable()) healer_.join();
  if (control_.joinable()) control_.join();
  // Backstop: segments of workers that could not clean up (killed) are removed here.
  const std::string prefix = "flexpert-" + session_ + "-";
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0)
        shm_unlink(("/" + std::string(e->d_name)).c_str());
    }
    closedir(dir);
  }
  MutexLock lock(mutex_);
  membership_.stopped();  // Every rank not dead is stopped.
  return Status();
}

// --- ClusterEngine -----------------------------------------------------------

ClusterEngine::ClusterEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ClusterEngine::~ClusterEngine() { (void)shutdown(); }

Result<std::unique_ptr<ClusterEngine>> ClusterEngine::start(const ClusterOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  Status s = impl->start();
  std::unique_ptr<ClusterEngine> engine(new ClusterEngine(std::move(impl)));
  if (!s.ok()) {
    (void)engine->shutdown();
    return s;
  }
  return engine;
}

std::string ClusterEngine::control_endpoint() const { return impl_->endpoint_; }

int ClusterEngine::vocab_size() const { return impl_->model_config_.vocab_size; }

int ClusterEngine::max_context() const { return impl_->max_seq_len_; }

SamplingDefaults ClusterEngine::sampling_defaults() const {
  return impl_->model_config_.sampling_defaults;  // Set in start(), read-only afterwards.
}

Result<uint64_t> ClusterEngine::submit(CompletionRequest request, CompletionCallback on_event) {
  Impl& m = *impl_;
  // The same checks the workers' schedulers make, before anything is queued.
  FLEX_RETURN_IF_ERROR(
      validate_request(request.prompt, request.params, m.model_config_.vocab_size, m.max_seq_len_));
  MutexLock lock(m.mutex_);
  if (!m.accepting_) {
    if (m.phase() == Phase::kRestarting || m.phase() == Phase::kScaling) {
      return unavailable("the group is being rebuilt (--reconfigure stop-the-world)");
    }
    return unavailable("the server is shutting down");
  }
  if (!m.admitting()) {
    return unavailable(
        "no serving epoch (phase " + std::string(phase_name(m.phase())) +
        (m.membership_.degraded_reason().empty() ? "" : ": " + m.membership_.degraded_reason()) +
        ")");
  }
  const uint64_t id = m.next_request_id_++;
  // The membership places it (the least loaded serving member) or holds it (recovering).
  Result<cluster::Action> placed = m.membership_.submit(id);
  if (!placed.ok()) return placed.status();
  if (m.requests_.empty()) m.last_tokens_at_ = Clock::now();
  RequestInfo& req = m.requests_[id];
  req.callback = std::move(on_event);
  req.prompt = std::move(request.prompt);
  req.params = std::move(request.params);
  m.run_requests({placed.value()}, nullptr);
  m.wake();
  return id;
}

void ClusterEngine::cancel(uint64_t request_id) {
  Impl& m = *impl_;
  MutexLock lock(m.mutex_);
  auto it = m.requests_.find(request_id);
  if (it == m.requests_.end()) return;
  if (std::optional<int> rank = m.membership_.cancel(request_id)) {
    m.post(*rank, proto::CancelRequest{request_id});
  }
  m.requests_.erase(it);
  m.cv_.notify_all();  // A stop-the-world drain may wait for the last request.
  m.wake();
}

bool ClusterEngine::Impl::admitting() const {
  return phase() == Phase::kServing || phase() == Phase::kScaling || phase() == Phase::kRecovering;
}

bool ClusterEngine::healthy() const {
  MutexLock lock(impl_->mutex_);
  return impl_->accepting_ && impl_->admitting();
}

int ClusterEngine::retry_after_s() const {
  MutexLock lock(impl_->mutex_);
  const std::optional<double> in_s = impl_->degraded_retry_in_s();
  if (!in_s) return 1;
  // Whole seconds (RFC 9110 delay-seconds), rounded up so that a client comes back no earlier
  // than the attempt; never 0, which would invite a spin.
  return std::clamp(static_cast<int>(std::ceil(*in_s)), 1,
                    static_cast<int>(kDegradedBackoffMax.count()));
}

nlohmann::json ClusterEngine::status() const {
  const Impl& m = *impl_;
  MutexLock lock(m.mutex_);
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t r = 0; r < m.ranks_.size(); ++r) {
    const RankInfo& info = m.ranks_[r];
    if (m.state(static_cast<int>(r)) == RankState::kEmpty) continue;
    nlohmann::json j = {{"rank", r},
                        {"state", m.rank_state_name(static_cast<int>(r))},
                        {"pid", info.pid},
                        {"incarnation", m.incarnation(static_cast<int>(r))},
                        {"in_flight", m.in_flight(static_cast<int>(r))},
                        {"running", info.running},
                        {"waiting", info.waiting},
                        {"step_ms", info.step_ms},
                        {"steps", info.steps},
                        {"total_step_ms", info.total_step_ms},
                        {"total_header_ms", info.total_header_ms}};
    if (info.total_exchange_ms >= 0) j["total_exchange_ms"] = info.total_exchange_ms;
    if (!info.last_error.empty()) j["last_error"] = info.last_error;
    if (info.joining) j["joining"] = true;
    if (info.leaving) j["leaving"] = true;
    if (info.spare) j["spare"] = true;
    ranks.push_back(std::move(j));
  }
  nlohmann::json out = {{"mode", "cluster"},
                        {"phase", phase_name(m.phase())},
                        {"epoch", m.epoch()},
                        {"members", m.members()},
                        {"max_ranks", m.options_.max_ranks},
                        {"slots_per_rank", m.slots_per_rank_},
                        {"in_flight", m.requests_.size()},
                        {"held", m.membership_.num_held()},
                        {"reconfiguration", m.reconfig_status()},
                        {"ranks", ranks}};
  if (!m.membership_.degraded_reason().empty())
    out["degraded_reason"] = m.membership_.degraded_reason();
  return out;
}

void ClusterEngine::Impl::create_metrics() const {
  registry_.gauge("flexpert_epoch", "Current membership epoch.");
  (void)reconfigurations();
  (void)reruns();
  for (const char* outcome : {"in_place", "replacement", "failed"}) (void)recoveries(outcome);
  (void)recovery_seconds();
  (void)held_total();
  (void)rebalances();
  (void)moved_bytes();
}

void ClusterEngine::Impl::update_gauges() const {
  registry_.gauge("flexpert_epoch", "Current membership epoch.").set(static_cast<double>(epoch()));
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const RankInfo& info = ranks_[r];
    const int id = static_cast<int>(r);
    if (state(id) == RankState::kEmpty) continue;
    const metrics::Labels rank = {{"rank", std::to_string(r)}};
    registry_.gauge("flexpert_rank_up", "1 when the rank is a serving member.", rank)
        .set(state(id) == RankState::kServing && !halted(id) ? 1 : 0);
    registry_.gauge("flexpert_rank_step_seconds", "Mean busy step time per rank.", rank)
        .set(info.step_ms / 1e3);
    if (info.total_exchange_ms >= 0) {
      registry_
          .gauge("flexpert_rank_exchange_seconds",
                 "Time a rank spent in MoE exchanges since it started (serve --step-timing).", rank)
          .set(info.total_exchange_ms / 1e3);
      registry_
          .gauge("flexpert_rank_busy_step_seconds",
                 "Time a rank spent in busy steps since it started (the exchanges included).", rank)
          .set(info.total_step_ms / 1e3);
    }
    registry_
        .gauge("flexpert_rank_graph_captures",
               "CUDA graphs a rank captured since it started (flat across expert-map switches "
               "and epochs).",
               rank)
        .set(static_cast<double>(info.graph_captures));
    registry_.gauge("flexpert_rank_in_flight", "Requests placed on each rank.", rank)
        .set(in_flight(id));
  }
  update_eplb_gauges();
}

std::string ClusterEngine::metrics_text() const {
  const Impl& m = *impl_;
  {
    MutexLock lock(m.mutex_);
    m.update_gauges();
  }
  return m.registry_.render();
}

Status ClusterEngine::shutdown() { return impl_->shutdown(); }

}  // namespace flexpert
