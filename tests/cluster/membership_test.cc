// SPDX-License-Identifier: Apache-2.0
// cluster::Membership driven through thousands of random event sequences against a
// model of the processes and requests kept here (the World): joins, ready, deaths
// reported at once or found by heartbeat silence (SIGSTOP, and SIGCONT before or after
// the timeout), acknowledgements in any order,
// failed preparations, scales overlapping recoveries and rebalances, stale messages
// of dead incarnations, client cancels. After every event, independent checks:
// every logical expert has a replica on a live member of the last commit or a planned
// load; epochs only grow; phases take only the transitions of docs/ARCHITECTURE.md;
// no request is lost or answered twice; a dead incarnation is never readmitted and
// its messages change nothing; tick() fences exactly the incarnations silent past the
// heartbeat timeout (by the World's own clock of their silence). Each sequence ends with the faults
// stopped: the group must come back to serving and answer every request exactly once.
//
// FLEXPERT_MEMBERSHIP_SEED=S replays one seed; FLEXPERT_MEMBERSHIP_RUNS=N sets the count.
#include "cluster/membership.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>

namespace flexpert::cluster {
namespace {

// The phase transitions docs/ARCHITECTURE.md allows, written out independently.
bool allowed(Phase from, Phase to) {
  if (from == to) return true;
  using P = Phase;
  static const std::set<std::pair<P, P>> kAllowed = {
      {P::kStarting, P::kServing},    {P::kStarting, P::kStopping},
      {P::kServing, P::kScaling},     {P::kServing, P::kRecovering},
      {P::kServing, P::kStopping},    {P::kScaling, P::kServing},
      {P::kScaling, P::kRecovering},  {P::kScaling, P::kStopping},
      {P::kRecovering, P::kServing},  {P::kRecovering, P::kDegraded},
      {P::kRecovering, P::kStopping}, {P::kDegraded, P::kRecovering},
      {P::kDegraded, P::kStopping},   {P::kStopping, P::kStopped}};
  return kAllowed.count({from, to}) > 0;
}

struct Config {
  MembershipConfig m;
};

Config random_config(std::mt19937_64& rng) {
  Config c;
  MembershipConfig& m = c.m;
  m.max_ranks = 2 + static_cast<int>(rng() % 4);
  m.initial_ranks = 1 + static_cast<int>(rng() % m.max_ranks);
  m.slots_per_rank = 1 + static_cast<int>(rng() % 4);
  const int S = m.slots_per_rank;
  m.num_experts = 1 + static_cast<int>(rng() % (m.initial_ranks * S));
  m.heartbeat_timeout_ms = 2000;
  m.prepare_timeout_ms = 10000;
  m.recovery_attempts = 3;
  const int layers = 1 + static_cast<int>(rng() % 3);
  for (int l = 0; l < layers; ++l) {
    m.routed.push_back(l != 0 || rng() % 3 != 0);
    std::vector<int> map(static_cast<size_t>(m.max_ranks * S), -1);
    std::vector<int> slots;
    for (int s = 0; s < m.initial_ranks * S; ++s) slots.push_back(s);
    std::shuffle(slots.begin(), slots.end(), rng);
    size_t i = 0;
    for (int e = 0; e < m.num_experts; ++e) map[slots[i++]] = e;
    for (; i < slots.size(); ++i) {
      if (rng() % 2) map[slots[i]] = static_cast<int>(rng() % m.num_experts);
    }
    m.maps.push_back(map);
  }
  // Half the sequences plan recoveries as the front end does: a loss only records it and
  // the driver asks for the plan (propose_recovery), at random times; most of those with
  // no proposal deadline either (the front end bounds its own waits: tick() only fences).
  m.plan_on_loss = rng() % 2 == 0;
  if (!m.plan_on_loss && rng() % 4 != 0) m.prepare_timeout_ms = 0;
  return c;
}

// The processes and the clients, as the test sees them.
class World {
 public:
  World(const MembershipConfig& config, uint64_t seed)
      : config_(config), rng_(seed), m_(config), procs_(static_cast<size_t>(config.max_ranks)) {}

  struct Proc {
    bool spawned = false;      // A process runs (or is stopped) that has not said hello.
    uint64_t inc = 0;          // Admitted incarnation (0: none yet).
    bool alive = false;        // Admitted and not killed.
    bool silent = false;       // SIGSTOPped: no heartbeats, no messages.
    int64_t silent_since = 0;  // When it stopped (its last heartbeat was no later).
    bool ready = false;        // Told the machine it is Ready.
    bool exited = false;       // Ended; reaped() not delivered yet.
  };
  enum class Where { kPlaced, kHeld, kDone };
  struct Req {
    Where where = Where::kHeld;
    int rank = -1;
    uint32_t attempt = 0;
    int answers = 0;  // kAnswer + kFail.
    bool cancelled = false;
  };

