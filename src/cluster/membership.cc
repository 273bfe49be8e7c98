// SPDX-License-Identifier: Apache-2.0
#include "cluster/membership.h"

#include <algorithm>
#include <utility>

#include "cluster/membership_util.h"

namespace flexpert::cluster {

using detail::act;
using detail::contains;
using detail::sorted_union;

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kStarting:
      return "starting";
    case Phase::kServing:
      return "serving";
    case Phase::kScaling:
      return "scaling";
    case Phase::kRecovering:
      return "recovering";
    case Phase::kDegraded:
      return "degraded";
    case Phase::kRestarting:
      return "restarting";
    case Phase::kStopping:
      return "stopping";
    case Phase::kStopped:
      return "stopped";
  }
  return "?";
}

const char* rank_state_name(RankState s) {
  switch (s) {
    case RankState::kEmpty:
      return "empty";
    case RankState::kStarting:
      return "starting";
    case RankState::kReady:
      return "ready";
    case RankState::kServing:
      return "serving";
    case RankState::kDead:
      return "dead";
    case RankState::kStopped:
      return "stopped";
  }
  return "?";
}

const char* action_name(ActionKind k) {
  switch (k) {
    case ActionKind::kSpawn:
      return "spawn";
    case ActionKind::kFence:
      return "fence";
    case ActionKind::kPrepare:
      return "prepare";
    case ActionKind::kRollback:
      return "rollback";
    case ActionKind::kCommit:
      return "commit";
    case ActionKind::kStop:
      return "stop";
    case ActionKind::kCancelRebalance:
      return "cancel-rebalance";
    case ActionKind::kPlace:
      return "place";
    case ActionKind::kHold:
      return "hold";
    case ActionKind::kAnswer:
      return "answer";
    case ActionKind::kFail:
      return "fail";
  }
  return "?";
}

Membership::Membership(MembershipConfig config) : config_(std::move(config)) {
  ranks_.assign(static_cast<size_t>(std::max(1, config_.max_ranks)), RankView{});
  maps_ = config_.maps;
  target_ranks_ = config_.initial_ranks;
}

Actions Membership::start(int64_t now_ms) {
  Actions out;
  for (int r = 0; r < config_.initial_ranks && valid_rank(r); ++r) {
    open(r, &out);
    ranks_[r].last_seen_ms = now_ms;
  }
  return out;
}

// --- Ranks ---------------------------------------------------------------------------

bool Membership::is_member(int r) const { return contains(members_, r); }

bool Membership::current(int r, uint64_t incarnation) const {
  return valid_rank(r) && ranks_[r].admitted && ranks_[r].incarnation == incarnation;
}

bool Membership::accepts(int r, uint64_t incarnation) const {
  if (!current(r, incarnation)) return false;
  const RankState s = ranks_[r].state;
  // A leaver (stopped) still reports the switch it takes part in.
  return s != RankState::kDead && s != RankState::kEmpty;
}

void Membership::open(int r, Actions* out) {
  RankView& info = ranks_[r];
  info.state = RankState::kStarting;
  info.admitted = false;
  info.leaving = false;
  info.in_flight = 0;
  if (info.reaped) {
    out->push_back(act(ActionKind::kSpawn, r));
  } else if (proposal_) {
    proposal_->spawn_wait.insert(r);  // Spawned by reaped().
  }
}

Result<uint64_t> Membership::hello(int r, int64_t now_ms) {
  if (!valid_rank(r)) return failed_precondition("rank " + std::to_string(r) + " is out of range");
  RankView& info = ranks_[r];
  if (info.state != RankState::kStarting || info.admitted || !info.reaped) {
    return failed_precondition("rank " + std::to_string(r) + " is not open for joining");
  }
  // A new number for every admission: an incarnation once declared lost never returns.
  info.incarnation += 1;
  info.admitted = true;
  info.last_seen_ms = now_ms;
  return info.incarnation;
}

Actions Membership::heartbeat(int r, uint64_t incarnation, int64_t now_ms) {
  if (accepts(r, incarnation)) ranks_[r].last_seen_ms = now_ms;
  return {};
}

