// SPDX-License-Identifier: Apache-2.0
// run_worker and the worker's step loop: Worker::run, step and report (the class:
// worker_impl.h; its control side: worker_control.cc; load and weight moves: worker_slots.cc).
#include "flexpert/worker.h"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "cluster/protocol.h"
#include "core/thread_name.h"
#include "engine/placement_wire.h"
#include "engine/worker_impl.h"
#include "flexpert/logging.h"

namespace flexpert {
namespace engine_detail {

namespace {

double step_log_ms(double fallback) {
  static const double env = [] {
    const char* v = std::getenv("FLEXPERT_STEP_LOG_MS");
    return v != nullptr && *v != '\0' ? std::atof(v) : -1.0;
  }();
  return env >= 0 ? env : fallback;
}

}  // namespace

double slow_step_ms() { return step_log_ms(100); }
double slow_gap_ms() { return step_log_ms(50); }

std::atomic<bool> g_terminate{false};  // SIGINT (and the front end's death): stop now.
std::atomic<bool> g_leave{false};      // SIGTERM: a graceful leave (docs/deployment.md).

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
  const size_t rows = batch.size();  // For the log: complete_step clears the batch.
  header.stopping = stopping_ ? 1 : 0;
  header.acked_epoch = has_pending_ ? pending_.epoch : group_.epoch;
  header.acked_map = has_pending_map_ ? pending_map_.version : map_version_;
  header.device_ready = executor_->device_ready() ? 1 : 0;
  // Three clock reads a step (tens of nanoseconds against steps of milliseconds).
  const auto header_start = std::chrono::steady_clock::now();
  step_part_.store("its header's all_gather");
  if (!idle_ && last_step_end_ != std::chrono::steady_clock::time_point{}) {
    if (const double gap = ms_since(last_step_end_); gap > slow_gap_ms()) {
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
    if (step_hang_after_ > 0 && --step_hang_after_ == 0) {
      FLEX_LOG(WARN) << "FLEXPERT_FAULT=step-hang: rank " << options_.rank << " stops stepping";
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    FLEX_RETURN_IF_ERROR(
        model_->forward_step(batch, scheduler_->row_outputs(), &logits_, &tokens_));
    events_.clear();
    scheduler_->complete_step(logits_, tokens_, &events_);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (ms > slow_step_ms() || header_ms > slow_step_ms() || log_this) {
      FLEX_LOG(INFO) << "rank " << options_.rank << " epoch " << group_.epoch << ": a step of "
                     << header.num_tokens << " tokens in " << rows << " rows (group "
                     << total_tokens << ") took " << ms << " ms, its header " << header_ms << " ms";
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
  step_hang_after_ = step_hang_fault(options_.rank, config_.incarnation);
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

}  // namespace engine_detail

namespace {

void on_terminate(int) { engine_detail::g_terminate.store(true); }
void on_leave(int) { engine_detail::g_leave.store(true); }

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
  engine_detail::Worker worker(options);
  return worker.run();
}

}  // namespace flexpert
