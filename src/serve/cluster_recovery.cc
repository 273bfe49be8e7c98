// SPDX-License-Identifier: Apache-2.0
// ClusterEngine's recovery from lost ranks, and the healer that restores the
// group's size (docs/ARCHITECTURE.md, "Membership, epochs, failure").
//
// A lost member: survivors halt at their next collective (it includes the lost
// rank); its requests, and new ones, are held at the front end; the healer thread asks
// the membership for the recovery's plan (Membership::propose_recovery: where the
// experts that lost their last replica go, and where the survivors cannot hold every
// expert, replacement ranks at free ids with new incarnations), starts and attaches the
// replacements, loads the lost experts and acknowledges each participant; the
// membership commits the epoch and the held requests are placed. Only when no capacity is left
// (every id of --max-ranks in use, replacements failing again and again) is the
// group degraded: new requests get 503 with Retry-After, and POST /v1/scale may
// try again. Once serving, the healer scales back up to the size the operator
// asked for (a live scale-up: no stall).
#include <signal.h>

#include <algorithm>

#include "cluster/recovery_plan.h"
#include "core/thread_name.h"
#include "flexpert/logging.h"
#include "serve/cluster_engine_impl.h"

namespace flexpert {
namespace {

constexpr auto kSettleTimeout = std::chrono::seconds(10);
constexpr int kRecoveryAttempts = 3;
// Between a recovery's failed attempts (doubling): a start that fails at once (a launch
// command refused, a worker that exits) is retried after a transient cause may be gone,
// and the held requests wait about 1.5 s in all before degraded answers them 503.
constexpr auto kAttemptBackoff = std::chrono::milliseconds(500);

}  // namespace

cluster::MembershipConfig ClusterEngine::Impl::membership_config() const {
  cluster::MembershipConfig mc;
  mc.max_ranks = options_.max_ranks;
  mc.initial_ranks = options_.ranks;
  mc.slots_per_rank = slots_per_rank_;
  mc.num_experts = placement_.num_experts();
  for (int l = 0; l < placement_.num_layers(); ++l) {
    mc.maps.push_back(placement_.slot_map(l));
    mc.routed.push_back(model_config_.is_moe_layer(l));
  }
  mc.heartbeat_timeout_ms = options_.heartbeat_timeout_ms;  // check_workers ticks it.
  // No proposal deadline: the flows bound their own waits (--start-timeout-ms, the pulls')
  // and abandon the proposal themselves.
  mc.prepare_timeout_ms = 0;
  // The healer asks for each recovery plan (propose_recovery) once a running scale or
  // rebalance has settled, with the load window. Hand-started replacements get one
  // bounded wait (--start-timeout-ms), then the group is degraded.
  mc.plan_on_loss = false;
  mc.recovery_attempts = launcher_->starts_workers() ? kRecoveryAttempts : 1;
  return mc;
}

void ClusterEngine::Impl::run_requests(const cluster::Actions& actions, Calls* calls) {
  for (const cluster::Action& a : actions) {
    if (a.kind != cluster::ActionKind::kPlace && a.kind != cluster::ActionKind::kHold &&
        a.kind != cluster::ActionKind::kFail) {
      continue;
    }
    auto it = requests_.find(a.request);
    if (it == requests_.end()) continue;
    RequestInfo& req = it->second;
    if (req.rank == kFinishedRank) continue;  // Its final event is queued already.
    if (a.kind == cluster::ActionKind::kFail) {
      fail_request(req, a.reason, calls);
      continue;
    }
    // A move from where it ran (a lost rank, a leaver): cancelled there, re-run.
    if (a.from_rank >= 0) {
      if (a.from_rank < static_cast<int>(ranks_.size()) && state(a.from_rank) != RankState::kDead) {
        post(a.from_rank, proto::CancelRequest{a.request});
      }
      reruns().inc();
    }
    req.attempt = a.attempt;
    const int done = static_cast<int>(req.streamed.size());
    if (done > 0 && done >= req.params.max_tokens) {
      CompletionEvent ev;  // Everything was streamed but the final event.
      ev.finished = true;
      ev.finish_reason = "length";
      if (calls != nullptr) calls->push_back({req.callback, ev});
      (void)membership_.cancel(a.request);  // Not sent anywhere: nothing to cancel.
      req.rank = kFinishedRank;
      continue;
    }
    if (a.kind == cluster::ActionKind::kHold) {
      if (req.rank != kHeldRank) held_total().inc();
      req.rank = kHeldRank;  // Placed by the membership once an epoch commits.
      continue;
    }
    proto::AddRequest add;
    add.id = a.request;
    add.prompt = req.prompt;
    add.params = req.params;
    add.params.max_tokens -= done;
    add.params.min_tokens = std::max(0, add.params.min_tokens - done);
    add.num_generated = done;
    add.prompt.insert(add.prompt.end(), req.streamed.begin(), req.streamed.end());
    add.attempt = a.attempt;
    req.rank = a.rank;
    post(a.rank, add);
  }
  sweep_finished();
}

void ClusterEngine::Impl::fail_request(RequestInfo& req, const std::string& why, Calls* calls) {
  CompletionEvent ev;
  ev.finished = true;
  ev.finish_reason = "error";
  ev.error = unavailable(why);
  if (calls != nullptr) calls->push_back({req.callback, ev});
  req.rank = kFinishedRank;  // Erased by sweep_finished().
}

void ClusterEngine::Impl::fail_all(const std::string& why, Calls* calls) {
  for (auto& [id, req] : requests_) {
    if (req.rank == kFinishedRank) continue;  // Its final event is queued already.
    CompletionEvent ev;
    ev.finished = true;
    ev.finish_reason = "error";
    ev.error = unavailable(why);
    calls->push_back({req.callback, ev});
    (void)membership_.cancel(id);  // Answered: the membership forgets it.
  }
  requests_.clear();
}

void ClusterEngine::Impl::sweep_finished() {
  for (auto it = requests_.begin(); it != requests_.end();) {
    it = it->second.rank == kFinishedRank ? requests_.erase(it) : std::next(it);
  }
}

void ClusterEngine::Impl::enter_degraded(const std::string& why, Calls* calls) {
  // The membership gave up already (the last attempt failed) with its reason, or the
  // healer gives up now (its own bound on restarts): degraded, every open request failed.
  run_requests(membership_.give_up_recovery(why), calls);
  FLEX_LOG(ERROR) << "the group is degraded: " << membership_.degraded_reason();
  recoveries("failed").inc();  // The members show as halted (rank_state_name).
  fail_all("the group cannot serve: " + membership_.degraded_reason(), calls);
  cv_.notify_all();
}

void ClusterEngine::Impl::on_rank_lost(int rank, const std::string& why, Calls* calls) {
  const RankState st = state(rank);
  if (st == RankState::kDead || st == RankState::kStopped || st == RankState::kEmpty) return;
  if (phase() == Phase::kStopping || stop_.load()) {
    membership_.mark_stopped(rank);  // Leaving as asked, not lost.
    return;
  }
  const bool was_member = std::find(members().begin(), members().end(), rank) != members().end();
  const uint64_t lost_incarnation = incarnation(rank);
  cluster::Actions decided;
  if (options_.reconfigure == "stop-the-world") {
    membership_.mark_lost(rank);  // The baseline restarts the group itself (restart_group).
  } else {
    // The membership's event: out of the members, its incarnation fenced, a scale planned
    // with it abandoned (its flow rolls back), its requests held (re-run once the
    // recovery commits), phase recovering. The fence is executed below.
    decided = membership_.lost(rank, lost_incarnation, why, now_ms());
    if (state(rank) != RankState::kDead) membership_.mark_lost(rank);
  }
  execute_loss(rank, lost_incarnation, why, was_member, decided, calls);
}

void ClusterEngine::Impl::execute_loss(int rank, uint64_t lost_incarnation, const std::string& why,
                                       bool was_member, const cluster::Actions& decided,
                                       Calls* calls) {
  RankInfo& info = ranks_[rank];
  announce_lost(rank, lost_incarnation, why);
  info.last_error = why;
  info.leaving = false;
  if (info.spawned && info.pid > 0) launcher_->kill_worker(info.pid);  // Declared lost: make it so.
  if (!info.spawned) {
    // Not ours to kill: if it is alive but silent, fence it (it exits when it wakes).
    if (!info.routing_id.empty()) post(rank, proto::Shutdown{proto::Shutdown::kFenced});
    unlink_rank_segments(rank, incarnation(rank));
    info.pid = 0;
  }
  if (info.pid == 0) rank_reaped(rank);  // No process of ours to wait for.
  cv_.notify_all();
  FLEX_LOG(WARN) << "rank " << rank << " lost: " << why;
  if (!was_member) {
    // A joiner in preparation: its scale-up rolls back; a recovery's replacement counts
    // one failed attempt, and at the last one the membership fails every open request now.
    run_requests(decided, calls);
    return;
  }
  cancel_rebalance_ = true;  // Its pulls may read from the lost rank; the epoch changes anyway.
  if (options_.reconfigure == "stop-the-world") {
    // The baseline: fail what is in flight, restart the whole group.
    fail_all("rank " + std::to_string(rank) + " died: " + why, calls);
    if (!reconfiguring_) {
      reconfiguring_ = true;
      enter_phase(Phase::kRestarting);
      accepting_ = false;
      const int n = static_cast<int>(members().size()) + 1;  // The group's size before the loss.
      if (restart_thread_.joinable()) restart_thread_.detach();
      restart_thread_ = std::thread([this, n] {
        nlohmann::json report = {{"kind", "restart"}, {"mode", "stop-the-world"}};
        Status s = restart_group(n, &report);
        MutexLock lock(mutex_);
        report["status"] = s.ok() ? "ok" : s.to_string();
        last_reconfig_ = report;
        reconfiguring_ = false;
        reconfig_step_.clear();
        cv_.notify_all();
      });
    }
    return;
  }
  ++losses_;
  // Degraded, a further loss asks for another recovery, as a scale to the operator's size
  // would (the membership's repair path: fresh attempts). Either way the membership is
  // recovering now, which starts the healer.
  if (phase() == Phase::kDegraded) (void)membership_.scale(target_ranks_, {}, now_ms());
  // Its requests continue from their prompt plus what was streamed, once the
  // recovery commits (held at the front end until then).
  run_requests(decided, calls);
  cv_.notify_all();  // The healer starts the recovery.
}

void ClusterEngine::Impl::announce_lost(int rank, uint64_t lost_incarnation,
                                        const std::string& why) {
  // A silent host is not seen by a network transport (UCX reports no error for a dropped
  // link): without this word the survivors' collectives with it end only at their timeout.
  const proto::PeerLost msg{rank, lost_incarnation, why};
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const RankState s = state(static_cast<int>(r));
    if (static_cast<int>(r) == rank || ranks_[r].routing_id.empty() || s == RankState::kDead ||
        s == RankState::kStopped || s == RankState::kEmpty) {
      continue;
    }
    outbox_.push_back({static_cast<int>(r), true, {proto::PeerLost::kType, proto::encode(msg)}});
  }
  wake();
}