  // --- Executing the machine's actions (what the front end does) ---------------------
  void execute(const Actions& actions) {
    for (const Action& a : actions) {
      stats_[a.kind] += 1;
      if (trace_) {
        std::printf("  t=%lld %s rank=%d inc=%llu epoch=%llu req=%llu att=%u ranks=%zu %s\n",
                    static_cast<long long>(now_), action_name(a.kind), a.rank,
                    static_cast<unsigned long long>(a.incarnation),
                    static_cast<unsigned long long>(a.epoch),
                    static_cast<unsigned long long>(a.request), a.attempt, a.ranks.size(),
                    a.reason.c_str());
      }
      switch (a.kind) {
        case ActionKind::kSpawn: {
          Proc& p = procs_[a.rank];
          ASSERT_FALSE(p.alive) << "spawn over a live incarnation of rank " << a.rank;
          ASSERT_FALSE(p.exited) << "spawn of rank " << a.rank << " before its process ended";
          p.spawned = true;
          p.silent = false;
          p.ready = false;
          break;
        }
        case ActionKind::kFence:
          // The members of the epoch halt at their next collective (it includes the lost
          // rank) until the next commit: nothing may be placed on them meanwhile.
          if (std::find(committed_.begin(), committed_.end(), a.rank) != committed_.end()) {
            halted_ = true;
          }
          kill(a.rank);
          break;
        case ActionKind::kStop:
          kill(a.rank, /*fenced=*/false);  // Left: its last messages are still heard.
          break;
        case ActionKind::kRollback:
          for (int r : a.ranks) kill(r, /*fenced=*/false);
          prepares_.clear();
          break;
        case ActionKind::kPrepare:
          prepares_[a.rank] = a.proposal;
          break;
        case ActionKind::kCommit:
          ASSERT_GT(a.epoch, last_commit_epoch_) << "an epoch committed twice or backwards";
          last_commit_epoch_ = a.epoch;
          committed_ = a.ranks;
          halted_ = false;
          for (int r : a.ranks) {
            ASSERT_TRUE(procs_[r].alive) << "epoch " << a.epoch << " commits dead rank " << r;
          }
          // A proposal's commit ends its preparation; a halted member's re-commit does not.
          if (!m_.proposal()) prepares_.clear();
          break;
        case ActionKind::kCancelRebalance:
          rebalancing_ = false;
          break;
        case ActionKind::kPlace: {
          Req& q = reqs_.at(a.request);
          ASSERT_NE(q.where, Where::kDone) << "request " << a.request << " placed after its answer";
          ASSERT_TRUE(procs_[a.rank].alive && procs_[a.rank].inc == a.incarnation)
              << "request placed on a dead incarnation";
          ASSERT_GE(a.attempt, q.attempt);
          ASSERT_FALSE(halted_) << "request " << a.request << " placed on a halted group";
          q.where = Where::kPlaced;
          q.rank = a.rank;
          q.attempt = a.attempt;
          break;
        }
        case ActionKind::kHold: {
          Req& q = reqs_.at(a.request);
          ASSERT_NE(q.where, Where::kDone);
          q.where = Where::kHeld;
          q.rank = -1;
          q.attempt = a.attempt;
          break;
        }
        case ActionKind::kAnswer:
        case ActionKind::kFail: {
          Req& q = reqs_.at(a.request);
          q.answers += 1;
          ASSERT_EQ(q.answers, 1) << "request " << a.request << " answered twice";
          ASSERT_FALSE(q.cancelled) << "a cancelled request was answered";
          q.where = Where::kDone;
          break;
        }
      }
    }
  }

  void kill(int r, bool fenced = true) {
    Proc& p = procs_[r];
    if (p.alive || p.spawned) {
      if (p.inc > 0 && p.alive && fenced) dead_.insert({r, p.inc});
      if (p.inc > 0 && p.alive && !fenced) gone_.insert({r, p.inc});
      p.alive = false;
      p.spawned = false;
      p.exited = true;
    }
  }

