// SPDX-License-Identifier: Apache-2.0
// ClusterEngine's elastic membership: scale up, scale down, recovery from a lost
// rank, request re-runs, and the stop-the-world baseline.
//
// Live scale-up (docs/ARCHITECTURE.md, "Membership, epochs, failure"): joiners start aside (dense
// weights from the checkpoint, no experts: their slots are free in the committed map), attach to
// the members and prove the attachments with a one-sided read, and receive the experts the plan
// gives them by one-sided reads from members' slots (the EPLB mover). Only then is the epoch
// committed: every rank switches at one step boundary (worker.cc), the joiners' slots enter the map
// with it, and the joiners take requests. The rest of the plan (freeing replicas old ranks no
// longer need) then runs as ordinary EPLB transition steps.
//
// Scale-down moves experts off the leaving ranks first (transition steps, while
// serving), lets the leavers finish the requests they run (they take no new ones; up to
// --leave-drain-ms), commits an epoch without them at a step boundary they take part
// in, re-runs what they had not finished on survivors, and lets them exit.
//
// Spare ranks (--spare-ranks) are joiners started ahead: loaded and Ready, not
// members; a recovery or a scale-up takes them before it starts new workers.
// Recovery from lost ranks is in cluster_recovery.cc.
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <thread>

#include "core/thread_name.h"
#include "eplb/planner.h"
#include "flexpert/logging.h"
#include "serve/cluster_engine_impl.h"

namespace flexpert {
namespace {

constexpr auto kConnectTimeout = std::chrono::seconds(30);
constexpr auto kApplyTimeout = std::chrono::seconds(30);

}  // namespace

Result<ScaleTarget> ScaleTarget::from_json(const nlohmann::json& body) {
  // No group has this many ranks; the bound only keeps the narrowing to int exact.
  constexpr int64_t kMaxRankId = 1 << 20;
  if (!body.is_object()) return invalid_argument("body must be a JSON object");
  ScaleTarget t;
  const bool has_ranks = body.contains("ranks"), has_remove = body.contains("remove");
  if (has_ranks == has_remove) {
    return invalid_argument("give exactly one of \"ranks\" (an integer) or \"remove\" (a list)");
  }
  if (has_ranks) {
    // Range-checked as 64-bit before narrowing: 4294967298 must not become 2.
    const auto& v = body["ranks"];
    if (!v.is_number_integer()) return invalid_argument("\"ranks\" must be an integer");
    if (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t{kMaxRankId}
                               : v.get<int64_t>() < 1 || v.get<int64_t>() > kMaxRankId) {
      return invalid_argument("\"ranks\" must be in [1, " + std::to_string(kMaxRankId) + "]");
    }
    t.ranks = static_cast<int>(v.get<int64_t>());
    if (t.ranks < 1) return invalid_argument("\"ranks\" must be >= 1");
  } else {
    const auto& v = body["remove"];
    if (!v.is_array() || v.empty()) {
      return invalid_argument("\"remove\" must be a non-empty list of rank ids");
    }
    for (const auto& r : v) {
      if (!r.is_number_integer()) return invalid_argument("\"remove\" holds a non-integer");
      if (r.is_number_unsigned() ? r.get<uint64_t>() > uint64_t{kMaxRankId}
                                 : r.get<int64_t>() < 0 || r.get<int64_t>() > kMaxRankId) {
        return invalid_argument("\"remove\" holds " + r.dump() + ", not a rank id in [0, " +
                                std::to_string(kMaxRankId) + "]");
      }
      t.remove.push_back(static_cast<int>(r.get<int64_t>()));
    }
  }
  return t;
}

std::vector<int> ClusterEngine::Impl::free_ranks() const {
  std::vector<int> out;
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    const RankState s = state(r);
    const bool member = std::find(members().begin(), members().end(), r) != members().end();
    // A rank whose process still runs (reaped later) is not reusable yet.
    if (!member && ranks_[r].pid == 0 &&
        (s == RankState::kEmpty || s == RankState::kDead || s == RankState::kStopped)) {
      out.push_back(r);
    }
  }
  return out;
}

Result<std::pair<int, uint64_t>> ClusterEngine::Impl::admit(int rank, int pid) {
  // Open (the membership decides): an initial rank, or one a scale-up, a recovery or a
  // spare reserved; a spawned one only for the process we started.
  auto ours = [&](int r) REQUIRES(mutex_) {
    return r >= 0 && r < static_cast<int>(ranks_.size()) && ranks_[r].routing_id.empty() &&
           (!ranks_[r].spawned || (rank != proto::Hello::kAnyRank && ranks_[r].pid == pid));
  };
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    if (rank != proto::Hello::kAnyRank && r != rank) continue;
    if (!ours(r)) continue;
    Result<uint64_t> incarnation = membership_.hello(r, now_ms());
    if (incarnation.ok()) return std::make_pair(r, incarnation.value());
  }
  return failed_precondition(rank == proto::Hello::kAnyRank
                                 ? std::string("no rank id is open for joining")
                                 : "rank " + std::to_string(rank) + " is not open for joining");
}