Actions Membership::ready(int r, uint64_t incarnation, int64_t now_ms) {
  Actions out;
  if (!accepts(r, incarnation) || ranks_[r].state != RankState::kStarting) return out;
  ranks_[r].state = RankState::kReady;
  ranks_[r].last_seen_ms = now_ms;
  if (phase_ == Phase::kStarting) {
    std::vector<int> initial;
    for (int i = 0; i < config_.initial_ranks; ++i) {
      if (ranks_[i].state != RankState::kReady) return out;
      initial.push_back(i);
    }
    map_version_ += 1;
    commit(initial, {}, &out);
    set_phase(Phase::kServing);
  }
  return out;
}

Actions Membership::lost(int r, uint64_t incarnation, const std::string& why, int64_t now_ms) {
  Actions out;
  if (!valid_rank(r)) return out;
  RankView& info = ranks_[r];
  // An older incarnation (also one whose id was opened again for the next).
  if (incarnation != 0 && (incarnation != info.incarnation || !info.admitted)) return out;
  if (info.state == RankState::kEmpty || info.state == RankState::kDead ||
      info.state == RankState::kStopped) {
    return out;
  }
  info.reaped = false;  // Until the driver has seen its process end.
  if (phase_ == Phase::kStopping || phase_ == Phase::kStopped) {
    info.state = RankState::kStopped;  // Leaving as asked, not lost.
    return out;
  }
  const bool was_member = is_member(r);
  const bool was_joiner = proposal_ && contains(proposal_->joiners, r);
  info.state = RankState::kDead;
  info.leaving = false;
  {
    Action a = act(ActionKind::kFence, r);
    a.incarnation = info.incarnation;
    a.reason = why;
    out.push_back(std::move(a));
  }
  if (was_member) {
    members_.erase(std::remove(members_.begin(), members_.end(), r), members_.end());
    lost_.push_back(r);
    if (rebalancing_) {
      rebalancing_ = false;
      {
        Action a = act(ActionKind::kCancelRebalance);
        a.reason = why;
        out.push_back(std::move(a));
      }
    }
    // Its requests re-run from their prompt plus what was streamed, after the next commit.
    for (auto& [id, req] : requests_) {
      if (req.rank == r) {
        req.rank = -1;
        req.attempt += 1;
        {
          Action a = act(ActionKind::kHold);
          a.request = id;
          a.attempt = req.attempt;
          a.from_rank = r;
          a.reason = why;
          out.push_back(std::move(a));
        }
      }
    }
    info.in_flight = 0;
    if (phase_ == Phase::kStarting) return out;  // The driver fails the start.
    if (phase_ == Phase::kDegraded) return out;  // Only a scale repairs it.
    abandon(&out);  // A scale or a recovery planned with the lost rank.
    if (phase_ != Phase::kRecovering) recovery_started_ms_ = now_ms;
    set_phase(Phase::kRecovering);
    if (config_.plan_on_loss) plan_recovery_proposal(now_ms, &out);
  } else if (was_joiner) {
    if (proposal_->kind == Proposal::Kind::kRecovery) {
      fail_recovery_attempt("replacement rank " + std::to_string(r) + " lost: " + why, now_ms,
                            &out);
    } else {
      abandon(&out);
      set_phase(Phase::kServing);
    }
  }
  return out;
}

Actions Membership::reaped(int r, int64_t now_ms) {
  Actions out;
  if (!valid_rank(r)) return out;
  RankView& info = ranks_[r];
  const bool alive = info.state == RankState::kStarting || info.state == RankState::kReady ||
                     info.state == RankState::kServing;
  if (alive && info.admitted) return out;  // Its current process: a loss (lost()), not this.
  info.reaped = true;
  if (proposal_ && proposal_->spawn_wait.erase(r) > 0) {
    out.push_back(act(ActionKind::kSpawn, r));
    info.last_seen_ms = now_ms;
  }
  maybe_commit(now_ms, &out);
  return out;
}

std::vector<std::pair<int, uint64_t>> Membership::silent(int64_t now_ms) const {
  std::vector<std::pair<int, uint64_t>> out;
  for (int r = 0; r < num_ranks(); ++r) {
    const RankView& info = ranks_[r];
    const bool watched =
        info.admitted && (info.state == RankState::kStarting || info.state == RankState::kReady ||
                          info.state == RankState::kServing);
    if (watched && now_ms - info.last_seen_ms > config_.heartbeat_timeout_ms) {
      out.emplace_back(r, info.incarnation);
    }
  }
  return out;
}

