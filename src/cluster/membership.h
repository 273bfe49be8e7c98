// SPDX-License-Identifier: Apache-2.0
// The group's membership as a pure state machine (docs/ARCHITECTURE.md, "The membership
// state machine"): no sockets, threads, processes or clocks. Time arrives as event
// arguments (`now_ms`); every event returns the actions the driver (the front end,
// src/serve/cluster_*.cc) executes: spawn a rank, fence an incarnation, send a prepare,
// commit an epoch, place or hold a request, answer it.
//
// It owns the phase, the ranks and their incarnations, the members and the epoch with
// its commit rule (a proposal is prepared, every participant acknowledges, then one epoch
// commits; epochs only grow), the committed slot maps, the choice of joiners and leavers,
// recovery planning (cluster::plan_recovery), where requests run and which are held, and
// fencing: a message from an incarnation other than a rank's current one is rejected, and
// an incarnation declared lost is never admitted again.
//
// Thread-compatible: the driver serialises events (ClusterEngine::Impl under its mutex).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cluster/recovery_plan.h"
#include "flexpert/status.h"

namespace flexpert::cluster {

// starting: until the first epoch; serving; scaling: a scale's proposal is being
// prepared (requests admitted); recovering: a member was lost, requests held;
// degraded: no capacity to recover (503); restarting: the stop-the-world baseline
// (--reconfigure stop-the-world, entered by the driver only); stopping, stopped: shutdown.
enum class Phase {
  kStarting,
  kServing,
  kScaling,
  kRecovering,
  kDegraded,
  kRestarting,
  kStopping,
  kStopped
};
const char* phase_name(Phase p);

// empty: never started; starting: spawned or opened for a hello; ready: loaded, not a
// member; serving: a member; dead: declared lost (fenced); stopped: left or shut down.
enum class RankState { kEmpty, kStarting, kReady, kServing, kDead, kStopped };
const char* rank_state_name(RankState s);

struct MembershipConfig {
  int max_ranks = 1;
  int initial_ranks = 1;
  int slots_per_rank = 1;
  int num_experts = 1;
  std::vector<bool> routed;            // [layer]: MoE layers (others keep their map).
  std::vector<std::vector<int>> maps;  // [layer][slot]: the placement of the first epoch.
  int64_t heartbeat_timeout_ms = 2000;
  // A proposal not acknowledged by then fails (tick()); 0: never (the driver bounds its
  // own waits and abandons the proposal itself).
  int64_t prepare_timeout_ms = 120000;
  int recovery_attempts = 3;  // Failed recovery preparations before degraded.
  // true: a member's loss plans the recovery at once (lost() opens the proposal).
  // false: lost() records the loss and the driver asks for the plan with
  // propose_recovery() once it is ready (ClusterEngine first lets a running scale or
  // rebalance settle and passes the load window); a failed attempt waits for the next ask.
  bool plan_on_loss = true;
};

enum class ActionKind {
  kSpawn,            // Start `rank` (its next incarnation says hello).
  kFence,            // Incarnation `incarnation` of `rank` is lost: kill or fence it.
  kPrepare,          // `rank` takes part in proposal `proposal`: `loads` to fill.
  kRollback,         // Proposal `proposal` is abandoned: joiners `ranks` go, members detach.
  kCommit,           // Epoch `epoch`: `ranks` are the members, `also` switch and then stop.
  kStop,             // `rank` left with the last commit: let it exit.
  kCancelRebalance,  // A running rebalance must stop (a member was lost).
  kPlace,            // Run request `request` on `rank` (attempt `attempt`); cancel it elsewhere.
  kHold,             // Request `request` waits at the front end for the next epoch.
  kAnswer,           // Request `request` finished on its rank: its final event goes out.
  kFail,             // Request `request` fails: 503 with `reason`.
};
const char* action_name(ActionKind k);

struct Action {
  ActionKind kind = ActionKind::kSpawn;
  int rank = -1;
  uint64_t incarnation = 0;
  uint64_t epoch = 0;
  uint64_t proposal = 0;
  uint64_t request = 0;
  uint32_t attempt = 0;
  int from_rank = -1;               // kPlace: the rank it ran on before (-1: none).
  std::vector<int> ranks;           // kCommit: members; kRollback: joiners.
  std::vector<int> also;            // kCommit: leavers taking part in the switch.
  std::vector<RecoveryLoad> loads;  // kPrepare: slots to fill (from_rank -1: checkpoint).
  std::string reason;
};
using Actions = std::vector<Action>;

// A change being prepared: the next members, the slots to fill before they commit.
struct Proposal {
  enum class Kind { kScaleUp, kScaleDown, kRecovery };
  Kind kind = Kind::kRecovery;
  uint64_t id = 0;
  std::vector<int> members;  // After the commit.
  std::vector<int> joiners;  // Fresh ranks (spawned for it).
  std::vector<int> leavers;  // Members that switch and then stop.
  std::vector<std::vector<int>> maps;
  std::vector<RecoveryLoad> loads;
  bool planned = false;      // Maps known (a scale waits for the driver's plan).
  std::set<int> awaiting;    // Participants whose prepare is not acknowledged.
  std::set<int> spawn_wait;  // Joiners whose id is not free yet (the old process runs).
  int64_t deadline_ms = 0;
  // A recovery's decision, for the driver and its report:
  std::vector<int> survivors;                 // The members when it was planned.
  std::vector<uint64_t> joiner_incarnations;  // [joiner]: the only one that may acknowledge.
  int evicted = 0;                            // Surplus replicas overwritten by the loads.
};

// Who joins or leaves for a scale.
struct ScaleChoice {
  std::vector<int> joiners;  // Ready spares first, then free ids (ended processes first).
  std::vector<int> leavers;  // Sorted.
  int not_reaped = 0;        // Joiners whose id's old process still runs.
};

// The answer to propose_recovery(): its actions come also with an error (a failed
// attempt's rollback; on entering degraded, every open request's kFail).
struct Proposed {
  Status status;  // OK: a recovery proposal is open, or committed at once.
  Actions actions;
};

// Where a recovery puts the experts that lost their last replica, and with which
// replacements.
struct RecoveryChoice {
  std::vector<int> joiners;  // Replacements (Ready spares first); empty: in place.
  RecoveryPlan plan;         // Over the survivors and the joiners.
  int not_reaped = 0;        // Joiners whose id's old process still runs.
};

struct RankView {
  RankState state = RankState::kEmpty;
  uint64_t incarnation = 0;  // The current one (0: none admitted yet).
  bool admitted = false;     // The current incarnation said hello.
  bool reaped = true;        // No process of an earlier incarnation runs.
  bool leaving = false;
  int in_flight = 0;
  uint64_t applied_epoch = 0;
  int64_t last_seen_ms = 0;
};

// Where a request is: on a rank (attempt), or held.
struct RequestView {
  int rank = -1;  // -1: held.
  uint32_t attempt = 0;
};

class Membership {
 public:
  explicit Membership(MembershipConfig config);

