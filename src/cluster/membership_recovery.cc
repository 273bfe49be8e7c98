// SPDX-License-Identifier: Apache-2.0
// cluster::Membership: recovery from a lost member (docs/ARCHITECTURE.md, "The
// membership state machine"): the survivors, the replacements and their incarnations,
// where the lost experts go (cluster::plan_recovery), failed attempts and degraded.
#include <algorithm>
#include <utility>

#include "cluster/membership.h"
#include "cluster/membership_util.h"

namespace flexpert::cluster {

using detail::act;
using detail::sorted_union;

Result<RecoveryChoice> Membership::choose_recovery(
    const std::vector<std::vector<int>>& maps, const std::vector<int>& survivors, int target_ranks,
    bool started_only, const std::vector<std::vector<double>>& load) const {
  auto input = [&](const std::vector<int>& joiners) {
    RecoveryInput in;
    in.maps = maps;
    in.num_experts = config_.num_experts;
    in.slots_per_rank = config_.slots_per_rank;
    in.routed = config_.routed;
    in.survivors = survivors;
    in.joiners = joiners;
    in.load = load;
    return in;
  };
  RecoveryChoice choice;
  choice.plan = plan_recovery(input({}));
  if (choice.plan.ok() && !survivors.empty()) return choice;  // In place.
  // Replacements: new incarnations of free ids (the lost ones once their process ended).
  const int now = static_cast<int>(survivors.size());
  const int need = std::max(ranks_for_slots(choice.plan.missing_slots, config_.slots_per_rank),
                            survivors.empty() ? 1 : 0);
  const int room = num_ranks() - now;
  if (need > room) {
    return failed_precondition("the experts need " + std::to_string(need) +
                               " more ranks and --max-ranks " + std::to_string(num_ranks()) +
                               " leaves room for " + std::to_string(room));
  }
  std::vector<int> free = free_ids();
  if (started_only) {
    std::erase_if(free,
                  [&](int r) { return ranks_[r].state != RankState::kReady && !ranks_[r].reaped; });
  }
  if (static_cast<int>(free.size()) < need) {
    return unavailable("only " + std::to_string(free.size()) + " rank ids are free");
  }
  const int want = std::min<int>(static_cast<int>(free.size()),
                                 std::min(room, std::max(need, target_ranks - now)));
  choice.joiners.assign(free.begin(), free.begin() + want);
  std::sort(choice.joiners.begin(), choice.joiners.end());
  for (int r : choice.joiners) {
    choice.not_reaped += ranks_[r].state != RankState::kReady && !ranks_[r].reaped;
  }
  choice.plan = plan_recovery(input(choice.joiners));
  if (!choice.plan.ok()) {
    return internal_error("no room for every expert with the replacements");
  }
  return choice;
}

void Membership::plan_recovery_proposal(int64_t now_ms, Actions* out) {
  auto chosen = choose_recovery(maps_, members_, target_ranks_, /*started_only=*/false);
  if (!chosen.ok()) {
    enter_degraded(chosen.status().message(), out);
    return;
  }
  open_recovery(std::move(chosen).value(), now_ms, out);
}

Proposed Membership::propose_recovery(bool started_only,
                                      const std::vector<std::vector<double>>& load,
                                      int64_t now_ms) {
  Proposed out;
  if (phase_ != Phase::kRecovering) {
    out.status =
        failed_precondition("no recovery to plan (phase " + std::string(phase_name(phase_)) + ")");
    return out;
  }
  if (proposal_) {
    out.status = failed_precondition("the recovery's proposal is open already");
    return out;
  }
  auto chosen = choose_recovery(maps_, members_, target_ranks_, started_only, load);
  if (!chosen.ok()) {
    out.status = chosen.status();
    if (out.status.code() == StatusCode::kFailedPrecondition) {
      enter_degraded(out.status.message(), &out.actions);  // No capacity: no attempt helps.
    } else {
      fail_recovery_attempt(out.status.message(), now_ms, &out.actions);
    }
    return out;
  }
  open_recovery(std::move(chosen).value(), now_ms, &out.actions);
  return out;
}

void Membership::open_recovery(RecoveryChoice chosen, int64_t now_ms, Actions* out) {
  std::vector<int> joiners = std::move(chosen.joiners);
  RecoveryPlan plan = std::move(chosen.plan);
  Proposal p;
  p.kind = Proposal::Kind::kRecovery;
  p.id = next_proposal_++;
  p.survivors = members_;
  p.members = sorted_union(members_, joiners);
  p.joiners = joiners;
  for (int r : joiners) {
    // A spare is Ready as its current incarnation; any other id's next hello numbers the next.
    const RankView& info = ranks_[r];
    p.joiner_incarnations.push_back(info.state == RankState::kReady ? info.incarnation
                                                                    : info.incarnation + 1);
  }
  p.maps = std::move(plan.maps);
  p.loads = std::move(plan.loads);
  p.evicted = plan.evicted;
  p.planned = true;
  p.awaiting.insert(joiners.begin(), joiners.end());
  for (const RecoveryLoad& ld : p.loads) p.awaiting.insert(ld.slot / config_.slots_per_rank);
  p.deadline_ms = now_ms + config_.prepare_timeout_ms;
  proposal_ = std::move(p);
  open_joiners(joiners, now_ms, out);
  set_phase(Phase::kRecovering);
  send_prepares(out);
  maybe_commit(now_ms, out);
}

void Membership::fail_recovery_attempt(const std::string& why, int64_t now_ms, Actions* out) {
  abandon(out);
  failed_attempts_ += 1;
  if (failed_attempts_ >= config_.recovery_attempts) {
    enter_degraded(why, out);
    return;
  }
  if (config_.plan_on_loss) plan_recovery_proposal(now_ms, out);
}

void Membership::enter_degraded(const std::string& why, Actions* out) {
  abandon(out);
  set_phase(Phase::kDegraded);
  degraded_reason_ = why;
  // The members are halted and hold what is left: nothing can run until a scale repairs it.
  for (auto& [id, req] : requests_) {
    {
      Action a = act(ActionKind::kFail);
      a.request = id;
      a.reason = "the group cannot serve: " + why;
      out->push_back(std::move(a));
    }
  }
  requests_.clear();
  for (RankView& info : ranks_) info.in_flight = 0;
}

}  // namespace flexpert::cluster