Actions Membership::tick(int64_t now_ms) {
  Actions out;
  for (const auto& [r, incarnation] : silent(now_ms)) {
    Actions a =
        lost(r, incarnation,
             "no heartbeat for " + std::to_string(config_.heartbeat_timeout_ms) + " ms", now_ms);
    out.insert(out.end(), a.begin(), a.end());
  }
  if (proposal_ && config_.prepare_timeout_ms > 0 && now_ms > proposal_->deadline_ms) {
    if (proposal_->kind == Proposal::Kind::kRecovery) {
      fail_recovery_attempt("the recovery's preparation timed out", now_ms, &out);
    } else {
      abandon(&out);
      set_phase(Phase::kServing);
    }
  }
  return out;
}

Actions Membership::halted(int r, uint64_t incarnation, uint64_t epoch, int64_t now_ms) {
  (void)now_ms;
  Actions out;
  if (!accepts(r, incarnation) || epoch != epoch_ || epoch_ == 0 || !is_member(r)) return out;
  if (phase_ != Phase::kServing && phase_ != Phase::kScaling) return out;
  commit(members_, {}, &out);  // The same members, a fresh epoch: every step loop restarts.
  return out;
}

void Membership::applied(int r, uint64_t incarnation, uint64_t epoch) {
  if (accepts(r, incarnation) && epoch <= epoch_) {
    ranks_[r].applied_epoch = std::max(ranks_[r].applied_epoch, epoch);
  }
}

// --- Driver hooks ---------------------------------------------------------------------

void Membership::open_rank(int r, int64_t now_ms) {
  if (!valid_rank(r)) return;
  Actions ignored;  // The driver spawns (or waits for a hand-started worker) itself.
  open(r, &ignored);
  ranks_[r].last_seen_ms = now_ms;
}

Status Membership::commit_members(std::vector<int> members, const std::vector<int>& also,
                                  Actions* out) {
  for (int r : members) {
    if (!valid_rank(r) || !ranks_[r].admitted || ranks_[r].state == RankState::kDead ||
        ranks_[r].state == RankState::kEmpty || ranks_[r].state == RankState::kStopped) {
      return failed_precondition("rank " + std::to_string(r) +
                                 " cannot be a member: not an admitted, live incarnation");
    }
  }
  commit(std::move(members), also, out);
  return Status();
}

Status Membership::record_maps(std::vector<std::vector<int>> maps,
                               const std::vector<int>& members) {
  FLEX_RETURN_IF_ERROR(check_maps(maps, members));
  maps_ = std::move(maps);
  map_version_ += 1;
  return Status();
}

void Membership::mark_lost(int r) {
  if (!valid_rank(r)) return;
  ranks_[r].state = RankState::kDead;
  ranks_[r].reaped = false;
  ranks_[r].leaving = false;
  members_.erase(std::remove(members_.begin(), members_.end(), r), members_.end());
}

Actions Membership::give_up_recovery(const std::string& why) {
  Actions out;
  if (phase_ == Phase::kRecovering) enter_degraded(why, &out);
  return out;
}

void Membership::mark_stopped(int r) {
  if (!valid_rank(r) || ranks_[r].state == RankState::kDead) return;
  if (ranks_[r].state != RankState::kEmpty) ranks_[r].reaped = false;
  ranks_[r].state = RankState::kStopped;
  ranks_[r].leaving = false;
  members_.erase(std::remove(members_.begin(), members_.end(), r), members_.end());
}

// --- Reconfiguration -------------------------------------------------------------------

std::vector<int> Membership::free_ids() const {
  std::vector<int> spares, reaped, waiting;
  for (int r = 0; r < num_ranks(); ++r) {
    const RankState s = ranks_[r].state;
    if (is_member(r) || (proposal_ && contains(proposal_->joiners, r))) continue;
    if (s == RankState::kReady) {
      spares.push_back(r);  // Started ahead (--spare-ranks): loaded, not a member.
    } else if (s == RankState::kEmpty || s == RankState::kDead || s == RankState::kStopped) {
      (ranks_[r].reaped ? reaped : waiting).push_back(r);
    }
  }
  spares.insert(spares.end(), reaped.begin(), reaped.end());
  spares.insert(spares.end(), waiting.begin(), waiting.end());
  return spares;
}