Status ClusterEngine::Impl::recover(nlohmann::json* report, Calls* calls) {
  // The membership decides (docs/ARCHITECTURE.md, "The membership state machine"): the
  // survivors, the replacements and their incarnations, where the lost experts go, when
  // to commit, how many failed attempts make the group degraded. Here its proposal is
  // executed: replacements started, attached and loaded, each participant acknowledged.
  Status last = unavailable("no attempt made");
  auto backoff = kAttemptBackoff;
  bool failed_attempt = false;
  for (int restarts = 0; restarts < 4 * options_.max_ranks;) {
    if (halting()) return unavailable("shutting down");
    if (phase() == Phase::kDegraded) return last;  // The membership gave up.
    if (failed_attempt) {
      // The next attempt after a backoff (a loss meanwhile plans again at once); the
      // requests stay held.
      failed_attempt = false;
      reconfig_step_ = "waiting to retry";
      const uint64_t losses_before = losses_;
      cv_.wait_for(mutex_, backoff, [&]() REQUIRES(mutex_) {
        return halting() || !recovering() || losses_ != losses_before;
      });
      backoff *= 2;
      continue;
    }
    // A scale or rebalance the loss interrupted gives up at its next check.
    cv_.wait_for(mutex_, kSettleTimeout, [&]() REQUIRES(mutex_) {
      return halting() || (!reconfiguring_ && !rebalancing_);
    });
    if (halting()) return unavailable("shutting down");
    const uint64_t losses0 = losses_;
    auto changed = [&]() REQUIRES(mutex_) { return losses_ != losses0 || halting(); };
    // Smoothed as the rebalances' (which surplus replica a reload evicts).
    const std::vector<std::vector<double>> load = load_.smoothed();
    // Ids of ranks still exiting (the lost ones) free up once reaped: wait a little for
    // them before the membership chooses among the ids free now.
    auto chosen = membership_.choose_recovery(membership_.maps(), members(),
                                              membership_.target_ranks(), false, load);
    if (chosen.ok() && chosen->not_reaped > 0) {
      reconfig_step_ = "waiting for free rank ids";
      cv_.wait_for(mutex_, std::chrono::seconds(5), [&]() REQUIRES(mutex_) {
        auto c = membership_.choose_recovery(membership_.maps(), members(),
                                             membership_.target_ranks(), false, load);
        return changed() || !c.ok() || c->not_reaped == 0;
      });
      if (changed()) {
        ++restarts;  // Another loss: plan again with the new survivors.
        continue;
      }
    }
    // The ranks this recovery restores (the membership forgets them as it commits).
    std::vector<int> lost = membership_.lost();
    // The decision; its actions (spawns, prepares) are executed below, in this order.
    const cluster::Proposed opened =
        membership_.propose_recovery(/*started_only=*/true, load, now_ms());
    if (!opened.status.ok()) {
      last = opened.status;  // One failed attempt, or degraded (checked above).
      if (phase() != Phase::kRecovering) return last;  // Not the membership's recovery.
      failed_attempt = true;
      continue;
    }
    // Nothing to load and no replacement (the lost rank held only surplus replicas):
    // committed at once, the commit is among the actions.
    const cluster::Proposal decided =
        membership_.proposal() ? *membership_.proposal() : cluster::Proposal{};
    const std::vector<int>& joiners = decided.joiners;
    auto retry = [&](Status s) REQUIRES(mutex_) {
      if (changed()) {
        ++restarts;  // The loss abandoned the proposal: plan again with the new survivors.
      } else {
        last = std::move(s);
        failed_attempt = true;
        // One failed attempt (unless a replacement's loss counted it already). Before the
        // rollback: the rollback frees the ids of replacements that never started.
        if (membership_.proposal() && membership_.proposal()->id == decided.id) {
          (void)membership_.abandon_proposal(decided.id, last.message(), now_ms());
        }
      }
      if (!joiners.empty()) rollback_joiners(joiners);
    };
    cluster::Actions acks = opened.actions;
    std::vector<std::vector<int>> next_maps = membership_.maps();
    auto t_load = Clock::now();
    if (membership_.proposal()) {
      if (!joiners.empty()) {
        (*report)["replacements"] = joiners;
        reconfig_step_ = "starting replacements";
        Status s = start_joiners(joiners, changed);
        if (s.ok()) {
          reconfig_step_ = "connecting replacements";
          s = connect_all(joiner_connects(decided.survivors, joiners), [&]() REQUIRES(mutex_) {
            return changed() ||
                   std::any_of(joiners.begin(), joiners.end(), [&](int r) REQUIRES(mutex_) {
                     return state(r) == RankState::kDead || state(r) == RankState::kStopped;
                   });
          });
        }
        if (s.ok() && changed()) s = aborted("a rank was lost");
        if (!s.ok()) {
          retry(s);
          continue;
        }
      }
      // The lost experts come from the checkpoint: no replica is left to copy from.
      reconfig_step_ = "reloading experts";
      t_load = Clock::now();
      Pulls pulls;
      for (const cluster::RecoveryLoad& ld : decided.loads) {
        add_pull(&pulls, ld.layer, ld.slot, proto::PullCommand::kFromCheckpoint, ld.logical_expert);
      }
      PullTotals done;
      Status s = run_pulls(std::move(pulls), kPullTimeout, changed, &done);
      if (s.code() == StatusCode::kDeadlineExceeded) {
        s = deadline_exceeded("expert reloads timed out");
      }
      if (s.ok() && changed()) s = aborted("a rank was lost during the reload");
      if (s.ok())
        s = ExpertPlacement::from_slot_maps(placement_.num_experts(), decided.maps).status();
      if (!s.ok()) {
        retry(s);
        continue;
      }
      // Every participant is started, attached and loaded: its acknowledgement; the
      // membership commits survivors and replacements with the last one.
      lost = membership_.lost();
      for (int r : decided.awaiting) {
        for (cluster::Action& a : membership_.prepared(r, incarnation(r), decided.id, now_ms())) {
          acks.push_back(std::move(a));
        }
      }
      next_maps = decided.maps;
    }
    auto commit = std::find_if(acks.begin(), acks.end(), [](const cluster::Action& a) {
      return a.kind == cluster::ActionKind::kCommit;
    });
    if (commit == acks.end()) {
      retry(internal_error("the membership did not commit the recovery"));
      continue;
    }
    auto next = ExpertPlacement::from_slot_maps(placement_.num_experts(), std::move(next_maps));
    FLEX_CHECK(next.ok()) << next.status().to_string();  // Checked before the commit.
    placement_ = std::move(next).value();
    send_epoch(*commit);
    for (int r : joiners) ranks_[r].joining = false;
    reconfigurations().inc();
    enter_phase(reconfiguring_ ? Phase::kScaling : Phase::kServing);
    (*report)["epoch"] = epoch();
    (*report)["members"] = members();
    (*report)["lost"] = lost;
    (*report)["reloaded_experts"] = decided.loads.size();
    (*report)["evicted_replicas"] = decided.evicted;
    (*report)["reload_s"] = seconds_since(t_load);
    recoveries(joiners.empty() ? "in_place" : "replacement").inc();
    // The held requests, placed by the commit. Their callbacks run once heal_loop has
    // written this report: until then the lock is held, so that a scale waiting for the
    // recovery (retry_recovery) never sees it committed without its report.
    run_requests(acks, calls);
    return Status();
  }
  return last;
}