  // --- Events -----------------------------------------------------------------------
  void step(bool faults) {
    now_ += static_cast<int64_t>(rng_() % 400);
    for (int r = 0; r < config_.max_ranks; ++r) {
      const Proc& p = procs_[r];
      if (p.alive && !p.silent) (void)m_.heartbeat(r, p.inc, now_);
    }
    int pick = static_cast<int>(rng_() % (faults ? 23 : 12));
    if (pick == 11 && rng_() % 2 == 0) pick = 20;  // The healer's ask, also without faults.
    // Faults (kills, stops, failed preparations) in about one event of eight.
    if ((pick == 12 || pick == 13 || pick == 14 || pick == 16) && rng_() % 2 == 0) pick = 3;
    if (trace_) {
      std::printf("event %d phase %s epoch %llu members %zu\n", pick, phase_name(m_.phase()),
                  static_cast<unsigned long long>(m_.epoch()), m_.members().size());
    }
    switch (pick) {
      case 0:
      case 1: {  // A started process says hello (and becomes Ready, sometimes at once).
        const int r = random_rank([](const Proc& p) { return p.spawned && !p.silent; });
        if (r < 0) break;
        auto inc = m_.hello(r, now_);
        if (!inc.ok()) break;
        std::set<std::pair<int, uint64_t>> ended = dead_;
        ended.insert(gone_.begin(), gone_.end());
        for (auto [dr, di] : ended) {
          ASSERT_FALSE(dr == r && di >= *inc)
              << "incarnation " << *inc << " of rank " << r << " reuses or precedes a dead one";
        }
        ASSERT_GT(*inc, procs_[r].inc) << "incarnations of rank " << r << " must grow";
        procs_[r].spawned = false;
        procs_[r].alive = true;
        procs_[r].inc = *inc;
        if (rng_() % 2) ready(r);
        break;
      }
      case 2: {
        const int r = random_rank([](const Proc& p) { return p.alive && !p.ready && !p.silent; });
        if (r >= 0) ready(r);
        break;
      }
      case 3: {  // An acknowledgement, in any order.
        if (prepares_.empty()) break;
        auto it = std::next(prepares_.begin(), static_cast<long>(rng_() % prepares_.size()));
        const auto [r, proposal] = *it;
        const Proc& p = procs_[r];
        if (!p.alive || p.silent || !p.ready) break;
        prepares_.erase(r);
        execute(m_.prepared(r, p.inc, proposal, now_));
        break;
      }
      case 4:
      case 5:
        submit();
        break;
      case 6:
      case 7:
        finish_one();
        break;
      case 8:
        reap_one();
        break;
      case 9:
        set_plan();
        break;
      case 10:
        tick();
        break;
      case 11:
        rebalance_step();
        break;
      case 12: {  // kill -9, seen by waitpid or a peer (at once).
        const int r = random_rank([](const Proc& p) { return p.alive || p.spawned; });
        if (r < 0) break;
        const uint64_t inc = procs_[r].alive ? procs_[r].inc : 0;
        kill(r);
        execute(m_.lost(r, inc, "killed", now_));
        break;
      }
      case 13: {  // Two at once.
        const int a = random_rank([](const Proc& p) { return p.alive; });
        const int b = random_rank([](const Proc& p) { return p.alive; });
        if (a < 0 || b < 0 || a == b) break;
        const uint64_t ia = procs_[a].inc, ib = procs_[b].inc;
        kill(a);
        execute(m_.lost(a, ia, "killed", now_));
        if (!procs_[b].alive || procs_[b].inc != ib) break;
        kill(b);
        execute(m_.lost(b, ib, "killed", now_));
        break;
      }
      case 14: {  // SIGSTOP: found by the heartbeat timeout; SIGCONT later is fenced.
        const int r = random_rank([](const Proc& p) { return p.alive && !p.silent; });
        if (r >= 0) {
          procs_[r].silent = true;
          procs_[r].silent_since = now_;
        }
        break;
      }
      case 15: {  // Scales, also while a recovery or another scale runs.
        const int target = 1 + static_cast<int>(rng_() % config_.max_ranks);
        std::vector<int> remove;
        if (rng_() % 4 == 0 && !m_.members().empty()) {
          remove.push_back(m_.members()[rng_() % m_.members().size()]);
        }
        auto r = m_.scale(remove.empty() ? target : -1, remove, now_);
        if (r.ok()) execute(*r);
        break;
      }
      case 16: {  // A preparation fails.
        if (prepares_.empty()) break;
        auto it = std::next(prepares_.begin(), static_cast<long>(rng_() % prepares_.size()));
        const Proc& p = procs_[it->first];
        if (!p.alive) break;
        execute(m_.prepare_failed(it->first, p.inc, it->second, "injected", now_));
        break;
      }
      case 17:
        stale_messages();
        break;
      case 18: {  // A client goes away.
        std::vector<uint64_t> open;
        for (auto& [id, q] : reqs_) {
          if (q.where != Where::kDone && !q.cancelled) open.push_back(id);
        }
        if (open.empty()) break;
        const uint64_t id = open[rng_() % open.size()];
        (void)m_.cancel(id);
        reqs_[id].cancelled = true;
        reqs_[id].where = Where::kDone;
        break;
      }
      case 19: {  // A member halts without a dead peer (an aborted collective).
        const int r = random_rank([](const Proc& p) { return p.alive && !p.silent; });
        if (r >= 0) execute(m_.halted(r, procs_[r].inc, m_.epoch(), now_));
        break;
      }
      case 20:
        propose();
        break;
      case 22: {  // SIGCONT: within the timeout it beats on as a member; after, it was fenced.
        const int r = random_rank([](const Proc& p) { return p.silent; });
        if (r < 0) break;
        procs_[r].silent = false;
        sigconts_ += procs_[r].alive && m_.accepts(r, procs_[r].inc);
        break;
      }
      case 21: {  // The driver gives up on a recovery's preparation (a connect failed).
        const auto& prop = m_.proposal();
        if (prop && prop->kind == Proposal::Kind::kRecovery && !config_.plan_on_loss) {
          execute(m_.abandon_proposal(prop->id, "injected", now_));
        }
        break;
      }
    }
  }