void Membership::open_joiners(const std::vector<int>& joiners, int64_t now_ms, Actions* out) {
  for (int r : joiners) {
    if (ranks_[r].state == RankState::kReady) continue;  // A spare: Ready already.
    open(r, out);
    ranks_[r].last_seen_ms = now_ms;
  }
}

Result<ScaleChoice> Membership::choose_scale(int target, const std::vector<int>& remove,
                                             const std::vector<int>& in_flight) const {
  const int max = num_ranks();
  const int now = static_cast<int>(members_.size());
  ScaleChoice choice;
  if (!remove.empty()) {
    for (int r : remove) {
      if (!is_member(r)) return invalid_argument("rank " + std::to_string(r) + " is not a member");
      if (!contains(choice.leavers, r)) choice.leavers.push_back(r);
    }
    if (static_cast<int>(choice.leavers.size()) >= now) {
      return invalid_argument("cannot remove every member (at least 1 rank must stay)");
    }
  } else {
    if (target < 1 || target > max) {
      return invalid_argument("\"ranks\" must be in [1, " + std::to_string(max) +
                              "] (--max-ranks), got " + std::to_string(target));
    }
    if (target > now) {
      const std::vector<int> free = free_ids();
      if (static_cast<int>(free.size()) < target - now) {
        return failed_precondition("only " + std::to_string(free.size()) + " rank ids are free");
      }
      choice.joiners.assign(free.begin(), free.begin() + (target - now));
      for (int r : choice.joiners) {
        choice.not_reaped += ranks_[r].state != RankState::kReady && !ranks_[r].reaped;
      }
    } else if (target < now) {
      // The least loaded leave (ties: the highest ids), so that fewest requests move.
      auto load = [&](int r) {
        return r < static_cast<int>(in_flight.size()) ? in_flight[r] : ranks_[r].in_flight;
      };
      std::vector<int> order = members_;
      std::sort(order.begin(), order.end(), [&](int a, int b) {
        if (load(a) != load(b)) return load(a) < load(b);
        return a > b;
      });
      choice.leavers.assign(order.begin(), order.begin() + (now - target));
    }
  }
  std::sort(choice.leavers.begin(), choice.leavers.end());
  return choice;
}

void Membership::set_phase(Phase p) {
  if (p != phase_) history_.push_back(p);
  phase_ = p;
}

Result<Actions> Membership::scale(int target, const std::vector<int>& remove, int64_t now_ms) {
  Actions out;
  const int max = num_ranks();
  if (phase_ == Phase::kDegraded) {
    if (!remove.empty()) {
      return failed_precondition("the group is degraded (" + degraded_reason_ +
                                 "): only {\"ranks\": N} can repair it");
    }
    if (target < 1 || target > max) {
      return invalid_argument("\"ranks\" must be in [1, " + std::to_string(max) +
                              "] (--max-ranks), got " + std::to_string(target));
    }
    target_ranks_ = target;
    failed_attempts_ = 0;
    recovery_started_ms_ = now_ms;
    set_phase(Phase::kRecovering);
    if (config_.plan_on_loss) plan_recovery_proposal(now_ms, &out);
    return out;
  }
  if (proposal_) return failed_precondition("a reconfiguration is already in progress");
  if (rebalancing_) return failed_precondition("an expert rebalance is in progress");
  if (phase_ != Phase::kServing) {
    return failed_precondition("the group is not serving (phase " +
                               std::string(phase_name(phase_)) + ")");
  }
  FLEX_ASSIGN_OR_RETURN(const ScaleChoice choice, choose_scale(target, remove));
  std::vector<int> joiners = choice.joiners, leavers = choice.leavers;
  std::sort(joiners.begin(), joiners.end());
  std::sort(leavers.begin(), leavers.end());
  if (joiners.empty() && leavers.empty()) return out;
  Proposal p;
  p.kind = joiners.empty() ? Proposal::Kind::kScaleDown : Proposal::Kind::kScaleUp;
  p.id = next_proposal_++;
  p.joiners = joiners;
  p.leavers = leavers;
  for (int r : sorted_union(members_, joiners)) {
    if (!contains(leavers, r)) p.members.push_back(r);
  }
  p.awaiting.insert(joiners.begin(), joiners.end());
  p.deadline_ms = now_ms + config_.prepare_timeout_ms;
  proposal_ = std::move(p);
  open_joiners(joiners, now_ms, &out);
  for (int r : leavers) ranks_[r].leaving = true;  // No new requests from here on.
  set_phase(Phase::kScaling);
  return out;
}