  // Spawns the initial ranks.
  Actions start(int64_t now_ms);

  // --- Ranks -------------------------------------------------------------------------
  // A worker asks to join as `rank`: the incarnation it gets, or why not.
  Result<uint64_t> hello(int rank, int64_t now_ms);
  // Any message: true when it comes from the rank's current, live incarnation (the
  // driver then handles it); false: fence the sender.
  bool accepts(int rank, uint64_t incarnation) const;
  Actions heartbeat(int rank, uint64_t incarnation, int64_t now_ms);
  Actions ready(int rank, uint64_t incarnation, int64_t now_ms);
  // The process of `rank` is gone (death seen by waitpid, a peer, or the driver).
  // `incarnation` 0: the current one.
  Actions lost(int rank, uint64_t incarnation, const std::string& why, int64_t now_ms);
  // The process of the rank's last incarnation has exited: its id may be reused.
  Actions reaped(int rank, int64_t now_ms);
  // Silence past heartbeat_timeout_ms is a loss (lost(): the silent incarnation is
  // fenced, kFence); a proposal past its deadline fails. The driver calls it on its clock.
  Actions tick(int64_t now_ms);
  // The admitted, live incarnations silent past heartbeat_timeout_ms at `now_ms`: those
  // tick() declares lost (for a driver that executes losses itself: the stop-the-world
  // baseline).
  std::vector<std::pair<int, uint64_t>> silent(int64_t now_ms) const;
  // A member halted in the current epoch without a dead peer: re-commit the members.
  Actions halted(int rank, uint64_t incarnation, uint64_t epoch, int64_t now_ms);
  // `rank` applied `epoch`.
  void applied(int rank, uint64_t incarnation, uint64_t epoch);