  // The healer asks for the recovery's plan (plan_on_loss false): the decision names the
  // survivors (the members), replacements among the free ids, each with an incarnation
  // no dead one reaches, and loads that cover every expert the survivors lack.
  void propose() {
    if (config_.plan_on_loss || m_.phase() != Phase::kRecovering || m_.proposal()) return;
    const bool started_only = rng_() % 2 == 0;
    std::vector<std::vector<double>> load;
    if (rng_() % 2) {
      for (size_t l = 0; l < config_.maps.size(); ++l) {
        load.emplace_back();
        for (int e = 0; e < config_.num_experts; ++e) load.back().push_back(rng_() % 100);
      }
    }
    const std::vector<int> members = m_.members();
    const uint64_t epoch = m_.epoch();
    asks_ += 1;
    Proposed r = m_.propose_recovery(started_only, load, now_);
    if (!r.status.ok()) {
      asks_failed_ += 1;
      if (m_.phase() != Phase::kDegraded) {
        ASSERT_EQ(r.status.code(), StatusCode::kUnavailable) << r.status.to_string();
        ASSERT_FALSE(m_.proposal().has_value());
      }
      execute(r.actions);
      return;
    }
    if (!m_.proposal()) {  // Nothing to load: committed at once, in place.
      ASSERT_GT(m_.epoch(), epoch);
      execute(r.actions);
      return;
    }
    const Proposal& p = *m_.proposal();
    ASSERT_EQ(p.kind, Proposal::Kind::kRecovery);
    ASSERT_EQ(p.survivors, members);
    ASSERT_EQ(p.joiners.size(), p.joiner_incarnations.size());
    for (size_t i = 0; i < p.joiners.size(); ++i) {
      const int j = p.joiners[i];
      ASSERT_EQ(std::count(members.begin(), members.end(), j), 0) << "a member replaces itself";
      for (auto [dr, di] : dead_) {
        ASSERT_FALSE(dr == j && di >= p.joiner_incarnations[i])
            << "replacement " << j << " named as dead incarnation " << di;
      }
      if (procs_[j].alive) {  // A spare (Ready, not a member): as it is.
        ASSERT_EQ(p.joiner_incarnations[i], procs_[j].inc);
      } else {
        ASSERT_GT(p.joiner_incarnations[i], procs_[j].inc);
      }
      if (started_only && !(procs_[j].alive && procs_[j].ready)) {
        ASSERT_FALSE(procs_[j].exited || procs_[j].alive) << "rank " << j << " is not free yet";
      }
    }
    execute(r.actions);
  }

  // The driver's clock: tick() fences exactly the admitted incarnations silent past the
  // heartbeat timeout. Checked against the World's own record of when each went silent
  // (a live, beating process is never fenced; a silent one is, once past the timeout).
  void tick() {
    const int64_t timeout = config_.heartbeat_timeout_ms;
    const Actions actions = m_.tick(now_);
    for (const Action& a : actions) {
      if (a.kind != ActionKind::kFence) continue;
      const Proc& p = procs_[a.rank];
      ASSERT_TRUE(p.alive && p.inc == a.incarnation)
          << "tick fenced rank " << a.rank << " incarnation " << a.incarnation
          << ", not the live one";
      ASSERT_TRUE(p.silent && now_ - p.silent_since > timeout)
          << "tick fenced rank " << a.rank << ", which beat within " << timeout << " ms";
      tick_fences_ += 1;
    }
    execute(actions);
    if (::testing::Test::HasFatalFailure()) return;
    // Every one silent past the timeout is gone now: fenced, or stopped by what a loss
    // in the same tick decided (a scale's joiner rolled back).
    for (int r = 0; r < config_.max_ranks; ++r) {
      const Proc& p = procs_[r];
      if (p.alive && p.silent && now_ - p.silent_since > timeout) {
        ASSERT_FALSE(m_.accepts(r, p.inc))
            << "rank " << r << " incarnation " << p.inc << " silent for " << now_ - p.silent_since
            << " ms is still accepted after a tick (machine: " << rank_state_name(m_.rank(r).state)
            << ", last seen at " << m_.rank(r).last_seen_ms << ", now " << now_ << ")";
      }
    }
  }

  static Proc admitted(uint64_t inc) {
    Proc p;
    p.inc = inc;
    p.alive = true;
    return p;
  }