std::vector<int> ClusterEngine::Impl::spare_ranks() const {
  std::vector<int> out;
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    if (ranks_[r].spare && state(r) == RankState::kReady) out.push_back(r);
  }
  return out;
}

std::vector<int> ClusterEngine::Impl::joiner_candidates() const {
  std::vector<int> out = spare_ranks();
  for (int r : free_ranks()) out.push_back(r);
  return out;
}

void ClusterEngine::Impl::unlink_rank_segments(int rank, uint64_t incarnation) const {
  const std::string prefix =
      "flexpert-" + session_ + "-r" + std::to_string(rank) + "-i" + std::to_string(incarnation);
  // On a thread of its own: the last unlink of a dead rank's segments frees their pages
  // (its slots' host mirrors: gigabytes, hundreds of milliseconds), which on the caller's
  // thread (the control loop, under mutex_) would hold every token meanwhile. The names go
  // at once; only the freeing runs on.
  std::thread([prefix] {
    name_this_thread("fx-unlink");
    if (DIR* dir = opendir("/dev/shm")) {
      while (dirent* e = readdir(dir)) {
        const std::string name = e->d_name;
        if (name == prefix || name.rfind(prefix + "-g", 0) == 0) shm_unlink(("/" + name).c_str());
      }
      closedir(dir);
    }
  }).detach();
}

// --- Scaling ------------------------------------------------------------------

Status ClusterEngine::Impl::connect_all(const std::map<int, proto::ConnectCommand>& cmds,
                                        const std::function<bool()>& failed) {
  std::vector<uint64_t> ids;
  const uint64_t epoch0 = epoch();
  for (auto [rank, cmd] : cmds) {
    cmd.id = next_connect_id_++;
    ids.push_back(cmd.id);
    connects_awaited_.insert(cmd.id);
    post(rank, cmd);
  }
  wake();
  std::map<uint64_t, proto::Connected> answers;
  auto forget = [&]() REQUIRES(mutex_) {  // On every return: nothing of this call stays behind.
    for (uint64_t id : ids) {
      connects_awaited_.erase(id);
      auto it = connects_done_.find(id);
      if (it == connects_done_.end()) continue;
      answers[id] = it->second;
      connects_done_.erase(it);
    }
  };
  const bool done = cv_.wait_for(mutex_, kConnectTimeout, [&]() REQUIRES(mutex_) {
    if (halting() || epoch() != epoch0 || failed()) return true;
    return std::all_of(ids.begin(), ids.end(),
                       [&](uint64_t id) REQUIRES(mutex_) { return connects_done_.count(id); });
  });
  forget();
  if (halting()) return unavailable("shutting down");
  if (epoch() != epoch0) return aborted("membership changed (a rank was lost)");
  if (failed()) return unavailable("a rank failed while connecting");
  if (!done) return deadline_exceeded("transport connections not confirmed in time");
  for (uint64_t id : ids) {
    const proto::Connected& c = answers[id];
    if (c.code != 0) return Status(static_cast<StatusCode>(c.code), c.message);
  }
  return Status();
}

Status ClusterEngine::Impl::wait_applied(const std::vector<int>& ranks, uint64_t target) {
  const bool done = cv_.wait_for(mutex_, kApplyTimeout, [&]() REQUIRES(mutex_) {
    if (halting() || epoch() != target) return true;
    return std::all_of(ranks.begin(), ranks.end(), [&](int r) REQUIRES(mutex_) {
      const RankInfo& i = ranks_[r];
      return i.applied_epoch >= target || state(r) == RankState::kDead ||
             (state(r) == RankState::kStopped && i.spawned && i.pid == 0);
    });
  });
  if (halting()) return unavailable("shutting down");
  if (epoch() != target) return aborted("membership changed during the commit");
  if (!done) return deadline_exceeded("epoch " + std::to_string(target) + " not applied in time");
  return Status();
}