Status Membership::check_maps(const std::vector<std::vector<int>>& maps,
                              const std::vector<int>& members) const {
  const int S = config_.slots_per_rank;
  if (maps.size() != maps_.size()) return invalid_argument("the plan has the wrong layer count");
  for (size_t l = 0; l < maps.size(); ++l) {
    if (maps[l].size() != maps_[l].size()) {
      return invalid_argument("layer " + std::to_string(l) + " has the wrong slot count");
    }
    if (l >= config_.routed.size() || !config_.routed[l]) continue;  // No routed experts.
    std::vector<int> count(static_cast<size_t>(config_.num_experts), 0);
    for (size_t s = 0; s < maps[l].size(); ++s) {
      const int e = maps[l][s];
      if (e < -1 || e >= config_.num_experts) {
        return invalid_argument("slot " + std::to_string(s) + " holds no valid expert");
      }
      if (e < 0) continue;
      if (!contains(members, static_cast<int>(s) / S)) {
        return invalid_argument("slot " + std::to_string(s) + " of layer " + std::to_string(l) +
                                " is on a rank that is not a member");
      }
      count[e] += 1;
    }
    for (int e = 0; e < config_.num_experts; ++e) {
      if (count[e] == 0) {
        return invalid_argument("expert " + std::to_string(e) + " of layer " + std::to_string(l) +
                                " has no replica on a member");
      }
    }
  }
  return Status();
}

Result<Actions> Membership::set_plan(uint64_t proposal, std::vector<std::vector<int>> maps,
                                     int64_t now_ms) {
  if (!proposal_ || proposal_->id != proposal) return aborted("the proposal was abandoned");
  Proposal& p = *proposal_;
  if (p.kind == Proposal::Kind::kRecovery || p.planned) {
    return failed_precondition("the proposal has its plan");
  }
  FLEX_RETURN_IF_ERROR(check_maps(maps, p.members));
  const int S = config_.slots_per_rank;
  for (size_t l = 0; l < maps.size(); ++l) {
    for (size_t s = 0; s < maps[l].size(); ++s) {
      if (maps[l][s] >= 0 && maps[l][s] != maps_[l][s]) {
        p.loads.push_back({static_cast<int>(l), static_cast<int>(s), maps[l][s]});
        p.awaiting.insert(static_cast<int>(s) / S);
      }
    }
  }
  p.maps = std::move(maps);
  p.planned = true;
  Actions out;
  send_prepares(&out);
  maybe_commit(now_ms, &out);
  return out;
}

void Membership::send_prepares(Actions* out) {
  const Proposal& p = *proposal_;
  const int S = config_.slots_per_rank;
  for (int r : p.awaiting) {
    Action a = act(ActionKind::kPrepare, r);
    a.proposal = p.id;
    for (const RecoveryLoad& ld : p.loads) {
      if (ld.slot / S == r) a.loads.push_back(ld);
    }
    out->push_back(std::move(a));
  }
}

Actions Membership::prepared(int r, uint64_t incarnation, uint64_t proposal, int64_t now_ms) {
  Actions out;
  if (!accepts(r, incarnation) || !proposal_ || proposal_->id != proposal) return out;
  Proposal& p = *proposal_;
  if (!p.planned || !p.awaiting.count(r)) return out;
  // A joiner acknowledges once loaded (Ready), not while it starts, and a recovery's
  // replacement only as the incarnation its proposal named.
  if (contains(p.joiners, r) && ranks_[r].state != RankState::kReady) return out;
  for (size_t i = 0; i < p.joiner_incarnations.size(); ++i) {
    if (p.joiners[i] == r && p.joiner_incarnations[i] != incarnation) return out;
  }
  p.awaiting.erase(r);
  maybe_commit(now_ms, &out);
  return out;
}