  void ready(int r) {
    procs_[r].ready = true;
    execute(m_.ready(r, procs_[r].inc, now_));
  }

  void submit() {
    const uint64_t id = next_request_++;
    reqs_[id] = Req{};
    auto a = m_.submit(id);
    if (!a.ok()) {
      reqs_[id].where = Where::kDone;  // Refused at once (503): nothing owed.
      reqs_[id].answers = 1;
      const Phase ph = m_.phase();
      ASSERT_TRUE(ph == Phase::kStarting || ph == Phase::kDegraded || ph == Phase::kStopping ||
                  ph == Phase::kStopped)
          << "a request refused while " << phase_name(ph) << ": " << a.status().to_string();
      return;
    }
    execute({*a});
  }

  // The rank finishes a request; sometimes the event comes from where it ran before.
  void finish_one() {
    std::vector<uint64_t> placed;
    for (auto& [id, q] : reqs_) {
      if (q.where == Where::kPlaced) placed.push_back(id);
    }
    if (placed.empty()) return;
    const uint64_t id = placed[rng_() % placed.size()];
    const Req q = reqs_[id];
    if (procs_[q.rank].silent || !procs_[q.rank].alive) return;
    if (rng_() % 5 == 0) {
      // A stale attempt or another rank: must change nothing.
      const size_t before = m_.requests().size();
      Actions none = m_.finished(id, (q.rank + 1) % config_.max_ranks, q.attempt + 1);
      ASSERT_TRUE(none.empty());
      if (q.attempt > 0) {
        ASSERT_TRUE(m_.finished(id, q.rank, q.attempt - 1).empty());
      }
      ASSERT_EQ(m_.requests().size(), before);
      return;
    }
    Actions a = m_.finished(id, q.rank, q.attempt);
    ASSERT_EQ(a.size(), 1u) << "the current attempt's final event must be answered";
    execute(a);
  }

  void reap_one() {
    const int r = random_rank([](const Proc& p) { return p.exited; });
    if (r < 0) return;
    procs_[r].exited = false;
    execute(m_.reaped(r, now_));
  }

  // The driver's plan (src/eplb in the front end): a random valid placement.
  void set_plan() {
    const auto& prop = m_.proposal();
    if (!prop || prop->planned) return;
    const int S = config_.slots_per_rank;
    std::vector<std::vector<int>> maps = m_.maps();
    bool ok = true;
    for (size_t l = 0; l < maps.size(); ++l) {
      if (!config_.routed[l]) continue;
      std::vector<int>& map = maps[l];
      std::vector<int> free;
      for (size_t s = 0; s < map.size(); ++s) {
        const int r = static_cast<int>(s) / S;
        if (std::find(prop->members.begin(), prop->members.end(), r) == prop->members.end()) {
          map[s] = -1;
        } else if (map[s] < 0 || std::find(prop->joiners.begin(), prop->joiners.end(), r) !=
                                     prop->joiners.end()) {
          map[s] = -1;
          free.push_back(static_cast<int>(s));
        }
      }
      std::shuffle(free.begin(), free.end(), rng_);
      for (int e = 0; e < config_.num_experts; ++e) {
        if (std::find(map.begin(), map.end(), e) != map.end()) continue;
        if (free.empty()) {
          ok = false;
          break;
        }
        map[free.back()] = e;
        free.pop_back();
      }
      for (int s : free) {
        if (rng_() % 2) map[s] = static_cast<int>(rng_() % config_.num_experts);
      }
    }
    if (!ok) {
      execute(m_.abandon_proposal(prop->id, "too few slots", now_));
      return;
    }
    auto r = m_.set_plan(prop->id, std::move(maps), now_);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    execute(*r);
  }

  void rebalance_step() {
    if (!rebalancing_) {
      rebalancing_ = m_.begin_rebalance().ok();
      return;
    }
    if (rng_() % 3 == 0) {
      m_.end_rebalance();
      rebalancing_ = false;
      return;
    }
    // One transition step: a random slot of a member takes an expert that stays covered.
    std::vector<std::vector<int>> maps = m_.maps();
    const int S = config_.slots_per_rank;
    for (size_t l = 0; l < maps.size(); ++l) {
      if (!config_.routed[l] || m_.members().empty()) continue;
      const int r = m_.members()[rng_() % m_.members().size()];
      const int s = r * S + static_cast<int>(rng_() % S);
      const int old = maps[l][s];
      maps[l][s] = static_cast<int>(rng_() % config_.num_experts);
      if (old >= 0 && std::count(maps[l].begin(), maps[l].end(), old) == 0) maps[l][s] = old;
    }
    Status s = m_.commit_map(std::move(maps));
    if (!s.ok()) {
      ASSERT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
    }
  }