void ClusterEngine::Impl::keep_spares() {
  if (options_.spare_ranks <= 0 || !launcher_->starts_workers() || options_.reconfigure != "live" ||
      phase() != Phase::kServing || reconfiguring_ || rebalancing_) {
    return;
  }
  int spares = 0;  // Ready, or still starting.
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    spares +=
        ranks_[r].spare && (state(r) == RankState::kStarting || state(r) == RankState::kReady);
  }
  const std::vector<int> free = free_ranks();
  for (size_t i = 0; spares < options_.spare_ranks && i < free.size(); ++i, ++spares) {
    RankInfo& info = ranks_[free[i]];
    info = RankInfo{};
    info.spare = true;
    membership_.open_rank(free[i], now_ms());
    request_launch(free[i]);
    FLEX_LOG(INFO) << "starting rank " << free[i] << " as a spare";
  }
}

bool ClusterEngine::Impl::serve_leaves() {
  // A leave waits for a running reconfiguration or rebalance; one refused as impossible, or
  // that cannot run within kLeaveWait, is dropped (the worker exits on its own deadline and
  // is healed as lost).
  constexpr auto kLeaveWait = std::chrono::seconds(60);
  while (!leave_requests_.empty() &&
         (Clock::now() - leave_requests_.front().second > kLeaveWait ||
          std::find(members().begin(), members().end(), leave_requests_.front().first) ==
              members().end())) {
    FLEX_LOG(WARN) << "dropping the leave request of rank " << leave_requests_.front().first
                   << " (not a member, or waited too long)";
    leave_requests_.pop_front();
  }
  if (leave_requests_.empty() || phase() != Phase::kServing || reconfiguring_ || rebalancing_) {
    return false;
  }
  const int rank = leave_requests_.front().first;
  mutex_.unlock();
  // The live scale-down of docs/ARCHITECTURE.md ("The membership state machine"): the
  // leaver's requests move to the others, it switches with them, then gets Shutdown{kLeave}.
  auto result = scale(ScaleTarget{-1, {rank}}, "leave");
  mutex_.lock();
  if (result.ok()) {
    leave_requests_.pop_front();
    FLEX_LOG(INFO) << "rank " << rank << " left: " << result->dump();
  } else if (result.status().code() == StatusCode::kInvalidArgument) {
    // Never possible as asked (e.g. the others' slots cannot hold every expert): the
    // worker stays a member until its own deadline, then exits and is healed as lost.
    leave_requests_.pop_front();
    FLEX_LOG(ERROR) << "rank " << rank << " cannot leave: " << result.status().to_string();
  } else {
    // Retried on the next pass (a map switch in flight, a scale in progress), until kLeaveWait.
    FLEX_LOG(WARN) << "leave of rank " << rank << ": " << result.status().to_string();
    cv_.wait_for(mutex_, std::chrono::milliseconds(200),
                 [&]() REQUIRES(mutex_) { return halting(); });
  }
  return true;
}