  // --- Reconfiguration ---------------------------------------------------------------
  // POST /v1/scale {"ranks": n} (or {"remove": [...]} with n < 0): chooses joiners or
  // leavers and opens a proposal; degraded: another recovery with room for n.
  Result<Actions> scale(int target_ranks, const std::vector<int>& remove, int64_t now_ms);
  // The choice scale() makes, without opening anything: joiners are Ready spares
  // (admitted, not members), then free ids whose process has ended, then free ids whose
  // old process still runs (counted in not_reaped); leavers are the named members, or
  // the least loaded (`in_flight` per rank when given, else the requests placed here;
  // ties: the highest ids). The errors are scale()'s.
  Result<ScaleChoice> choose_scale(int target_ranks, const std::vector<int>& remove,
                                   const std::vector<int>& in_flight = {}) const;
  // Recovery planning over `survivors` and the slot maps `maps`: plan_recovery over the
  // survivors; when their slots cannot hold every expert, replacements from the free ids
  // (as many as the slots need, up to `target_ranks` in all, within --max-ranks; only
  // spares and ids whose process ended when `started_only`). FailedPrecondition: the
  // ids of --max-ranks cannot hold the experts; Unavailable: too few ids free now.
  Result<RecoveryChoice> choose_recovery(const std::vector<std::vector<int>>& maps,
                                         const std::vector<int>& survivors, int target_ranks,
                                         bool started_only,
                                         const std::vector<std::vector<double>>& load = {}) const;
  // plan_on_loss false: the driver's ask for the recovery plan, while recovering with no
  // proposal open. Opens a recovery proposal (survivors, replacements and the incarnation
  // each must have, the maps, the checkpoint loads: proposal() reads it) and returns its
  // actions (spawn the replacements whose id is free, prepare each participant); it
  // commits once every participant acknowledged (prepared()). With `started_only`, only
  // spares and ids whose process ended are chosen. Errors: FailedPrecondition when the
  // ids of --max-ranks cannot hold the experts (degraded); otherwise (Unavailable: too
  // few ids free now) one failed attempt, degraded after recovery_attempts. Called when
  // not recovering, or with a proposal open: FailedPrecondition, nothing changes.
  Proposed propose_recovery(bool started_only, const std::vector<std::vector<double>>& load,
                            int64_t now_ms);
  // The driver's plan (src/eplb) for a scale's proposal: the next maps. Checked: every
  // expert keeps a replica on the next members, nothing on other ranks.
  Result<Actions> set_plan(uint64_t proposal, std::vector<std::vector<int>> maps, int64_t now_ms);
  // `rank` finished its part of `proposal` (started, connected, loads done).
  Actions prepared(int rank, uint64_t incarnation, uint64_t proposal, int64_t now_ms);
  Actions prepare_failed(int rank, uint64_t incarnation, uint64_t proposal, const std::string& why,
                         int64_t now_ms);
  // The driver gives up on `proposal` (its plan failed, it was asked to stop).
  Actions abandon_proposal(uint64_t proposal, const std::string& why, int64_t now_ms);
  // EPLB: one rebalance at a time, while serving; each map it commits must keep
  // every expert on a member.
  Status begin_rebalance();
  Status commit_map(std::vector<std::vector<int>> maps);
  void end_rebalance();

  // --- Requests ----------------------------------------------------------------------
  // kPlace or kHold, or the 503's reason.
  Result<Action> submit(uint64_t request);
  // The final event of `request` from `rank` (attempt): kAnswer, or nothing when it
  // comes from a rank or attempt the request has left.
  Actions finished(uint64_t request, int rank, uint32_t attempt);
  // The client went away: the rank it was placed on (the driver cancels it there), if any.
  std::optional<int> cancel(uint64_t request);

  Actions shutdown();  // Every open request fails ("abort"); stopping.
  void stopped();

  // --- Driver hooks ------------------------------------------------------------------
  // ClusterEngine::Impl's own steps (the stop-the-world restart, spares, rollbacks;
  // docs/ARCHITECTURE.md, "The membership state machine", says which) are recorded
  // here, under the same rules: incarnations only grow and a dead one is never admitted
  // again; an epoch commits only admitted, live ranks and only grows.
  // Opens `rank` for its next incarnation (a joiner, a spare, a restarted rank).
  void open_rank(int rank, int64_t now_ms);
  // Commits the next epoch with `members` (`also`: leavers switching with them):
  // FailedPrecondition when one is not an admitted, live rank.
  Status commit_members(std::vector<int> members, const std::vector<int>& also, Actions* out);
  // The slot maps of a commit or of an EPLB transition step the driver made, checked
  // (every expert of a MoE layer keeps a replica on `members`, no other rank's slot holds
  // one) and recorded; InvalidArgument says which expert or slot breaks the rule.
  Status record_maps(std::vector<std::vector<int>> maps, const std::vector<int>& members);
  // `rank` is lost (dead, fenced) or left (stopped): out of the members, no planning.
  void mark_lost(int rank);
  void mark_stopped(int rank);
  // The driver gives up on a running recovery (its own bound on retries): degraded with
  // `why`, every open request failed (kFail). Not recovering: nothing.
  Actions give_up_recovery(const std::string& why);
  void enter(Phase p) { set_phase(p); }