void ClusterEngine::Impl::rollback_joiners(const std::vector<int>& joiners) {
  // Caller holds mutex_. Nothing of theirs is in any map: kill them, detach members.
  proto::ConnectCommand detach;
  for (int r : joiners) {
    RankInfo& info = ranks_[r];
    info.joining = false;
    launch_queue_.erase(std::remove(launch_queue_.begin(), launch_queue_.end(), r),
                        launch_queue_.end());
    membership_.mark_stopped(r);  // Stopped, unless dead.
    if (info.spawned && info.pid > 0) {
      launcher_->kill_worker(info.pid);  // Reaped (and its segments removed) by check_workers.
    } else if (!info.routing_id.empty()) {
      post(r, proto::Shutdown{proto::Shutdown::kLeave});
      unlink_rank_segments(r, incarnation(r));
    }
    if (!info.spawned) info.pid = 0;    // Not ours to reap.
    if (info.pid == 0) rank_reaped(r);  // Not started yet, or not ours: its id is free.
    detach.ranks.push_back(r);
    detach.addresses.push_back("");
  }
  detach.id = next_connect_id_++;  // Not awaited: its answers are dropped.
  for (int m : members()) post(m, detach);
  wake();
}

Status ClusterEngine::Impl::start_joiners(const std::vector<int>& joiners,
                                          const std::function<bool()>& changed) {
  for (int r : joiners) {
    RankInfo& info = ranks_[r];
    if (info.spare && state(r) == RankState::kReady) {
      info.spare = false;  // Started ahead: loaded, Ready, not connected to anyone yet.
      info.joining = true;
      continue;
    }
    info = RankInfo{};
    membership_.open_rank(r, now_ms());  // Its next incarnation: starting.
    info.joining = true;
    request_launch(r);
  }
  auto failed = [&]() REQUIRES(mutex_) {
    for (int r : joiners) {
      const RankState s = state(r);
      if (s == RankState::kDead || s == RankState::kStopped) return r;
    }
    return -1;
  };
  cv_.wait_for(
      mutex_, std::chrono::milliseconds(options_.start_timeout_ms), [&]() REQUIRES(mutex_) {
        if (halting() || changed() || failed() >= 0) return true;
        return std::all_of(joiners.begin(), joiners.end(),
                           [&](int r) REQUIRES(mutex_) { return state(r) == RankState::kReady; });
      });
  if (halting()) return unavailable("shutting down");
  if (changed()) return aborted("the group changed while ranks started");
  if (int r = failed(); r >= 0) {
    return unavailable("rank " + std::to_string(r) +
                       " failed while starting: " + ranks_[r].last_error);
  }
  for (int r : joiners) {
    if (state(r) != RankState::kReady) {
      return deadline_exceeded("rank " + std::to_string(r) + " not ready within " +
                               std::to_string(options_.start_timeout_ms) + " ms");
    }
  }
  return Status();
}

std::map<int, proto::ConnectCommand> ClusterEngine::Impl::joiner_connects(
    const std::vector<int>& members, const std::vector<int>& joiners) const {
  int probe_region = -1;
  for (int l = 0; l < model_config_.num_hidden_layers && probe_region < 0; ++l) {
    if (model_config_.is_moe_layer(l)) probe_region = l;
  }
  auto is_joiner = [&](int r) {
    return std::find(joiners.begin(), joiners.end(), r) != joiners.end();
  };
  const std::vector<int> all = sorted_union(members, joiners);
  std::map<int, proto::ConnectCommand> connects;
  for (int r : all) {
    proto::ConnectCommand cmd;
    cmd.probe_region = probe_region;
    for (int p : all) {
      if (p == r || !(is_joiner(r) || is_joiner(p))) continue;
      cmd.ranks.push_back(p);
      cmd.addresses.push_back(ranks_[p].address);
      cmd.incarnations.push_back(incarnation(p));
    }
    if (!cmd.ranks.empty()) connects[r] = std::move(cmd);
  }
  return connects;
}