  // Messages from dead incarnations (a SIGCONTed worker, a late report): no effect.
  void stale_messages() {
    if (dead_.empty()) return;
    auto [r, inc] = *std::next(dead_.begin(), static_cast<long>(rng_() % dead_.size()));
    if (procs_[r].alive && procs_[r].inc == inc) return;
    ASSERT_FALSE(m_.accepts(r, inc)) << "dead incarnation " << inc << " of rank " << r;
    const uint64_t epoch = m_.epoch();
    const Phase phase = m_.phase();
    const std::vector<int> members = m_.members();
    const uint64_t proposal = m_.proposal() ? m_.proposal()->id : 0;
    ASSERT_TRUE(m_.ready(r, inc, now_).empty());
    ASSERT_TRUE(m_.prepared(r, inc, proposal, now_).empty());
    ASSERT_TRUE(m_.prepare_failed(r, inc, proposal, "stale", now_).empty());
    ASSERT_TRUE(m_.halted(r, inc, epoch, now_).empty());
    ASSERT_TRUE(m_.heartbeat(r, inc, now_).empty());
    ASSERT_TRUE(m_.lost(r, inc, "stale report", now_).empty());
    m_.applied(r, inc, epoch);
    ASSERT_EQ(m_.epoch(), epoch);
    ASSERT_EQ(m_.phase(), phase);
    ASSERT_EQ(m_.members(), members);
  }

  template <typename F>
  int random_rank(F pred) {
    std::vector<int> c;
    for (int r = 0; r < config_.max_ranks; ++r) {
      if (pred(procs_[r])) c.push_back(r);
    }
    return c.empty() ? -1 : c[rng_() % c.size()];
  }

  // --- Invariants, checked from the World's own records -------------------------------
  void check(uint64_t epoch_before) {
    const Phase ph = m_.phase();
    const std::vector<Phase>& history = m_.phase_history();
    for (; phases_seen_ < history.size(); ++phases_seen_) {
      ASSERT_TRUE(allowed(history[phases_seen_ - 1], history[phases_seen_]))
          << phase_name(history[phases_seen_ - 1]) << " -> " << phase_name(history[phases_seen_]);
    }
    ASSERT_GE(m_.epoch(), epoch_before) << "the epoch went back";
    // A fenced (killed, silent past the timeout) incarnation is never accepted again.
    for (auto [r, inc] : dead_) {
      ASSERT_FALSE(m_.accepts(r, inc)) << "dead incarnation " << inc << " of rank " << r;
    }
    ASSERT_EQ(m_.epoch(), last_commit_epoch_) << "an epoch changed without a commit";
    // Live members of the last commit: not killed since.
    std::set<int> live;
    for (int r : committed_) {
      if (procs_[r].alive) live.insert(r);
    }
    const bool serving_phase =
        ph == Phase::kServing || ph == Phase::kScaling || ph == Phase::kRecovering;
    if (serving_phase) {
      const int S = config_.slots_per_rank;
      const auto& maps = m_.maps();
      const auto& prop = m_.proposal();
      for (size_t l = 0; l < maps.size(); ++l) {
        if (!config_.routed[l]) continue;
        for (int e = 0; e < config_.num_experts; ++e) {
          bool covered = false;
          for (size_t s = 0; s < maps[l].size() && !covered; ++s) {
            covered = maps[l][s] == e && live.count(static_cast<int>(s) / S);
          }
          if (!covered && prop && prop->planned) {
            for (const RecoveryLoad& ld : prop->loads) {
              const int dst = ld.slot / S;
              const bool dst_ok =
                  procs_[dst].alive || procs_[dst].spawned ||
                  std::find(prop->joiners.begin(), prop->joiners.end(), dst) != prop->joiners.end();
              covered |= ld.layer == static_cast<int>(l) && ld.logical_expert == e && dst_ok;
            }
          }
          if (!covered && !prop && ph == Phase::kRecovering && !config_.plan_on_loss) {
            // Between a loss and the driver's ask: the plan it would get covers the expert
            // with a load (or the ask fails: an attempt counted, degraded at the limit).
            auto c = m_.choose_recovery(maps, m_.members(), m_.target_ranks(), false);
            covered = !c.ok();
            for (size_t i = 0; c.ok() && i < c->plan.loads.size(); ++i) {
              const RecoveryLoad& ld = c->plan.loads[i];
              covered |= ld.layer == static_cast<int>(l) && ld.logical_expert == e;
            }
          }
          // A silent rank is still a member until the timeout: covered by what it holds.
          ASSERT_TRUE(covered) << "expert " << e << " of layer " << l << " has no replica on a "
                               << "live member and no planned load (phase " << phase_name(ph)
                               << ")";
        }
      }
    }
    // Every open request is on a live member of the last commit at its current attempt,
    // or held while a recovery runs.
    for (auto& [id, q] : reqs_) {
      if (q.where == Where::kDone) continue;
      ASSERT_TRUE(serving_phase) << "request " << id << " open while " << phase_name(ph);
      auto it = m_.requests().find(id);
      ASSERT_NE(it, m_.requests().end()) << "request " << id << " lost";
      if (q.where == Where::kHeld) {
        ASSERT_EQ(ph, Phase::kRecovering) << "request " << id << " held while " << phase_name(ph);
        ASSERT_LT(it->second.rank, 0);
      } else {
        ASSERT_TRUE(live.count(q.rank) || procs_[q.rank].silent)
            << "request " << id << " on rank " << q.rank << ", not a live member";
        ASSERT_EQ(it->second.rank, q.rank);
        ASSERT_EQ(it->second.attempt, q.attempt);
      }
    }
  }

