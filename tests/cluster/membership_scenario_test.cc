// SPDX-License-Identifier: Apache-2.0
// cluster::Membership through the overlapping faults of docs/ARCHITECTURE.md ("The
// membership state machine"), written out by hand: two deaths at once, a death while a
// scale-up prepares and right after it commits, a replacement dying during its own
// preparation (until degraded, then repaired by a scale), a death during a rebalance; in
// the front end's mode, the last attempt decided by a replacement's loss and heartbeat
// silence through tick().
#include <gtest/gtest.h>

#include <algorithm>

#include "cluster/membership.h"

namespace flexpert::cluster {
namespace {

std::vector<const Action*> of(const Actions& actions, ActionKind kind) {
  std::vector<const Action*> out;
  for (const Action& a : actions) {
    if (a.kind == kind) out.push_back(&a);
  }
  return out;
}

// num_ranks ranks of `slots` slots; expert e on slot e (one replica each), one layer.
MembershipConfig config(int max_ranks, int initial, int slots, int experts) {
  MembershipConfig c;
  c.max_ranks = max_ranks;
  c.initial_ranks = initial;
  c.slots_per_rank = slots;
  c.num_experts = experts;
  c.routed = {true};
  std::vector<int> map(static_cast<size_t>(max_ranks * slots), -1);
  for (int e = 0; e < experts; ++e) map[e] = e;
  c.maps = {map};
  c.prepare_timeout_ms = 10000;
  return c;
}

class Group {
 public:
  explicit Group(MembershipConfig c) : m(std::move(c)), inc(m.num_ranks(), 0) {
    (void)m.start(now);
    for (int r = 0; r < m.num_ranks() && m.phase() == Phase::kStarting; ++r) join(r);
  }
  // A spawned rank says hello and is Ready.
  Actions join(int r) {
    auto i = m.hello(r, now);
    EXPECT_TRUE(i.ok()) << i.status().to_string();
    if (!i.ok()) return {};
    EXPECT_GT(*i, inc[r]);
    inc[r] = *i;
    return m.ready(r, inc[r], now);
  }
  Actions ack_all(uint64_t proposal) {
    Actions out;
    const auto awaiting = m.proposal()->awaiting;
    for (int r : awaiting) {
      Actions a = m.prepared(r, inc[r], proposal, now);
      out.insert(out.end(), a.begin(), a.end());
    }
    return out;
  }
  Membership m;
  std::vector<uint64_t> inc;
  int64_t now = 0;
};

TEST(MembershipScenario, TwoDeathsAtOnce) {
  Group g(config(4, 4, 2, 8));  // Every slot used: each loss needs a replacement.
  ASSERT_EQ(g.m.epoch(), 1u);
  for (uint64_t q = 1; q <= 8; ++q) ASSERT_EQ(g.m.submit(q)->kind, ActionKind::kPlace);
  Actions a = g.m.lost(1, g.inc[1], "killed", g.now);
  ASSERT_EQ(of(a, ActionKind::kFence).size(), 1u);
  ASSERT_EQ(of(a, ActionKind::kHold).size(), 2u);  // Rank 1's requests.
  a = g.m.lost(2, g.inc[2], "killed", g.now);
  ASSERT_EQ(of(a, ActionKind::kRollback).size(), 1u);  // The plan without rank 1 only.
  ASSERT_EQ(g.m.phase(), Phase::kRecovering);
  const Proposal p = *g.m.proposal();
  EXPECT_EQ(p.joiners, (std::vector<int>{1, 2}));
  EXPECT_EQ(p.loads.size(), 4u);                   // Experts 2..5 from the checkpoint.
  EXPECT_EQ(p.spawn_wait, (std::set<int>{1, 2}));  // Until their processes are reaped.

  // New requests are held, not refused.
  ASSERT_EQ(g.m.submit(100)->kind, ActionKind::kHold);
  for (int r : {2, 1}) {
    ASSERT_EQ(of(g.m.reaped(r, g.now), ActionKind::kSpawn).size(), 1u);
    g.join(r);
  }
  EXPECT_FALSE(g.m.accepts(1, 1));  // The dead incarnations stay dead.
  EXPECT_FALSE(g.m.accepts(2, 1));
  a = g.ack_all(p.id);
  ASSERT_EQ(of(a, ActionKind::kCommit).size(), 1u);
  EXPECT_EQ(of(a, ActionKind::kCommit)[0]->epoch, 2u);
  EXPECT_EQ(g.m.members(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(g.m.phase(), Phase::kServing);
  // Held requests go out at the next attempt; each logical expert is on a member.
  const auto placed = of(a, ActionKind::kPlace);
  EXPECT_EQ(placed.size(), 5u);
  for (const Action* x : placed) EXPECT_EQ(x->attempt, x->request == 100 ? 0u : 1u);
  EXPECT_EQ(g.m.num_held(), 0u);
  for (int e = 0; e < 8; ++e) {
    EXPECT_NE(std::find(g.m.maps()[0].begin(), g.m.maps()[0].end(), e), g.m.maps()[0].end());
  }
}

TEST(MembershipScenario, DeathWhileAScaleUpPrepares) {
  Group g(config(4, 2, 4, 4));
  auto s = g.m.scale(3, {}, g.now);
  ASSERT_TRUE(s.ok());
  ASSERT_EQ(of(*s, ActionKind::kSpawn).size(), 1u);
  const uint64_t scale_id = g.m.proposal()->id;
  g.join(2);
  std::vector<std::vector<int>> plan = g.m.maps();
  plan[0][8] = 0;  // A replica of expert 0 on the joiner.
  ASSERT_TRUE(g.m.set_plan(scale_id, plan, g.now).ok());
  Actions a = g.m.lost(0, g.inc[0], "killed", g.now);
  ASSERT_EQ(of(a, ActionKind::kRollback).size(), 1u);
  EXPECT_EQ(of(a, ActionKind::kRollback)[0]->ranks, (std::vector<int>{2}));
  EXPECT_EQ(g.m.phase(), Phase::kRecovering);
  // The scale's acknowledgement arrives late: it belongs to an abandoned proposal.
  EXPECT_TRUE(g.m.prepared(2, g.inc[2], scale_id, g.now).empty());
  EXPECT_FALSE(g.m.set_plan(scale_id, plan, g.now).ok());
  // Experts 0..3 lived on rank 0 only: rank 1's free slots take them (in place).
  const Proposal p = *g.m.proposal();
  EXPECT_TRUE(p.joiners.empty());
  EXPECT_EQ(p.loads.size(), 4u);
  a = g.ack_all(p.id);
  ASSERT_EQ(of(a, ActionKind::kCommit).size(), 1u);
  EXPECT_EQ(g.m.members(), (std::vector<int>{1}));
  EXPECT_EQ(g.m.phase(), Phase::kServing);
}

TEST(MembershipScenario, DeathRightAfterAScaleUpCommits) {
  Group g(config(4, 2, 4, 4));
  ASSERT_TRUE(g.m.scale(3, {}, g.now).ok());
  const uint64_t id = g.m.proposal()->id;
  g.join(2);
  std::vector<std::vector<int>> plan = g.m.maps();
  plan[0][8] = 3;
  auto a = g.m.set_plan(id, plan, g.now);
  ASSERT_TRUE(a.ok());
  Actions c = g.m.prepared(2, g.inc[2], id, g.now);
  ASSERT_EQ(of(c, ActionKind::kCommit).size(), 1u);
  ASSERT_EQ(g.m.epoch(), 2u);
  // The joiner dies before every member applied epoch 2.
  g.m.applied(0, g.inc[0], 2);
  Actions l = g.m.lost(2, g.inc[2], "killed", g.now);
  EXPECT_EQ(g.m.phase(), Phase::kServing);  // Its replica was a surplus one: nothing to load.
  ASSERT_EQ(of(l, ActionKind::kCommit).size(), 1u);
  EXPECT_EQ(g.m.epoch(), 3u);
  g.m.applied(1, g.inc[1], 2);  // A late acknowledgement of the old epoch changes nothing.
  EXPECT_EQ(g.m.epoch(), 3u);
  EXPECT_EQ(g.m.members(), (std::vector<int>{0, 1}));
}

TEST(MembershipScenario, ReplacementDiesDuringItsPreparationUntilDegraded) {
  Group g(config(3, 3, 2, 6));
  ASSERT_EQ(g.m.submit(1)->kind, ActionKind::kPlace);
  (void)g.m.lost(1, g.inc[1], "killed", g.now);
  for (int attempt = 0; attempt < 3; ++attempt) {
    ASSERT_EQ(g.m.phase(), Phase::kRecovering) << attempt;
    ASSERT_EQ(g.m.proposal()->joiners, (std::vector<int>{1}));
    ASSERT_EQ(of(g.m.reaped(1, g.now), ActionKind::kSpawn).size(), 1u);
    const uint64_t before = g.inc[1];
    g.join(1);
    ASSERT_GT(g.inc[1], before);
    Actions a = g.m.lost(1, g.inc[1], "killed while loading", g.now);
    ASSERT_EQ(of(a, ActionKind::kFence).size(), 1u);
  }
  // Three failed preparations: degraded, the held request answered with a 503.
  EXPECT_EQ(g.m.phase(), Phase::kDegraded);
  EXPECT_FALSE(g.m.degraded_reason().empty());
  EXPECT_EQ(g.m.requests().size(), 0u);
  EXPECT_FALSE(g.m.submit(2).ok());
  // A scale repairs it: one more recovery, this time the replacement survives.
  auto s = g.m.scale(3, {}, g.now);
  ASSERT_TRUE(s.ok());
  ASSERT_EQ(g.m.phase(), Phase::kRecovering);
  ASSERT_EQ(of(g.m.reaped(1, g.now), ActionKind::kSpawn).size(), 1u);
  g.join(1);
  for (uint64_t dead = 1; dead < g.inc[1]; ++dead) EXPECT_FALSE(g.m.accepts(1, dead));
  Actions a = g.ack_all(g.m.proposal()->id);
  ASSERT_EQ(of(a, ActionKind::kCommit).size(), 1u);
  EXPECT_EQ(g.m.phase(), Phase::kServing);
  EXPECT_EQ(g.m.members(), (std::vector<int>{0, 1, 2}));
}

TEST(MembershipScenario, DeathDuringARebalance) {
  MembershipConfig c = config(4, 4, 2, 4);
  c.maps[0] = {0, 1, 2, 3, 0, 1, 2, 3};  // Two replicas of each.
  Group g(c);
  ASSERT_TRUE(g.m.begin_rebalance().ok());
  std::vector<std::vector<int>> step = g.m.maps();
  step[0][7] = 0;  // Expert 3 keeps its replica on rank 1.
  ASSERT_TRUE(g.m.commit_map(step).ok());
  std::vector<std::vector<int>> bad = step;
  bad[0][3] = 0;  // Expert 3 would have no replica left.
  EXPECT_EQ(g.m.commit_map(bad).code(), StatusCode::kInvalidArgument);
  Actions a = g.m.lost(1, g.inc[1], "killed", g.now);
  ASSERT_EQ(of(a, ActionKind::kCancelRebalance).size(), 1u);
  EXPECT_EQ(g.m.commit_map(step).code(), StatusCode::kAborted);
  EXPECT_FALSE(g.m.rebalancing());
  // Experts 2 and 3 lost a replica with rank 1; 3 lost its last: reloaded in place.
  ASSERT_TRUE(g.m.proposal().has_value());
  EXPECT_EQ(g.m.proposal()->loads.size(), 1u);
  EXPECT_EQ(g.m.proposal()->loads[0].logical_expert, 3);
  a = g.ack_all(g.m.proposal()->id);
  ASSERT_EQ(of(a, ActionKind::kCommit).size(), 1u);
  EXPECT_EQ(g.m.phase(), Phase::kServing);
  EXPECT_TRUE(g.m.begin_rebalance().ok());
}

// A Ready spare (started ahead, not a member) joins before any new process is spawned:
// for a scale-up and for a recovery.
TEST(MembershipScenario, SparesJoinFirst) {
  Group g(config(4, 2, 2, 4));  // Every slot of ranks 0 and 1 used.
  g.m.open_rank(3, g.now);
  g.join(3);
  ASSERT_EQ(g.m.rank(3).state, RankState::kReady);
  auto choice = g.m.choose_scale(3, {});
  ASSERT_TRUE(choice.ok());
  EXPECT_EQ(choice->joiners, (std::vector<int>{3}));
  EXPECT_EQ(choice->not_reaped, 0);
  Actions a = g.m.lost(1, g.inc[1], "killed", g.now);
  EXPECT_TRUE(of(a, ActionKind::kSpawn).empty()) << "the spare is Ready already";
  ASSERT_TRUE(g.m.proposal().has_value());
  EXPECT_EQ(g.m.proposal()->joiners, (std::vector<int>{3}));
  a = g.ack_all(g.m.proposal()->id);
  ASSERT_EQ(of(a, ActionKind::kCommit).size(), 1u);
  EXPECT_EQ(g.m.members(), (std::vector<int>{0, 3}));
  // Scale-down: the least loaded leave (given loads), ties the highest id.
  choice = g.m.choose_scale(1, {}, {5, 0, 0, 7});
  ASSERT_TRUE(choice.ok());
  EXPECT_EQ(choice->leavers, (std::vector<int>{0}));
  EXPECT_FALSE(g.m.choose_scale(1, {2}).ok()) << "not a member";
  EXPECT_FALSE(g.m.choose_scale(1, {0, 3}).ok()) << "every member";
  EXPECT_FALSE(g.m.choose_scale(5, {}).ok()) << "beyond --max-ranks";
}

// Recovery planning for a driver that spawns at once: ids whose process still runs are
// not free yet; the plan names them once reaped.
TEST(MembershipScenario, ChooseRecoveryWaitsForIds) {
  Group g(config(4, 4, 2, 8));
  g.m.mark_lost(1);
  g.m.mark_lost(2);
  auto now = g.m.choose_recovery(g.m.maps(), {0, 3}, 4, /*started_only=*/true);
  EXPECT_EQ(now.status().code(), StatusCode::kUnavailable) << now.status().to_string();
  auto later = g.m.choose_recovery(g.m.maps(), {0, 3}, 4, /*started_only=*/false);
  ASSERT_TRUE(later.ok());
  EXPECT_EQ(later->joiners, (std::vector<int>{1, 2}));
  EXPECT_EQ(later->not_reaped, 2);
  EXPECT_EQ(later->plan.loads.size(), 4u);
  (void)g.m.reaped(1, g.now);
  (void)g.m.reaped(2, g.now);
  auto ready = g.m.choose_recovery(g.m.maps(), {0, 3}, 4, /*started_only=*/true);
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->not_reaped, 0);
  // Fewer free ids than the slots need: Unavailable (try again once more are free).
  Group h(config(2, 2, 2, 4));
  h.m.mark_lost(0);
  EXPECT_EQ(h.m.choose_recovery(h.m.maps(), {}, 2, false).status().code(), StatusCode::kUnavailable)
      << "4 experts need both ids; rank 1 is still a member";
  auto one = h.m.choose_recovery(h.m.maps(), {1}, 2, false);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  EXPECT_EQ(one->joiners, (std::vector<int>{0})) << "rank 1's slots are full";
  EXPECT_EQ(one->not_reaped, 1);
}

// The hooks ClusterEngine::Impl records its own flows with keep the same rules.
TEST(MembershipScenario, DriverHooksKeepTheRules) {
  Group g(config(3, 2, 2, 4));
  Actions out;
  EXPECT_EQ(g.m.commit_members({0, 2}, {}, &out).code(), StatusCode::kFailedPrecondition)
      << "rank 2 never said hello";
  g.m.mark_lost(1);
  EXPECT_FALSE(g.m.accepts(1, g.inc[1]));
  EXPECT_EQ(g.m.members(), (std::vector<int>{0}));
  EXPECT_EQ(g.m.commit_members({0, 1}, {}, &out).code(), StatusCode::kFailedPrecondition)
      << "rank 1's incarnation is dead";
  EXPECT_FALSE(g.m.hello(1, g.now).ok()) << "not reopened, and its process not reaped";
  (void)g.m.reaped(1, g.now);
  g.m.open_rank(1, g.now);
  const uint64_t dead = g.inc[1];
  g.join(1);
  EXPECT_GT(g.inc[1], dead);
  EXPECT_FALSE(g.m.accepts(1, dead));
  ASSERT_TRUE(g.m.commit_members({1, 0}, {}, &out).ok());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].epoch, 2u);
  EXPECT_EQ(out[0].ranks, (std::vector<int>{0, 1}));
  // A halt in the current epoch re-commits the members; one in an old epoch does not.
  EXPECT_TRUE(g.m.halted(0, g.inc[0], 1, g.now).empty());
  Actions again = g.m.halted(0, g.inc[0], 2, g.now);
  ASSERT_EQ(of(again, ActionKind::kCommit).size(), 1u);
  EXPECT_EQ(g.m.epoch(), 3u);
  g.m.mark_stopped(1);
  EXPECT_EQ(g.m.members(), (std::vector<int>{0}));
  EXPECT_TRUE(g.m.accepts(1, g.inc[1])) << "a leaver's last reports are still heard";
}

// plan_on_loss false (the front end's mode): a loss records, the driver's ask plans,
// every participant's acknowledgement commits; a replacement acknowledges only as the
// incarnation the decision named.
TEST(MembershipScenario, DriverAsksForTheRecoveryPlan) {
  MembershipConfig c = config(3, 2, 2, 4);
  c.plan_on_loss = false;
  Group g(c);
  ASSERT_EQ(g.m.submit(1)->kind, ActionKind::kPlace);
  ASSERT_EQ(g.m.submit(2)->kind, ActionKind::kPlace);  // One on each rank.
  EXPECT_EQ(g.m.propose_recovery(false, {}, g.now).status.code(), StatusCode::kFailedPrecondition)
      << "nothing to recover";
  const uint64_t dead = g.inc[1];
  Actions lost = g.m.lost(1, dead, "killed", g.now);
  EXPECT_EQ(of(lost, ActionKind::kFence).size(), 1u);
  EXPECT_EQ(of(lost, ActionKind::kHold).size(), 1u);
  EXPECT_EQ(g.m.phase(), Phase::kRecovering);
  EXPECT_FALSE(g.m.proposal().has_value()) << "the driver asks when it is ready";
  // Rank 1's id is not free until its process ended: only rank 2 is started now.
  Proposed p = g.m.propose_recovery(/*started_only=*/true, {}, g.now);
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  ASSERT_TRUE(g.m.proposal().has_value());
  const Proposal d = *g.m.proposal();
  EXPECT_EQ(d.kind, Proposal::Kind::kRecovery);
  EXPECT_EQ(d.survivors, (std::vector<int>{0}));
  EXPECT_EQ(d.joiners, (std::vector<int>{2}));
  EXPECT_EQ(d.joiner_incarnations, (std::vector<uint64_t>{1}));
  EXPECT_EQ(d.members, (std::vector<int>{0, 2}));
  EXPECT_EQ(d.loads.size(), 2u) << "rank 1's two experts, from the checkpoint";
  EXPECT_EQ(of(p.actions, ActionKind::kSpawn).size(), 1u);
  EXPECT_EQ(g.m.propose_recovery(false, {}, g.now).status.code(), StatusCode::kFailedPrecondition)
      << "one proposal at a time";
  g.join(2);
  EXPECT_TRUE(g.m.prepared(2, g.inc[2] + 1, d.id, g.now).empty()) << "not the named incarnation";
  Actions acks = g.ack_all(d.id);
  ASSERT_EQ(of(acks, ActionKind::kCommit).size(), 1u);
  EXPECT_EQ(of(acks, ActionKind::kPlace).size(), 1u) << "the held request goes out";
  EXPECT_EQ(g.m.phase(), Phase::kServing);
  EXPECT_EQ(g.m.members(), (std::vector<int>{0, 2}));
  EXPECT_FALSE(g.m.accepts(1, dead));
}

// In the driver's mode, asks that find no free id count as failed attempts: degraded after
// recovery_attempts, every held request failed in the actions; a scale asks again.
TEST(MembershipScenario, DriverAsksUntilDegraded) {
  MembershipConfig c = config(2, 2, 2, 4);
  c.plan_on_loss = false;
  c.recovery_attempts = 2;
  Group g(c);
  ASSERT_EQ(g.m.submit(1)->kind, ActionKind::kPlace);
  ASSERT_EQ(g.m.submit(2)->kind, ActionKind::kPlace);
  (void)g.m.lost(0, g.inc[0], "killed", g.now);
  Proposed first = g.m.propose_recovery(/*started_only=*/true, {}, g.now);
  EXPECT_EQ(first.status.code(), StatusCode::kUnavailable) << "rank 0's process still runs";
  EXPECT_EQ(g.m.phase(), Phase::kRecovering);
  Proposed second = g.m.propose_recovery(true, {}, g.now);
  EXPECT_EQ(second.status.code(), StatusCode::kUnavailable);
  EXPECT_EQ(g.m.phase(), Phase::kDegraded);
  const size_t held = g.m.requests().size();
  EXPECT_EQ(held, 0u);
  size_t failed =
      of(first.actions, ActionKind::kFail).size() + of(second.actions, ActionKind::kFail).size();
  EXPECT_GE(failed, 1u) << "requests held at the loss are failed, not forgotten";
  ASSERT_TRUE(g.m.scale(2, {}, g.now).ok());
  EXPECT_EQ(g.m.phase(), Phase::kRecovering);
  EXPECT_FALSE(g.m.proposal().has_value());
  (void)g.m.reaped(0, g.now);
  Proposed again = g.m.propose_recovery(true, {}, g.now);
  ASSERT_TRUE(again.status.ok()) << again.status.to_string();
  EXPECT_EQ(g.m.proposal()->joiners, (std::vector<int>{0}));
}

// The front end's mode with hand-started workers (one attempt): the replacement's loss
// decides the last attempt (on the driver's control thread, while its healer still waits):
// the membership alone says the recovery is over, why, and since when it ran.
TEST(MembershipScenario, ReplacementLossDecidesTheLastAttempt) {
  MembershipConfig c = config(2, 2, 2, 4);
  c.plan_on_loss = false;
  c.recovery_attempts = 1;
  c.prepare_timeout_ms = 0;
  Group g(c);
  ASSERT_EQ(g.m.submit(1)->kind, ActionKind::kPlace);
  ASSERT_EQ(g.m.submit(2)->kind, ActionKind::kPlace);
  g.now = 100;
  (void)g.m.lost(1, g.inc[1], "killed", g.now);
  EXPECT_EQ(g.m.phase(), Phase::kRecovering);
  EXPECT_EQ(g.m.recovery_started_ms(), 100);
  EXPECT_EQ(g.m.lost(), (std::vector<int>{1}));
  (void)g.m.reaped(1, g.now);
  g.now = 300;
  ASSERT_TRUE(g.m.propose_recovery(/*started_only=*/true, {}, g.now).status.ok());
  ASSERT_EQ(g.m.proposal()->joiners, (std::vector<int>{1}));
  g.join(1);
  // A member's loss while recovering does not restart the clock.
  g.now = 100000;  // Past any deadline: none is kept (prepare_timeout_ms 0).
  for (int r = 0; r < 2; ++r) (void)g.m.heartbeat(r, g.inc[r], g.now);
  EXPECT_TRUE(g.m.tick(g.now).empty());
  EXPECT_EQ(g.m.phase(), Phase::kRecovering);
  Actions a = g.m.lost(1, g.inc[1], "killed while loading", g.now);
  EXPECT_EQ(g.m.phase(), Phase::kDegraded);
  EXPECT_NE(g.m.degraded_reason().find("replacement rank 1 lost"), std::string::npos)
      << g.m.degraded_reason();
  EXPECT_EQ(of(a, ActionKind::kFail).size(), 2u) << "both requests answered, once";
  EXPECT_EQ(g.m.requests().size(), 0u);
  EXPECT_EQ(g.m.recovery_started_ms(), 100);
  EXPECT_TRUE(g.m.give_up_recovery("again").empty()) << "not recovering: nothing to give up";
  EXPECT_NE(g.m.degraded_reason(), "again");
  // The operator's scale leaves degraded: a new recovery, a new start.
  g.now = 100500;
  ASSERT_TRUE(g.m.scale(2, {}, g.now).ok());
  EXPECT_EQ(g.m.phase(), Phase::kRecovering);
  EXPECT_EQ(g.m.recovery_started_ms(), 100500);
  ASSERT_EQ(g.m.submit(3)->kind, ActionKind::kHold);
  // The driver gives up on it itself (its own bound): degraded with its reason.
  a = g.m.give_up_recovery("the healer gave up");
  EXPECT_EQ(g.m.phase(), Phase::kDegraded);
  EXPECT_EQ(g.m.degraded_reason(), "the healer gave up");
  EXPECT_EQ(of(a, ActionKind::kFail).size(), 1u);
}

// Heartbeat silence through tick(): the silent incarnation is fenced once, with its
// number; a beating one never; the fenced one's later messages change nothing and its id
// takes a new incarnation.
TEST(MembershipScenario, TickFencesTheSilentIncarnation) {
  MembershipConfig c = config(3, 2, 2, 4);
  c.plan_on_loss = false;
  c.prepare_timeout_ms = 0;
  c.heartbeat_timeout_ms = 2000;
  Group g(c);
  ASSERT_EQ(g.m.submit(1)->kind, ActionKind::kPlace);
  ASSERT_EQ(g.m.submit(2)->kind, ActionKind::kPlace);
  const uint64_t silent_inc = g.inc[1];
  for (g.now = 500; g.now <= 2000; g.now += 500) {
    (void)g.m.heartbeat(0, g.inc[0], g.now);  // Rank 1 is silent from t=0.
    EXPECT_TRUE(g.m.tick(g.now).empty()) << "within the timeout at t=" << g.now;
  }
  g.now = 2001;
  (void)g.m.heartbeat(0, g.inc[0], g.now);
  EXPECT_EQ(g.m.silent(g.now), (std::vector<std::pair<int, uint64_t>>{{1, silent_inc}}));
  Actions a = g.m.tick(g.now);
  ASSERT_EQ(of(a, ActionKind::kFence).size(), 1u);
  EXPECT_EQ(of(a, ActionKind::kFence)[0]->rank, 1);
  EXPECT_EQ(of(a, ActionKind::kFence)[0]->incarnation, silent_inc);
  EXPECT_EQ(of(a, ActionKind::kHold).size(), 1u) << "its request waits for the recovery";
  EXPECT_EQ(g.m.phase(), Phase::kRecovering);
  EXPECT_EQ(g.m.recovery_started_ms(), 2001);
  EXPECT_TRUE(g.m.tick(g.now).empty()) << "fenced once";
  // SIGCONT: its messages are refused; its id comes back only as a new incarnation.
  EXPECT_FALSE(g.m.accepts(1, silent_inc));
  EXPECT_TRUE(g.m.heartbeat(1, silent_inc, g.now).empty());
  EXPECT_TRUE(g.m.ready(1, silent_inc, g.now).empty());
  (void)g.m.reaped(1, g.now);
  ASSERT_TRUE(g.m.propose_recovery(true, {}, g.now).status.ok());
  ASSERT_EQ(g.m.proposal()->joiners, (std::vector<int>{1}));
  auto inc = g.m.hello(1, g.now);
  ASSERT_TRUE(inc.ok());
  EXPECT_GT(*inc, silent_inc);
}

}  // namespace
}  // namespace flexpert::cluster