Status ClusterEngine::Impl::scale_up(const std::vector<int>& joiners, nlohmann::json* report) {
  const auto t0 = Clock::now();
  MutexLock lock(mutex_);
  const uint64_t epoch0 = epoch();
  const std::vector<int> old_members = members();
  // A rank lost meanwhile (an epoch, or a recovery under way) ends the preparation.
  auto group_changed = [&]() REQUIRES(mutex_) {
    return epoch() != epoch0 || members() != old_members || recovering();
  };
  // The membership's proposal: these joiners, prepared, then one commit.
  const int target = static_cast<int>(old_members.size() + joiners.size());
  FLEX_ASSIGN_OR_RETURN(const cluster::Actions opened, membership_.scale(target, {}, now_ms()));
  (void)opened;  // Its spawns are start_joiners' below.
  if (!membership_.proposal() || membership_.proposal()->joiners != joiners) {
    if (membership_.proposal()) {
      (void)membership_.abandon_proposal(membership_.proposal()->id, "changed", now_ms());
    }
    return aborted("the group changed before the scale-up started");
  }
  const uint64_t proposal = membership_.proposal()->id;
  auto fail = [&](Status s) REQUIRES(mutex_) {
    // The proposal first: abandoning it marks its joiners' processes as running, and the
    // rollback then frees the ids of those with no process (hand-started, not spawned yet).
    (void)membership_.abandon_proposal(proposal, s.message(), now_ms());
    rollback_joiners(joiners);
    (*report)["rolled_back"] = true;
    return s;
  };
  // 1. Start the joiners: dense weights from the checkpoint, no experts, a transport.
  reconfig_step_ = "starting workers";
  auto joiner_failed = [&]() REQUIRES(mutex_) {
    for (int r : joiners) {
      const RankState s = state(r);
      if (s == RankState::kDead || s == RankState::kStopped) return r;
    }
    return -1;
  };
  if (Status s = start_joiners(joiners, group_changed); !s.ok()) {
    if (!halting() && group_changed()) s = aborted("a rank was lost during the preparation");
    return fail(s);
  }
  (*report)["load_s"] = seconds_since(t0);

  // 2. Attach joiners and members to each other and prove it with one-sided reads.
  reconfig_step_ = "connecting";
  const std::vector<int> next_members = sorted_union(old_members, joiners);
  const std::map<int, proto::ConnectCommand> connects = joiner_connects(old_members, joiners);
  const auto t_connect = Clock::now();
  if (Status s = connect_all(
          connects, [&]() REQUIRES(mutex_) { return joiner_failed() >= 0 || group_changed(); });
      !s.ok()) {
    return fail(s);
  }
  if (group_changed()) return fail(aborted("a rank was lost during the preparation"));
  if (int r = joiner_failed(); r >= 0) {
    return fail(unavailable("rank " + std::to_string(r) + " failed while connecting"));
  }
  (*report)["connect_s"] = seconds_since(t_connect);

  // 3. Plan with the joiners; copy their experts from members' slots (not from disk).
  reconfig_step_ = "moving experts";
  const eplb::PlanInput input = plan_input(next_members, load_.smoothed(), /*prior=*/1.0);
  lock.unlock();
  auto plan = eplb::plan(input);
  lock.lock();
  if (!plan.ok()) return fail(plan.status());
  if (group_changed()) return fail(aborted("a rank was lost during the preparation"));
  // Per layer, on the load planned on (the smoothed load + the prior).
  (*report)["balancedness_planned"] = plan->balancedness;
  const int S = slots_per_rank_;
  std::vector<std::vector<int>> maps = input.current;
  Pulls copy_cmds;
  int copies = 0;
  for (int l = 0; l < placement_.num_layers(); ++l) {
    if (!model_config_.is_moe_layer(l)) continue;
    std::vector<int> rotation(placement_.num_experts(), 0);
    for (int j : joiners) {
      for (int s = j * S; s < (j + 1) * S; ++s) {
        const int e = plan->placement[l][s];
        if (e < 0) continue;
        const std::vector<int>& from = placement_.replicas(l, e);
        if (from.empty()) return fail(internal_error("expert without a replica"));
        const int src = from[rotation[e]++ % from.size()];
        add_pull(&copy_cmds, l, s, src / S, src % S);
        maps[l][s] = e;
        ++copies;
      }
    }
  }
  const auto t_pull = Clock::now();
  PullTotals done;
  const Status pulled = run_pulls(
      std::move(copy_cmds), kPullTimeout,
      [&]() REQUIRES(mutex_) { return halting() || group_changed() || joiner_failed() >= 0; },
      &done);
  if (halting()) return fail(unavailable("shutting down"));
  if (group_changed()) return fail(aborted("a rank was lost during the preparation"));
  if (int r = joiner_failed(); r >= 0) {
    return fail(unavailable("rank " + std::to_string(r) + " failed while receiving experts"));
  }
  if (pulled.code() == StatusCode::kDeadlineExceeded) {
    return fail(deadline_exceeded("expert copies to the joiners timed out"));
  }
  if (!pulled.ok()) return fail(pulled);
  const uint64_t bytes = done.num_bytes, device_copies = done.device_copies;
  (*report)["expert_copies"] = copies;
  (*report)["device_copies"] = device_copies;
  (*report)["copied_bytes"] = bytes;
  (*report)["copy_s"] = seconds_since(t_pull);
  moved_bytes().inc(static_cast<double>(bytes));
  auto next = ExpertPlacement::from_slot_maps(placement_.num_experts(), std::move(maps));
  if (!next.ok()) return fail(next.status());
  (*report)["prepare_s"] = seconds_since(t0);

  // 4. Commit: every rank switches at one step boundary; joiners start stepping.
  reconfig_step_ = "committing";
  std::vector<std::vector<int>> next_maps;
  for (int l = 0; l < next->num_layers(); ++l) next_maps.push_back(next->slot_map(l));
  auto planned = membership_.set_plan(proposal, std::move(next_maps), now_ms());
  if (!planned.ok()) return fail(planned.status());
  // Every joiner is loaded and attached: its acknowledgement; the last one commits.
  cluster::Actions acks;
  for (int r : joiners) {
    for (cluster::Action& a : membership_.prepared(r, incarnation(r), proposal, now_ms())) {
      acks.push_back(std::move(a));
    }
  }
  auto commit = std::find_if(acks.begin(), acks.end(), [](const cluster::Action& a) {
    return a.kind == cluster::ActionKind::kCommit;
  });
  if (commit == acks.end()) return fail(internal_error("the membership did not commit"));
  placement_ = std::move(next).value();
  const auto t_commit = Clock::now();
  send_epoch(*commit);
  run_requests(acks, nullptr);  // Nothing is held while scaling; kept for the rule's sake.
  for (int r : joiners) ranks_[r].joining = false;
  reconfigurations().inc();
  const uint64_t epoch1 = epoch();
  FLEX_RETURN_IF_ERROR(wait_applied(next_members, epoch1));
  (*report)["commit_s"] = seconds_since(t_commit);

  // 5. The rest of the plan (e.g. replicas old ranks no longer need), while serving.
  reconfig_step_ = "rebalancing";
  rebalance_epoch_ = epoch();
  cancel_rebalance_ = false;
  const int num_layers = placement_.num_layers();
  lock.unlock();
  PullTotals moved;
  Status s;
  for (int l = 0; s.ok() && l < num_layers; ++l) {
    if (model_config_.is_moe_layer(l)) s = move_layer(l, plan->placement[l], &moved);
  }
  lock.lock();
  moved_bytes().inc(static_cast<double>(moved.num_bytes));
  (*report)["converge_moved_bytes"] = moved.num_bytes;
  (*report)["converge_moved_slots"] = moved.slots;
  if (!s.ok()) (*report)["converge_status"] = s.to_string();  // Committed all the same.
  return Status();
}