  // No more faults: deliver everything until the group serves, then finish every request.
  void settle() {
    for (int i = 0; i < 4000; ++i) {
      const auto& prop = m_.proposal();
      if (m_.phase() == Phase::kServing && !prop && !rebalancing_) break;
      for (int r = 0; r < config_.max_ranks; ++r) {
        if (procs_[r].silent) {  // Lost by now; SIGCONT: its messages are fenced.
          now_ += config_.heartbeat_timeout_ms + 1;
          for (int q = 0; q < config_.max_ranks; ++q) {
            if (procs_[q].alive && !procs_[q].silent) (void)m_.heartbeat(q, procs_[q].inc, now_);
          }
          tick();
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
      if (rebalancing_) {
        m_.end_rebalance();
        rebalancing_ = false;
      }
      if (m_.phase() == Phase::kDegraded) {
        auto r = m_.scale(config_.max_ranks, {}, now_);
        ASSERT_TRUE(r.ok()) << r.status().to_string();
        execute(*r);
      }
      if (rng_() % 2 == 0) propose();
      if (::testing::Test::HasFatalFailure()) return;
      const uint64_t epoch = m_.epoch();
      const int pick = static_cast<int>(rng_() % 5);
      if (trace_ && i % 50 == 0) dump();
      if (pick == 0) {
        reap_one();
      } else if (pick == 1) {
        const int r = random_rank([](const Proc& p) { return p.spawned; });
        if (r >= 0) {
          auto inc = m_.hello(r, now_);
          if (inc.ok()) {
            procs_[r] = admitted(*inc);
            ready(r);
          }
        }
        // One admitted but still loading finishes (no proposal deadline may end its wait).
        const int loading =
            random_rank([](const Proc& p) { return p.alive && !p.ready && !p.silent; });
        if (loading >= 0) ready(loading);
      } else if (pick == 2) {
        set_plan();
      } else if (pick == 3 && !prepares_.empty()) {
        auto it = std::next(prepares_.begin(), static_cast<long>(rng_() % prepares_.size()));
        const auto [r, proposal] = *it;
        if (procs_[r].alive && procs_[r].ready) {
          prepares_.erase(r);
          execute(m_.prepared(r, procs_[r].inc, proposal, now_));
        }
      } else {
        now_ += 50;
        for (int r = 0; r < config_.max_ranks; ++r) {
          if (procs_[r].alive && !procs_[r].silent) (void)m_.heartbeat(r, procs_[r].inc, now_);
        }
        tick();
      }
      if (::testing::Test::HasFatalFailure()) return;
      check(epoch);
      if (::testing::Test::HasFatalFailure()) return;
    }
    ASSERT_EQ(m_.phase(), Phase::kServing) << "the group did not come back";
    ASSERT_FALSE(m_.proposal().has_value());
    for (auto& [id, q] : reqs_) {
      if (q.where == Where::kPlaced) execute(m_.finished(id, q.rank, q.attempt));
    }
    for (auto& [id, q] : reqs_) {
      ASSERT_EQ(q.where, Where::kDone) << "request " << id << " never answered";
      ASSERT_EQ(q.answers + (q.cancelled ? 1 : 0), 1) << "request " << id;
    }
    ASSERT_EQ(m_.num_held(), 0u);
  }

  void dump() const {
    std::printf("phase %s epoch %llu proposal %s\n", phase_name(m_.phase()),
                static_cast<unsigned long long>(m_.epoch()), m_.proposal() ? "yes" : "no");
    if (const auto& p = m_.proposal()) {
      std::printf("  planned %d awaiting", p->planned);
      for (int r : p->awaiting) std::printf(" %d", r);
      std::printf(" spawn_wait");
      for (int r : p->spawn_wait) std::printf(" %d", r);
      std::printf(" joiners");
      for (int r : p->joiners) std::printf(" %d", r);
      std::printf("\n");
    }
    for (int r = 0; r < config_.max_ranks; ++r) {
      const Proc& p = procs_[r];
      const RankView& v = m_.rank(r);
      std::printf(
          "  rank %d: world spawned %d inc %llu alive %d silent %d ready %d exited %d | "
          "machine %s inc %llu admitted %d reaped %d prepare %d\n",
          r, p.spawned, static_cast<unsigned long long>(p.inc), p.alive, p.silent, p.ready,
          p.exited, rank_state_name(v.state), static_cast<unsigned long long>(v.incarnation),
          v.admitted, v.reaped, static_cast<int>(prepares_.count(r)));
    }
  }

  void start() {
    execute(m_.start(now_));
    for (int r = 0; r < config_.initial_ranks; ++r) {
      auto inc = m_.hello(r, now_);
      ASSERT_TRUE(inc.ok());
      procs_[r] = admitted(*inc);
      ready(r);
    }
    ASSERT_EQ(m_.phase(), Phase::kServing);
    ASSERT_EQ(m_.epoch(), 1u);
  }

  MembershipConfig config_;
  std::mt19937_64 rng_;
  Membership m_;
  std::vector<Proc> procs_;
  std::set<std::pair<int, uint64_t>> dead_;  // Killed or fenced incarnations.
  std::set<std::pair<int, uint64_t>> gone_;  // Stopped ones (left, rolled back).
  std::map<int, uint64_t> prepares_;         // rank -> proposal
  std::map<uint64_t, Req> reqs_;
  std::vector<int> committed_;
  uint64_t last_commit_epoch_ = 0;
  size_t phases_seen_ = 1;
  uint64_t next_request_ = 1;
  bool rebalancing_ = false;
  bool halted_ = false;  // A member of the last commit was lost since.
  int64_t now_ = 1000;
  static inline std::map<ActionKind, uint64_t> stats_;  // Over every sequence.
  static inline uint64_t asks_ = 0, asks_failed_ = 0;   // propose_recovery() calls.
  static inline uint64_t tick_fences_ = 0;              // Silent incarnations fenced by tick().
  static inline uint64_t sigconts_ = 0;                 // SIGCONT within the timeout.
  bool trace_ = std::getenv("FLEXPERT_MEMBERSHIP_TRACE") != nullptr;
};

uint64_t env_or(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::strtoull(v, nullptr, 10) : fallback;
}

TEST(MembershipProperty, RandomEventSequences) {
  const uint64_t seed = env_or("FLEXPERT_MEMBERSHIP_SEED", std::random_device{}());
  const uint64_t runs = std::getenv("FLEXPERT_MEMBERSHIP_SEED") != nullptr
                            ? 1
                            : env_or("FLEXPERT_MEMBERSHIP_RUNS", 3000);
  std::printf("membership property test: base seed %llu (FLEXPERT_MEMBERSHIP_SEED)\n",
              static_cast<unsigned long long>(seed));
  for (uint64_t i = 0; i < runs; ++i) {
    const uint64_t s = seed + i;
    SCOPED_TRACE("FLEXPERT_MEMBERSHIP_SEED=" + std::to_string(s));
    std::mt19937_64 rng(s);
    const Config c = random_config(rng);
    World w(c.m, s);
    w.start();
    ASSERT_FALSE(HasFatalFailure());
    const int events = 50 + static_cast<int>(rng() % 200);
    for (int e = 0; e < events; ++e) {
      const uint64_t epoch = w.m_.epoch();
      w.step(/*faults=*/true);
      ASSERT_FALSE(HasFatalFailure()) << "event " << e;
      w.check(epoch);
      ASSERT_FALSE(HasFatalFailure()) << "event " << e;
    }
    w.settle();
    ASSERT_FALSE(HasFatalFailure());
  }
  // What the sequences exercised (a test that never fences or rolls back proves little).
  for (auto [kind, n] : World::stats_) {
    std::printf("  %-16s %llu\n", action_name(kind), static_cast<unsigned long long>(n));
  }
  std::printf("  %-16s %llu (%llu failed)\n", "propose_recovery",
              static_cast<unsigned long long>(World::asks_),
              static_cast<unsigned long long>(World::asks_failed_));
  std::printf("  %-16s %llu (%llu continued in time)\n", "tick fences",
              static_cast<unsigned long long>(World::tick_fences_),
              static_cast<unsigned long long>(World::sigconts_));
  if (runs < 100) return;  // A replayed seed need not exercise everything.
  EXPECT_GT(World::stats_[ActionKind::kRollback], runs / 10);
  EXPECT_GT(World::asks_, runs / 10);
  EXPECT_GT(World::asks_failed_, 0u);
  EXPECT_GT(World::stats_[ActionKind::kFail], 0u);
  EXPECT_GT(World::stats_[ActionKind::kCancelRebalance], 0u);
  EXPECT_GT(World::tick_fences_, runs / 10);
  EXPECT_GT(World::sigconts_, 0u);
}

}  // namespace
}  // namespace flexpert::cluster