void ClusterEngine::Impl::retry_degraded() {
  // Workers could not start (every one lost and their replacements failing: a launch
  // command refused, a device that takes no new process). Nobody but the healer would
  // try again where the launcher starts workers, so it does, as POST /v1/scale would:
  // the operator's size, fresh attempts (the membership's repair path).
  if (phase() != Phase::kDegraded || !retries_degraded() || reconfiguring_ ||
      Clock::now() < degraded_retry_at_) {
    return;
  }
  ++degraded_retries_;
  FLEX_LOG(WARN) << "degraded (" << membership_.degraded_reason() << "): retry "
                 << degraded_retries_ << " of the recovery to " << target_ranks_ << " ranks";
  auto opened = membership_.scale(target_ranks_, {}, now_ms());
  if (!opened.ok()) {
    // Never expected (the target was accepted before); tried again after the longest wait.
    FLEX_LOG(ERROR) << "retrying the recovery: " << opened.status().to_string();
    degraded_retry_at_ = Clock::now() + kDegradedBackoffMax;
    return;
  }
  cv_.notify_all();
}

void ClusterEngine::Impl::heal_loop() {
  name_this_thread("fx-heal");
  MutexLock lock(mutex_);
  auto backoff = std::chrono::milliseconds(500);
  auto next_heal = Clock::now();
  while (!halting()) {
    cv_.wait_for(lock, std::chrono::milliseconds(200),
                 [&]() REQUIRES(mutex_) { return halting() || recovering(); });
    if (halting()) break;
    if (recovering()) {
      nlohmann::json report = {{"kind", "recovery"}};
      Calls calls;
      Status s = recover(&report, &calls);
      if (!halting()) {
        // From the loss (or the scale that left degraded) to the commit or the failure.
        const double took_s =
            static_cast<double>(now_ms() - membership_.recovery_started_ms()) / 1000.0;
        report["recover_s"] = took_s;
        report["status"] = s.ok() ? "ok" : s.to_string();
        recovery_seconds().observe(took_s);
        last_reconfig_ = report;
        last_recovery_ = report;
        reconfig_step_.clear();
        if (!s.ok()) {
          enter_degraded(s.message(), &calls);
          // The healer tries again after a backoff (retry_degraded), longer each time.
          degraded_backoff_ = std::min<std::chrono::milliseconds>(
              std::max<std::chrono::milliseconds>(kDegradedBackoff, degraded_backoff_ * 2),
              kDegradedBackoffMax);
          degraded_retry_at_ = Clock::now() + degraded_backoff_;
        } else {
          degraded_backoff_ = std::chrono::milliseconds(0);
          degraded_retries_ = 0;
          FLEX_LOG(INFO) << "recovery: " << report.dump();
        }
        cv_.notify_all();
      }
      lock.unlock();
      for (auto& [cb, ev] : calls) cb(ev);
      lock.lock();
      if (halting()) break;
      continue;
    }
    retry_degraded();
    if (recovering()) continue;
    if (serve_leaves()) continue;
    keep_spares();
    // Back to the size the operator asked for, with a live scale-up.
    const bool short_of_ranks = static_cast<int>(members().size()) < target_ranks_;
    if (!short_of_ranks || phase() != Phase::kServing || reconfiguring_ || rebalancing_ ||
        !launcher_->starts_workers() || options_.reconfigure != "live" ||
        Clock::now() < next_heal) {
      continue;
    }
    const int target = target_ranks_;
    lock.unlock();
    auto result = scale(ScaleTarget{target, {}}, "heal");
    lock.lock();
    if (result.ok()) {
      backoff = std::chrono::milliseconds(500);
    } else {
      FLEX_LOG(WARN) << "heal to " << target << " ranks: " << result.status().to_string();
      next_heal = Clock::now() + backoff;
      backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(30));
    }
  }
}

}  // namespace flexpert