Status ClusterEngine::Impl::scale_down(const std::vector<int>& leavers, nlohmann::json* report) {
  const auto t0 = Clock::now();
  MutexLock lock(mutex_);
  std::vector<int> survivors;
  for (int r : members()) {
    if (std::find(leavers.begin(), leavers.end(), r) == leavers.end()) survivors.push_back(r);
  }
  // 1. Plan without the leavers (fails early, e.g. too few slots, before anything moves).
  auto plan = eplb::plan(plan_input(survivors, load_.smoothed(), /*prior=*/1.0));
  if (!plan.ok()) {
    return invalid_argument("cannot shrink to " + std::to_string(survivors.size()) +
                            " ranks: " + plan.status().message());
  }
  (*report)["balancedness_planned"] = plan->balancedness;  // As the scale-up's.
  // The membership's proposal: these leavers (phase scaling), committed without them.
  FLEX_ASSIGN_OR_RETURN(const cluster::Actions opened, membership_.scale(-1, leavers, now_ms()));
  (void)opened;
  if (!membership_.proposal() || membership_.proposal()->leavers != leavers) {
    if (membership_.proposal()) {
      (void)membership_.abandon_proposal(membership_.proposal()->id, "changed", now_ms());
    }
    return aborted("the group changed before the scale-down started");
  }
  const uint64_t proposal = membership_.proposal()->id;
  for (int r : leavers) ranks_[r].leaving = true;  // No new requests from here on.
  auto unmark = [&]() REQUIRES(mutex_) {
    for (int r : leavers) ranks_[r].leaving = false;
    (void)membership_.abandon_proposal(proposal, "the scale-down stopped", now_ms());
  };
  // 2. Move experts off the leavers (transition steps; everybody keeps serving).
  reconfig_step_ = "moving experts";
  rebalance_epoch_ = epoch();
  cancel_rebalance_ = false;
  const int num_layers = placement_.num_layers();
  lock.unlock();
  PullTotals moved;
  Status s;
  for (int l = 0; s.ok() && l < num_layers; ++l) {
    if (model_config_.is_moe_layer(l)) s = move_layer(l, plan->placement[l], &moved);
  }
  lock.lock();
  moved_bytes().inc(static_cast<double>(moved.num_bytes));
  (*report)["moved_bytes"] = moved.num_bytes;
  (*report)["moved_slots"] = moved.slots;
  (*report)["prepare_s"] = seconds_since(t0);
  if (!s.ok()) {
    unmark();
    return s;
  }
  // 3. Drain: the leavers take no new requests since step 1; what they run finishes there
  // (up to --leave-drain-ms), since a request moved to a survivor prefills its prompt and
  // streamed tokens again in one step that every request of the group waits for.
  reconfig_step_ = "draining the leavers";
  const auto t_drain = Clock::now();
  cv_.wait_for(mutex_, std::chrono::milliseconds(options_.leave_drain_ms), [&]() REQUIRES(mutex_) {
    if (halting() || cancel_rebalance_ || recovering() || epoch() != rebalance_epoch_) return true;
    return std::none_of(requests_.begin(), requests_.end(), [&](const auto& kv) {
      return std::find(leavers.begin(), leavers.end(), kv.second.rank) != leavers.end();
    });
  });
  (*report)["drain_s"] = seconds_since(t_drain);
  // 4. Commit: the leavers switch with everyone, then stop stepping; their
  // unfinished requests re-run on survivors.
  reconfig_step_ = "committing";
  for (int r : members()) {
    if (state(r) != RankState::kServing || cancel_rebalance_ || recovering() ||
        epoch() != rebalance_epoch_) {
      unmark();
      return aborted("the group changed while experts moved (rank " + std::to_string(r) + ")");
    }
  }
  // The maps without the leavers: nothing left to load, so the plan commits at once.
  std::vector<std::vector<int>> maps;
  for (int l = 0; l < placement_.num_layers(); ++l) maps.push_back(placement_.slot_map(l));
  auto planned = membership_.set_plan(proposal, std::move(maps), now_ms());
  const cluster::Action* commit = nullptr;
  if (planned.ok()) {
    for (const cluster::Action& a : *planned) {
      if (a.kind == cluster::ActionKind::kCommit) commit = &a;
    }
  }
  if (commit == nullptr) {
    unmark();
    return planned.ok() ? internal_error("the membership did not commit the scale-down")
                        : planned.status();
  }
  const auto t_commit = Clock::now();
  const cluster::Actions decided = *planned;  // The commit, then the leavers' requests placed.
  send_epoch(*commit);
  reconfigurations().inc();
  const uint64_t epoch1 = epoch();
  int reruns = 0;
  for (const cluster::Action& a : decided) {
    reruns += a.kind == cluster::ActionKind::kPlace &&
              std::find(leavers.begin(), leavers.end(), a.from_rank) != leavers.end();
  }
  Calls calls;
  run_requests(decided, &calls);
  for (int r : leavers) {
    ranks_[r].leaving = false;
    // Stopped by the commit (the membership's state): its exit is not a loss.
    post(r, proto::Shutdown{proto::Shutdown::kLeave});
  }
  wake();
  lock.unlock();
  for (auto& [cb, ev] : calls) cb(ev);
  lock.lock();
  Status applied = wait_applied(sorted_union(survivors, leavers), epoch1);
  for (int r : leavers) {
    // A hand-started leaver exits where no waitpid of ours sees it: its id is free once the
    // commit stopped it, as a lost one's is (on_rank_lost); a later incarnation of the id is
    // fenced from it. Spawned leavers free theirs when reaped (check_workers).
    if (ranks_[r].spawned || state(r) != RankState::kStopped) continue;
    ranks_[r].pid = 0;
    rank_reaped(r);
  }
  (*report)["commit_s"] = seconds_since(t_commit);
  (*report)["rerun_requests"] = reruns;
  return applied;
}