  // --- Reads -------------------------------------------------------------------------
  Phase phase() const { return phase_; }
  uint64_t epoch() const { return epoch_; }
  uint64_t map_version() const { return map_version_; }
  const std::vector<int>& members() const { return members_; }
  const std::vector<std::vector<int>>& maps() const { return maps_; }
  const RankView& rank(int r) const { return ranks_.at(static_cast<size_t>(r)); }
  int num_ranks() const { return static_cast<int>(ranks_.size()); }
  const std::optional<Proposal>& proposal() const { return proposal_; }
  bool rebalancing() const { return rebalancing_; }
  const std::map<uint64_t, RequestView>& requests() const { return requests_; }
  size_t num_held() const;
  // Why the group is degraded (set on entering degraded, cleared by a recovery's commit).
  const std::string& degraded_reason() const { return degraded_reason_; }
  // When the running recovery began (the loss that entered recovering, or the scale that
  // left degraded); that of the last one once it ended.
  int64_t recovery_started_ms() const { return recovery_started_ms_; }
  int target_ranks() const { return target_ranks_; }
  const std::vector<int>& lost() const { return lost_; }  // Of the running recovery.
  bool is_member(int r) const;
  // Every phase entered, in order (several per event at times: serving -> recovering ->
  // degraded); for tests and /v1/status.
  const std::vector<Phase>& phase_history() const { return history_; }

 private:
  bool valid_rank(int r) const { return r >= 0 && r < static_cast<int>(ranks_.size()); }
  bool current(int r, uint64_t incarnation) const;
  // Ids a joiner may take: not a member, not alive (lowest first, reaped first).
  std::vector<int> free_ids() const;
  void set_phase(Phase p);
  // Opens `rank` for its next incarnation and spawns it once its id is free.
  void open(int rank, Actions* out);
  void open_joiners(const std::vector<int>& joiners, int64_t now_ms, Actions* out);
  void plan_recovery_proposal(int64_t now_ms, Actions* out);
  void send_prepares(Actions* out);
  void maybe_commit(int64_t now_ms, Actions* out);
  void commit(std::vector<int> members, const std::vector<int>& also, Actions* out);
  // Abandons the proposal: joiners stopped (kRollback), leavers serve on.
  void abandon(Actions* out);
  // Opens the recovery proposal for `chosen` (the survivors are the members).
  void open_recovery(RecoveryChoice chosen, int64_t now_ms, Actions* out);
  // Abandons the recovery's proposal and counts one failed attempt (degraded after
  // recovery_attempts); with plan_on_loss, plans the next at once.
  void fail_recovery_attempt(const std::string& why, int64_t now_ms, Actions* out);
  void enter_degraded(const std::string& why, Actions* out);
  // Places `request` on the least loaded serving member (leavers last), or holds it.
  void place(uint64_t request, RequestView& req, Actions* out);
  void place_held(Actions* out);
  Status check_maps(const std::vector<std::vector<int>>& maps,
                    const std::vector<int>& members) const;

  MembershipConfig config_;
  Phase phase_ = Phase::kStarting;
  std::vector<RankView> ranks_;
  std::vector<int> members_;
  uint64_t epoch_ = 0;
  uint64_t map_version_ = 0;
  std::vector<std::vector<int>> maps_;
  std::optional<Proposal> proposal_;
  uint64_t next_proposal_ = 1;
  bool rebalancing_ = false;
  int target_ranks_ = 0;
  std::vector<int> lost_;  // Members lost since the last commit.
  int failed_attempts_ = 0;
  std::string degraded_reason_;
  int64_t recovery_started_ms_ = 0;
  std::map<uint64_t, RequestView> requests_;
  std::vector<Phase> history_{Phase::kStarting};
};

}  // namespace flexpert::cluster