Actions Membership::prepare_failed(int r, uint64_t incarnation, uint64_t proposal,
                                   const std::string& why, int64_t now_ms) {
  Actions out;
  if (!accepts(r, incarnation) || !proposal_ || proposal_->id != proposal) return out;
  if (!proposal_->awaiting.count(r) && !contains(proposal_->joiners, r)) return out;
  if (proposal_->kind == Proposal::Kind::kRecovery) {
    fail_recovery_attempt("rank " + std::to_string(r) + " failed to prepare: " + why, now_ms, &out);
  } else {
    abandon(&out);
    set_phase(Phase::kServing);
  }
  return out;
}

Actions Membership::abandon_proposal(uint64_t proposal, const std::string& why, int64_t now_ms) {
  Actions out;
  if (!proposal_ || proposal_->id != proposal) return out;
  if (proposal_->kind == Proposal::Kind::kRecovery) {
    fail_recovery_attempt(why, now_ms, &out);
  } else {
    abandon(&out);
    set_phase(Phase::kServing);
  }
  return out;
}

void Membership::maybe_commit(int64_t now_ms, Actions* out) {
  (void)now_ms;
  if (!proposal_ || !proposal_->planned || !proposal_->awaiting.empty() ||
      !proposal_->spawn_wait.empty()) {
    return;
  }
  Proposal p = std::move(*proposal_);
  proposal_.reset();
  maps_ = std::move(p.maps);
  map_version_ += 1;
  commit(p.members, p.leavers, out);
  for (int r : p.leavers) {
    RankView& info = ranks_[r];
    info.state = RankState::kStopped;  // Its exit is not a loss.
    info.leaving = false;
    info.reaped = false;
    {
      Action a = act(ActionKind::kStop, r);
      a.incarnation = info.incarnation;
      out->push_back(std::move(a));
    }
  }
  // The leavers' requests re-run on the members.
  for (auto& [id, req] : requests_) {
    if (req.rank >= 0 && contains(p.leavers, req.rank)) place(id, req, out);
  }
  if (p.kind == Proposal::Kind::kRecovery) {
    lost_.clear();
    failed_attempts_ = 0;
    degraded_reason_.clear();
  } else {
    target_ranks_ = static_cast<int>(members_.size());
  }
  set_phase(Phase::kServing);
  place_held(out);
}

void Membership::commit(std::vector<int> members, const std::vector<int>& also, Actions* out) {
  std::sort(members.begin(), members.end());
  epoch_ += 1;
  for (int r : members) ranks_[r].state = RankState::kServing;
  members_ = members;
  {
    Action a = act(ActionKind::kCommit);
    a.epoch = epoch_;
    a.ranks = std::move(members);
    a.also = also;
    out->push_back(std::move(a));
  }
}

void Membership::abandon(Actions* out) {
  if (!proposal_) return;
  Proposal p = std::move(*proposal_);
  proposal_.reset();
  for (int r : p.joiners) {
    RankView& info = ranks_[r];
    if (info.state == RankState::kDead) continue;
    // One that was never spawned (its id not free yet) has no process to stop.
    if (!p.spawn_wait.count(r)) info.reaped = false;
    info.state = RankState::kStopped;
  }
  for (int r : p.leavers) ranks_[r].leaving = false;
  {
    Action a = act(ActionKind::kRollback);
    a.proposal = p.id;
    a.ranks = p.joiners;
    out->push_back(std::move(a));
  }
}

Status Membership::begin_rebalance() {
  if (rebalancing_) return failed_precondition("an expert rebalance is in progress");
  if (proposal_) return failed_precondition("a reconfiguration is in progress");
  if (phase_ != Phase::kServing) {
    return unavailable("no serving epoch (phase " + std::string(phase_name(phase_)) + ")");
  }
  rebalancing_ = true;
  return Status();
}

Status Membership::commit_map(std::vector<std::vector<int>> maps) {
  if (!rebalancing_) return aborted("the rebalance was cancelled (membership changed)");
  FLEX_RETURN_IF_ERROR(check_maps(maps, members_));
  maps_ = std::move(maps);
  map_version_ += 1;
  return Status();
}

void Membership::end_rebalance() { rebalancing_ = false; }

}  // namespace flexpert::cluster