Status ClusterEngine::Impl::restart_group(int num_ranks, nlohmann::json* report) {
  // Stop-the-world: admission is closed (503) by the caller; drain, stop all, restart.
  const auto t0 = Clock::now();
  MutexLock lock(mutex_);
  reconfig_step_ = "draining";
  cv_.wait_for(lock, std::chrono::seconds(60),
               [&]() REQUIRES(mutex_) { return halting() || requests_.empty(); });
  if (halting()) return unavailable("shutting down");
  if (!requests_.empty()) {
    Calls calls;
    fail_all("aborted by a stop-the-world reconfiguration", &calls);
    lock.unlock();
    for (auto& [cb, ev] : calls) cb(ev);
    lock.lock();
  }
  (*report)["drain_s"] = seconds_since(t0);
  reconfig_step_ = "stopping workers";
  for (int r : std::vector<int>(members())) {
    if (state(r) != RankState::kDead) post(r, proto::Shutdown{proto::Shutdown::kStop});
    membership_.mark_stopped(r);
  }
  wake();
  cv_.wait_for(lock, std::chrono::seconds(10), [&]() REQUIRES(mutex_) {
    return halting() ||
           std::all_of(ranks_.begin(), ranks_.end(), [](const RankInfo& i) { return i.pid == 0; });
  });
  for (auto& info : ranks_) {
    if (info.spawned && info.pid > 0) launcher_->kill_worker(info.pid);
  }
  cv_.wait_for(lock, std::chrono::seconds(5), [&]() REQUIRES(mutex_) {
    return std::all_of(ranks_.begin(), ranks_.end(), [](const RankInfo& i) { return i.pid == 0; });
  });
  (*report)["stop_s"] = seconds_since(t0);
  reconfig_step_ = "starting workers";
  std::vector<int> next;
  for (int r = 0; r < num_ranks; ++r) next.push_back(r);
  const int E = std::max(1, model_config_.num_experts);
  FLEX_ASSIGN_OR_RETURN(
      placement_, ExpertPlacement::spread(model_config_.num_hidden_layers, E, options_.max_ranks,
                                          slots_per_rank_, next, 0, 0));
  for (int r : next) {
    ranks_[r] = RankInfo{};
    membership_.open_rank(r, now_ms());
    request_launch(r);
  }
  cv_.wait_for(lock, std::chrono::milliseconds(options_.start_timeout_ms), [&]() REQUIRES(mutex_) {
    return halting() || std::all_of(next.begin(), next.end(), [&](int r) REQUIRES(mutex_) {
             return state(r) == RankState::kReady || state(r) == RankState::kDead;
           });
  });
  for (int r : next) {
    if (state(r) != RankState::kReady) {
      enter_phase(Phase::kDegraded);
      return unavailable("rank " + std::to_string(r) + " did not restart");
    }
  }
  commit_epoch(next);
  reconfigurations().inc();
  FLEX_RETURN_IF_ERROR(wait_applied(next, epoch()));
  enter_phase(Phase::kServing);
  accepting_ = true;
  (*report)["epoch"] = epoch();
  (*report)["members"] = members();
  (*report)["total_s"] = seconds_since(t0);
  return Status();
}

Result<nlohmann::json> ClusterEngine::Impl::scale(const ScaleTarget& target,
                                                  const std::string& kind) {
  std::vector<int> joiners, leavers;
  const bool stop_the_world = options_.reconfigure == "stop-the-world";
  {
    MutexLock lock(mutex_);
    if (reconfiguring_) return failed_precondition("a reconfiguration is already in progress");
    if (rebalancing_) return failed_precondition("an expert rebalance is in progress");
    if (halting()) return unavailable("the server is shutting down");
    if (recovering() && !stop_the_world) {
      // A recovery runs (after a loss, or the healer's retry out of degraded): its outcome
      // decides what this scale does (a scale from serving, or a repair from degraded).
      const auto limit =
          std::chrono::milliseconds(options_.start_timeout_ms) + std::chrono::minutes(3);
      cv_.wait_for(lock, limit, [&]() REQUIRES(mutex_) { return halting() || !recovering(); });
      if (halting()) return unavailable("the server is shutting down");
      if (reconfiguring_) return failed_precondition("a reconfiguration is already in progress");
      if (rebalancing_) return failed_precondition("an expert rebalance is in progress");
    }
    if (phase() == Phase::kDegraded && !stop_the_world) return retry_recovery(target);
    if (phase() != Phase::kServing) {
      return failed_precondition("the group is not serving (phase " +
                                 std::string(phase_name(phase())) + ")");
    }
    for (int r : members()) {
      // As for a rebalance: no weight moves while a member may use an older map.
      if (ranks_[r].map_version != map_version_) {
        return failed_precondition("rank " + std::to_string(r) + " has not applied expert map " +
                                   std::to_string(map_version_) + " yet");
      }
    }
    // The membership chooses (docs/ARCHITECTURE.md, "The membership state machine"):
    // Ready spares, then free ids; the least loaded (the requests it placed) leave.
    auto choose = [&]() REQUIRES(mutex_) {
      return membership_.choose_scale(target.remove.empty() ? target.ranks : -1, target.remove);
    };
    // Ids of ranks still exiting (a scale-down a moment ago) free up shortly.
    cv_.wait_for(lock, std::chrono::seconds(5), [&]() REQUIRES(mutex_) {
      auto c = choose();
      return halting() || !c.ok() || c->not_reaped == 0;
    });
    FLEX_ASSIGN_OR_RETURN(const cluster::ScaleChoice choice, choose());
    if (choice.not_reaped > 0) {
      return failed_precondition("only " +
                                 std::to_string(choice.joiners.size() - choice.not_reaped) +
                                 " rank ids are free (others are still exiting)");
    }
    joiners = choice.joiners;
    leavers = choice.leavers;
    if (joiners.empty() && leavers.empty()) {
      return nlohmann::json{{"epoch", epoch()}, {"members", members()}, {"changed", false}};
    }
    if (stop_the_world && !launcher_->owns_workers()) {
      return invalid_argument("--reconfigure stop-the-world needs spawned workers");
    }
    reconfiguring_ = true;
    // A live scale's phase comes with its proposal (scale_up, scale_down open it).
    if (stop_the_world) enter_phase(Phase::kScaling);
    if (stop_the_world) accepting_ = false;
  }
  const auto t0 = Clock::now();
  nlohmann::json report = {{"kind", !kind.empty()     ? kind
                                    : joiners.empty() ? "scale-down"
                                                      : "scale-up"},
                           {"mode", stop_the_world ? "stop-the-world" : "live"}};
  if (!joiners.empty()) report["joined"] = joiners;
  if (!leavers.empty()) report["left"] = leavers;
  FLEX_LOG(INFO) << report["kind"].get<std::string>() << " (" << report["mode"].get<std::string>()
                 << "): +" << joiners.size() << " -" << leavers.size() << " ranks";
  Status s;
  if (stop_the_world) {
    int n = 0;
    {
      MutexLock lock(mutex_);
      n = static_cast<int>(members().size() + joiners.size() - leavers.size());
    }
    s = restart_group(n, &report);
  } else if (!joiners.empty()) {
    s = scale_up(joiners, &report);
  } else {
    s = scale_down(leavers, &report);
  }
  MutexLock lock(mutex_);
  reconfiguring_ = false;
  reconfig_step_.clear();
  if (!halting()) {
    if (phase() == Phase::kScaling || (stop_the_world && phase() != Phase::kDegraded))
      enter_phase(Phase::kServing);
    if (stop_the_world) accepting_ = phase() == Phase::kServing;
  }
  report["total_s"] = seconds_since(t0);
  report["epoch"] = epoch();
  report["members"] = members();
  report["status"] = s.ok() ? "ok" : s.to_string();
  last_reconfig_ = report;
  if (s.ok()) target_ranks_ = static_cast<int>(members().size());
  cv_.notify_all();
  FLEX_LOG(INFO) << "reconfiguration: " << report.dump();
  if (!s.ok()) return s;
  return report;
}

Result<nlohmann::json> ClusterEngine::Impl::retry_recovery(const ScaleTarget& target) {
  // Degraded: the survivors are halted and hold what is left. A scale asks the healer
  // for another recovery, with room for `ranks` (more ids freed or workers started).
  if (!target.remove.empty()) {
    return failed_precondition("the group is degraded (" + membership_.degraded_reason() +
                               "): only {\"ranks\": N} can repair it");
  }
  if (target.ranks < 1 || target.ranks > options_.max_ranks) {
    return invalid_argument("\"ranks\" must be in [1, " + std::to_string(options_.max_ranks) +
                            "] (--max-ranks), got " + std::to_string(target.ranks));
  }
  // The membership's repair path: the operator's size, fresh attempts, phase recovering
  // (the healer runs it).
  FLEX_RETURN_IF_ERROR(membership_.scale(target.ranks, {}, now_ms()).status());
  target_ranks_ = target.ranks;
  cv_.notify_all();
  const auto limit = std::chrono::milliseconds(options_.start_timeout_ms) + std::chrono::minutes(3);
  cv_.wait_for(mutex_, limit, [&]() REQUIRES(mutex_) { return halting() || !recovering(); });
  if (phase() != Phase::kServing && phase() != Phase::kScaling) {
    // Degraded again: the membership says why as it gives up (the last attempt's failure,
    // also when a replacement's loss decided it on the control thread).
    const std::string& why = membership_.degraded_reason();
    return unavailable("recovery failed: " + (why.empty() ? std::string("timed out") : why));
  }
  // The healer wrote the report under the lock hold that ended the recovery (heal_loop).
  return last_recovery_;
}

nlohmann::json ClusterEngine::Impl::reconfig_status() const {
  // Caller holds mutex_.
  nlohmann::json recovered = nlohmann::json::object();
  for (const char* outcome : {"in_place", "replacement", "failed"}) {
    recovered[outcome] = static_cast<uint64_t>(recoveries(outcome).value());
  }
  nlohmann::json out = {{"in_progress", reconfiguring_ || recovering()},
                        {"step", reconfig_step_},
                        {"target_ranks", target_ranks_},
                        {"recoveries", recovered},
                        {"last_recovery", last_recovery_},
                        {"mode", options_.reconfigure},
                        {"reconfigurations", static_cast<uint64_t>(reconfigurations().value())},
                        {"reruns", static_cast<uint64_t>(reruns().value())},
                        {"last", last_reconfig_}};
  // The healer's next try (retry_degraded) and how many it made since serving.
  if (const std::optional<double> in_s = degraded_retry_in_s()) out["retry_in_s"] = *in_s;
  if (degraded_retries_ > 0) out["degraded_retries"] = degraded_retries_;
  return out;
}

Result<nlohmann::json> ClusterEngine::scale(const ScaleTarget& target) {
  return impl_->scale(target);
}

}  // namespace flexpert
