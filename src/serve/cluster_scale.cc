// SPDX-License-Identifier: Apache-2.0
// ClusterEngine's elastic membership: scale up, scale down, recovery from a lost
// rank, request re-runs, and the stop-the-world baseline.
//
// Live scale-up (DEVELOPERS.md intents 1-3): joiners start aside (dense weights
// from the checkpoint, no experts: their slots are free in the committed map),
// attach to the members and prove the attachments with a one-sided read, and
// receive the experts the plan gives them by one-sided reads from members' slots
// (the EPLB mover). Only then is the epoch committed: every rank switches at one
// step boundary (worker.cc), the joiners' slots enter the map with it, and the
// joiners take requests. The rest of the plan (freeing replicas old ranks no
// longer need) then runs as ordinary EPLB transition steps.
//
// Scale-down moves experts off the leaving ranks first (transition steps, while
// serving), commits an epoch without them at a step boundary they take part in,
// re-runs their unfinished requests on survivors, and lets them exit.
//
// A lost rank: survivors halt at their next collective; its requests re-run on
// survivors (prompt + streamed tokens); experts left without a replica are loaded
// from the checkpoint into survivors' free slots; then an emergency epoch commits.
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "eplb/planner.h"
#include "flexpert/logging.h"
#include "serve/cluster_engine_impl.h"

namespace flexpert {
namespace {

constexpr auto kConnectTimeout = std::chrono::seconds(30);
constexpr auto kPullTimeout = std::chrono::seconds(120);
constexpr auto kApplyTimeout = std::chrono::seconds(30);

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<int> sorted_union(std::vector<int> a, const std::vector<int>& b) {
  a.insert(a.end(), b.begin(), b.end());
  std::sort(a.begin(), a.end());
  a.erase(std::unique(a.begin(), a.end()), a.end());
  return a;
}

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
    const RankState s = ranks_[r].state;
    const bool member = std::find(members_.begin(), members_.end(), r) != members_.end();
    // A rank whose process still runs (reaped later) is not reusable yet.
    if (!member && ranks_[r].pid == 0 &&
        (s == RankState::kEmpty || s == RankState::kDead || s == RankState::kStopped)) {
      out.push_back(r);
    }
  }
  return out;
}

void ClusterEngine::Impl::unlink_rank_segments(int rank, uint64_t incarnation) const {
  const std::string prefix =
      "flexpert-" + session_ + "-r" + std::to_string(rank) + "-i" + std::to_string(incarnation);
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      const std::string name = e->d_name;
      if (name == prefix || name.rfind(prefix + "-g", 0) == 0) shm_unlink(("/" + name).c_str());
    }
    closedir(dir);
  }
}

bool ClusterEngine::Impl::rehome(uint64_t id, RequestInfo& req, int avoid, Calls* calls) {
  int best = -1;
  // Ranks about to leave only when nobody else can take it (they still step).
  for (bool allow_leaving : {false, true}) {
    for (int r : members_) {
      const RankInfo& info = ranks_[r];
      if (r == avoid || (info.leaving && !allow_leaving) ||
          (info.state != RankState::kServing && info.state != RankState::kHalted)) {
        continue;
      }
      if (best < 0 || info.in_flight < ranks_[best].in_flight) best = r;
    }
    if (best >= 0) break;
  }
  if (best < 0) return false;
  const bool rerun = req.rank >= 0;
  if (rerun) {
    if (req.rank != avoid && req.rank < static_cast<int>(ranks_.size())) {
      post(req.rank, proto::CancelRequest{id});
      ranks_[req.rank].in_flight -= 1;
    }
    ++req.reruns;
    ++num_reruns_;
  }
  const int done = static_cast<int>(req.streamed.size());
  if (rerun && done >= req.params.max_tokens) {
    CompletionEvent ev;  // Everything was streamed but the final event.
    ev.finished = true;
    ev.finish_reason = "length";
    calls->push_back({req.callback, ev});
    req.rank = kFinishedRank;  // Erased by the caller's sweep_finished().
    return true;
  }
  proto::AddRequest add{id,
                        req.prompt,
                        req.params.temperature,
                        req.params.top_k,
                        req.params.top_p,
                        req.params.seed,
                        req.params.max_tokens - done,
                        req.params.stop_token_ids,
                        req.params.ignore_eos};
  add.prompt.insert(add.prompt.end(), req.streamed.begin(), req.streamed.end());
  add.attempt = static_cast<uint32_t>(req.reruns);
  req.rank = best;
  ranks_[best].in_flight += 1;
  post(best, add);
  return true;
}

void ClusterEngine::Impl::fail_request(RequestInfo& req, const std::string& why, Calls* calls) {
  CompletionEvent ev;
  ev.finished = true;
  ev.finish_reason = "error";
  ev.error = unavailable(why);
  calls->push_back({req.callback, ev});
  req.rank = kFinishedRank;  // Erased by sweep_finished().
}

void ClusterEngine::Impl::fail_all(const std::string& why, Calls* calls) {
  for (auto& [id, req] : requests_) {
    CompletionEvent ev;
    ev.finished = true;
    ev.finish_reason = "error";
    ev.error = unavailable(why);
    calls->push_back({req.callback, ev});
  }
  requests_.clear();
  for (auto& info : ranks_) info.in_flight = 0;
}

// --- Recovery from a lost rank ------------------------------------------------

void ClusterEngine::Impl::sweep_finished() {
  for (auto it = requests_.begin(); it != requests_.end();) {
    it = it->second.rank == kFinishedRank ? requests_.erase(it) : std::next(it);
  }
}

void ClusterEngine::Impl::start_recovery(const std::vector<int>& survivors, Calls* calls) {
  sweep_finished();
  const int S = slots_per_rank_;
  auto on_survivor = [&](int slot) {
    return std::find(survivors.begin(), survivors.end(), slot / S) != survivors.end();
  };
  // The committed map (or the one a recovery under way is loading for) without the
  // slots of ranks that are gone. Dense layers keep theirs: nothing routes there.
  const ExpertPlacement& base = recovery_.active ? recovery_.placement : placement_;
  std::map<uint64_t, int> pending;  // Reloads still running on survivors: wait for them too.
  if (recovery_.active) {
    for (const auto& [id, r] : recovery_.pulls) {
      if (on_survivor(r * S)) pending[id] = r;
    }
  }
  std::vector<std::vector<int>> maps;
  for (int l = 0; l < base.num_layers(); ++l) {
    std::vector<int> map = base.slot_map(l);
    for (int s = 0; model_config_.is_moe_layer(l) && s < static_cast<int>(map.size()); ++s) {
      if (!on_survivor(s)) map[s] = ExpertPlacement::kFreeSlot;
    }
    maps.push_back(std::move(map));
  }
  // Experts without a replica: load each from the checkpoint into a survivor's
  // free slot (spread over survivors), else over a surplus replica's slot. The
  // survivors are halted (their collectives include the lost rank), so no step
  // reads a slot while it is rewritten; the map points at it only in the new epoch.
  std::map<int, std::map<int, proto::PullCommand>> loads;  // rank -> layer -> command
  int reloaded = 0;
  size_t next = 0;
  for (int l = 0; l < placement_.num_layers(); ++l) {
    if (!model_config_.is_moe_layer(l)) continue;
    std::vector<int>& map = maps[l];
    std::vector<int> count(placement_.num_experts(), 0);
    for (int e : map) {
      if (e >= 0) count[e] += 1;
    }
    for (int e = 0; e < placement_.num_experts(); ++e) {
      if (count[e] > 0) continue;
      int slot = -1;
      for (size_t k = 0; k < survivors.size() && slot < 0; ++k) {
        const int r = survivors[(next + k) % survivors.size()];
        for (int s = r * S; s < (r + 1) * S; ++s) {
          if (map[s] == ExpertPlacement::kFreeSlot) {
            slot = s;
            break;
          }
        }
      }
      for (int s = 0; slot < 0 && s < static_cast<int>(map.size()); ++s) {
        if (on_survivor(s) && map[s] >= 0 && count[map[s]] > 1) slot = s;
      }
      if (slot < 0) {
        phase_ = "degraded";
        recovery_ = Recovery{};
        for (int r : survivors) ranks_[r].state = RankState::kHalted;
        fail_all("experts were lost and no slot is left to reload them into", calls);
        return;
      }
      ++next;
      if (map[slot] >= 0) count[map[slot]] -= 1;
      map[slot] = e;
      count[e] = 1;
      auto& cmd = loads[slot / S][l];
      cmd.layer = l;
      cmd.dst_slots.push_back(slot % S);
      cmd.src_ranks.push_back(proto::PullCommand::kFromCheckpoint);
      cmd.src_slots.push_back(e);
      ++reloaded;
    }
  }
  auto next_placement = ExpertPlacement::from_slot_maps(placement_.num_experts(), std::move(maps));
  if (!next_placement.ok()) {
    phase_ = "degraded";
    recovery_ = Recovery{};
    fail_all("recovery: " + next_placement.status().to_string(), calls);
    return;
  }
  recovery_ = Recovery{};
  recovery_.pulls = std::move(pending);
  recovery_.survivors = survivors;
  recovery_.placement = std::move(next_placement).value();
  recovery_.start = Clock::now();
  recovery_.reloaded = reloaded;
  if (loads.empty() && recovery_.pulls.empty()) {
    // Every expert still has a replica: route around the lost rank at once.
    placement_ = std::move(recovery_.placement);
    commit_epoch(survivors);
    ++num_reconfigs_;
    phase_ = reconfiguring_ ? "scaling" : "serving";
    last_reconfig_ = {{"kind", "recovery"},
                      {"epoch", epoch_},
                      {"members", members_},
                      {"reloaded_experts", 0},
                      {"status", "ok"}};
    return;
  }
  recovery_.active = true;
  phase_ = "recovering";
  for (auto& [rank, by_layer] : loads) {
    for (auto& [layer, cmd] : by_layer) {
      cmd.id = next_pull_id_++;
      recovery_.pulls[cmd.id] = rank;
      post(rank, cmd);
    }
  }
  wake();
  FLEX_LOG(INFO) << "recovery: reloading " << reloaded << " experts from the checkpoint on "
                 << loads.size() << " ranks";
}

void ClusterEngine::Impl::finish_recovery(const proto::PullDone& done, Calls* calls) {
  recovery_.pulls.erase(done.id);
  if (done.code != 0) {
    recovery_ = Recovery{};
    phase_ = "degraded";
    for (int r : recovery_.survivors) ranks_[r].state = RankState::kHalted;
    fail_all("recovery could not reload experts: " + done.message, calls);
    return;
  }
  if (!recovery_.pulls.empty()) return;
  recovery_.active = false;
  placement_ = std::move(recovery_.placement);
  commit_epoch(recovery_.survivors);
  ++num_reconfigs_;
  phase_ = reconfiguring_ ? "scaling" : "serving";
  last_reconfig_ = {{"kind", "recovery"},
                    {"epoch", epoch_},
                    {"members", members_},
                    {"reloaded_experts", recovery_.reloaded},
                    {"reload_s", seconds_since(recovery_.start)},
                    {"status", "ok"}};
  FLEX_LOG(INFO) << "recovery: epoch " << epoch_ << " after reloading " << recovery_.reloaded
                 << " experts in " << seconds_since(recovery_.start) << " s";
}

// --- Scaling ------------------------------------------------------------------

Status ClusterEngine::Impl::connect_all(const std::map<int, proto::ConnectCommand>& cmds,
                                        std::unique_lock<std::mutex>& lock,
                                        const std::function<bool()>& failed) {
  std::vector<uint64_t> ids;
  const uint64_t epoch = epoch_;
  for (auto [rank, cmd] : cmds) {
    cmd.id = next_connect_id_++;
    ids.push_back(cmd.id);
    connects_awaited_.insert(cmd.id);
    post(rank, cmd);
  }
  wake();
  std::map<uint64_t, proto::Connected> answers;
  auto forget = [&] {  // On every return: nothing of this call stays behind.
    for (uint64_t id : ids) {
      connects_awaited_.erase(id);
      auto it = connects_done_.find(id);
      if (it == connects_done_.end()) continue;
      answers[id] = it->second;
      connects_done_.erase(it);
    }
  };
  const bool done = cv_.wait_for(lock, kConnectTimeout, [&] {
    if (halting() || epoch_ != epoch || failed()) return true;
    return std::all_of(ids.begin(), ids.end(),
                       [&](uint64_t id) { return connects_done_.count(id); });
  });
  forget();
  if (halting()) return unavailable("shutting down");
  if (epoch_ != epoch) return aborted("membership changed (a rank was lost)");
  if (failed()) return unavailable("a rank failed while connecting");
  if (!done) return deadline_exceeded("transport connections not confirmed in time");
  for (uint64_t id : ids) {
    const proto::Connected& c = answers[id];
    if (c.code != 0) return Status(static_cast<StatusCode>(c.code), c.message);
  }
  return Status();
}

Status ClusterEngine::Impl::wait_applied(const std::vector<int>& ranks, uint64_t epoch,
                                         std::unique_lock<std::mutex>& lock) {
  const bool done = cv_.wait_for(lock, kApplyTimeout, [&] {
    if (halting() || epoch_ != epoch) return true;
    return std::all_of(ranks.begin(), ranks.end(), [&](int r) {
      const RankInfo& i = ranks_[r];
      return i.applied_epoch >= epoch || i.state == RankState::kDead ||
             (i.state == RankState::kStopped && i.spawned && i.pid == 0);
    });
  });
  if (halting()) return unavailable("shutting down");
  if (epoch_ != epoch) return aborted("membership changed during the commit");
  if (!done) return deadline_exceeded("epoch " + std::to_string(epoch) + " not applied in time");
  return Status();
}

void ClusterEngine::Impl::rollback_joiners(const std::vector<int>& joiners) {
  // Caller holds mutex_. Nothing of theirs is in any map: kill them, detach members.
  proto::ConnectCommand detach;
  for (int r : joiners) {
    RankInfo& info = ranks_[r];
    info.joining = false;
    spawn_queue_.erase(std::remove(spawn_queue_.begin(), spawn_queue_.end(), r),
                       spawn_queue_.end());
    if (info.state != RankState::kDead) info.state = RankState::kStopped;
    if (info.spawned && info.pid > 0) {
      kill(info.pid, SIGKILL);  // Reaped (and its segments removed) by check_workers.
    } else if (!info.routing_id.empty()) {
      post(r, proto::Shutdown{proto::Shutdown::kLeave});
      unlink_rank_segments(r, info.incarnation);
    }
    if (!info.spawned) info.pid = 0;  // Not ours to reap.
    detach.ranks.push_back(r);
    detach.addresses.push_back("");
  }
  detach.id = next_connect_id_++;  // Not awaited: its answers are dropped.
  for (int m : members_) post(m, detach);
  wake();
}

Status ClusterEngine::Impl::scale_up(const std::vector<int>& joiners, nlohmann::json* report) {
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t epoch0 = epoch_;
  const std::vector<int> old_members = members_;
  // A rank lost meanwhile (an epoch, or a recovery under way) ends the preparation.
  auto group_changed = [&] {
    return epoch_ != epoch0 || members_ != old_members || recovery_.active;
  };
  auto fail = [&](Status s) {
    rollback_joiners(joiners);
    (*report)["rolled_back"] = true;
    return s;
  };
  // 1. Start the joiners: dense weights from the checkpoint, no experts, a transport.
  reconfig_step_ = "starting workers";
  for (int r : joiners) {
    RankInfo& info = ranks_[r];
    const uint64_t incarnation = info.incarnation;
    info = RankInfo{};
    info.incarnation = incarnation;
    info.state = RankState::kStarting;
    info.joining = true;
    info.last_seen = Clock::now();
    if (options_.spawn_workers) {
      request_spawn(r);
    } else {
      std::printf("waiting for 1 worker: flexpert worker --join %s --rank %d\n",
                  endpoint_.substr(6).c_str(), r);
      std::fflush(stdout);
    }
  }
  auto joiner_failed = [&] {
    for (int r : joiners) {
      const RankState s = ranks_[r].state;
      if (s == RankState::kDead || s == RankState::kStopped) return r;
    }
    return -1;
  };
  cv_.wait_for(lock, std::chrono::milliseconds(options_.start_timeout_ms), [&] {
    if (halting() || group_changed() || joiner_failed() >= 0) return true;
    return std::all_of(joiners.begin(), joiners.end(),
                       [&](int r) { return ranks_[r].state == RankState::kReady; });
  });
  if (halting()) return fail(unavailable("shutting down"));
  if (group_changed()) return fail(aborted("a rank was lost during the preparation"));
  if (int r = joiner_failed(); r >= 0) {
    return fail(unavailable("rank " + std::to_string(r) +
                            " failed while starting: " + ranks_[r].last_error));
  }
  for (int r : joiners) {
    if (ranks_[r].state != RankState::kReady) {
      return fail(deadline_exceeded("rank " + std::to_string(r) + " not ready within " +
                                    std::to_string(options_.start_timeout_ms) + " ms"));
    }
  }
  (*report)["load_s"] = seconds_since(t0);

  // 2. Attach joiners and members to each other and prove it with one-sided reads.
  reconfig_step_ = "connecting";
  const std::vector<int> next_members = sorted_union(old_members, joiners);
  int probe_region = -1;
  for (int l = 0; l < model_config_.num_hidden_layers && probe_region < 0; ++l) {
    if (model_config_.is_moe_layer(l)) probe_region = l;
  }
  std::map<int, proto::ConnectCommand> connects;
  auto is_joiner = [&](int r) {
    return std::find(joiners.begin(), joiners.end(), r) != joiners.end();
  };
  for (int r : next_members) {
    proto::ConnectCommand cmd;
    cmd.probe_region = probe_region;
    for (int p : next_members) {
      if (p == r || !(is_joiner(r) || is_joiner(p))) continue;
      cmd.ranks.push_back(p);
      cmd.addresses.push_back(ranks_[p].address);
    }
    if (!cmd.ranks.empty()) connects[r] = std::move(cmd);
  }
  const auto t_connect = Clock::now();
  if (Status s =
          connect_all(connects, lock, [&] { return joiner_failed() >= 0 || group_changed(); });
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
  const eplb::PlanInput input = plan_input(next_members, /*prior=*/1.0);
  lock.unlock();
  auto plan = eplb::plan(input);
  lock.lock();
  if (!plan.ok()) return fail(plan.status());
  if (group_changed()) return fail(aborted("a rank was lost during the preparation"));
  const int S = slots_per_rank_;
  std::vector<std::vector<int>> maps = input.current;
  std::vector<uint64_t> ids;
  int copies = 0;
  for (int l = 0; l < placement_.num_layers(); ++l) {
    if (!model_config_.is_moe_layer(l)) continue;
    std::vector<int> rotation(placement_.num_experts(), 0);
    for (int j : joiners) {
      proto::PullCommand cmd;
      cmd.layer = l;
      for (int s = j * S; s < (j + 1) * S; ++s) {
        const int e = plan->placement[l][s];
        if (e < 0) continue;
        const std::vector<int>& from = placement_.replicas(l, e);
        if (from.empty()) return fail(internal_error("expert without a replica"));
        const int src = from[rotation[e]++ % from.size()];
        cmd.dst_slots.push_back(s % S);
        cmd.src_ranks.push_back(src / S);
        cmd.src_slots.push_back(src % S);
        maps[l][s] = e;
        ++copies;
      }
      if (cmd.dst_slots.empty()) continue;
      cmd.id = next_pull_id_++;
      ids.push_back(cmd.id);
      post(j, cmd);
    }
  }
  wake();
  const auto t_pull = Clock::now();
  const bool pulled = cv_.wait_for(lock, kPullTimeout, [&] {
    if (halting() || group_changed() || joiner_failed() >= 0) return true;
    return std::all_of(ids.begin(), ids.end(), [&](uint64_t id) { return pulls_done_.count(id); });
  });
  if (halting()) return fail(unavailable("shutting down"));
  if (group_changed()) return fail(aborted("a rank was lost during the preparation"));
  if (int r = joiner_failed(); r >= 0) {
    return fail(unavailable("rank " + std::to_string(r) + " failed while receiving experts"));
  }
  if (!pulled) return fail(deadline_exceeded("expert copies to the joiners timed out"));
  uint64_t bytes = 0, device_copies = 0;
  for (uint64_t id : ids) {
    const proto::PullDone d = pulls_done_[id];
    pulls_done_.erase(id);
    if (d.code != 0) return fail(Status(static_cast<StatusCode>(d.code), "pull: " + d.message));
    bytes += d.num_bytes;
    device_copies += d.device_copies;
  }
  (*report)["expert_copies"] = copies;
  (*report)["device_copies"] = device_copies;
  (*report)["copied_bytes"] = bytes;
  (*report)["copy_s"] = seconds_since(t_pull);
  moved_bytes_total_ += bytes;
  auto next = ExpertPlacement::from_slot_maps(placement_.num_experts(), std::move(maps));
  if (!next.ok()) return fail(next.status());
  (*report)["prepare_s"] = seconds_since(t0);

  // 4. Commit: every rank switches at one step boundary; joiners start stepping.
  reconfig_step_ = "committing";
  placement_ = std::move(next).value();
  const auto t_commit = Clock::now();
  commit_epoch(next_members);
  for (int r : joiners) ranks_[r].joining = false;
  ++num_reconfigs_;
  const uint64_t epoch1 = epoch_;
  FLEX_RETURN_IF_ERROR(wait_applied(next_members, epoch1, lock));
  (*report)["commit_s"] = seconds_since(t_commit);

  // 5. The rest of the plan (e.g. replicas old ranks no longer need), while serving.
  reconfig_step_ = "rebalancing";
  rebalance_epoch_ = epoch_;
  cancel_rebalance_ = false;
  lock.unlock();
  uint64_t moved = 0;
  int pulls = 0;
  Status s;
  for (int l = 0; s.ok() && l < placement_.num_layers(); ++l) {
    if (model_config_.is_moe_layer(l)) s = move_layer(l, plan->placement[l], &moved, &pulls);
  }
  lock.lock();
  moved_bytes_total_ += moved;
  (*report)["converge_moved_bytes"] = moved;
  if (!s.ok()) (*report)["converge_status"] = s.to_string();  // Committed all the same.
  return Status();
}

Status ClusterEngine::Impl::scale_down(const std::vector<int>& leavers, nlohmann::json* report) {
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  std::vector<int> survivors;
  for (int r : members_) {
    if (std::find(leavers.begin(), leavers.end(), r) == leavers.end()) survivors.push_back(r);
  }
  // 1. Plan without the leavers (fails early, e.g. too few slots, before anything moves).
  auto plan = eplb::plan(plan_input(survivors, /*prior=*/1.0));
  if (!plan.ok()) {
    return invalid_argument("cannot shrink to " + std::to_string(survivors.size()) +
                            " ranks: " + plan.status().message());
  }
  for (int r : leavers) ranks_[r].leaving = true;  // No new requests from here on.
  auto unmark = [&] {
    for (int r : leavers) ranks_[r].leaving = false;
  };
  // 2. Move experts off the leavers (transition steps; everybody keeps serving).
  reconfig_step_ = "moving experts";
  rebalance_epoch_ = epoch_;
  cancel_rebalance_ = false;
  lock.unlock();
  uint64_t moved = 0;
  int pulls = 0;
  Status s;
  for (int l = 0; s.ok() && l < placement_.num_layers(); ++l) {
    if (model_config_.is_moe_layer(l)) s = move_layer(l, plan->placement[l], &moved, &pulls);
  }
  lock.lock();
  moved_bytes_total_ += moved;
  (*report)["moved_bytes"] = moved;
  (*report)["prepare_s"] = seconds_since(t0);
  if (!s.ok()) {
    unmark();
    return s;
  }
  // 3. Commit: the leavers switch with everyone, then stop stepping; their
  // unfinished requests re-run on survivors.
  reconfig_step_ = "committing";
  for (int r : members_) {
    if (ranks_[r].state != RankState::kServing || cancel_rebalance_ || recovery_.active ||
        epoch_ != rebalance_epoch_) {
      unmark();
      return aborted("the group changed while experts moved (rank " + std::to_string(r) + ")");
    }
  }
  const auto t_commit = Clock::now();
  commit_epoch(survivors, leavers);
  ++num_reconfigs_;
  const uint64_t epoch1 = epoch_;
  int reruns = 0;
  Calls calls;
  for (auto& [id, req] : requests_) {
    if (std::find(leavers.begin(), leavers.end(), req.rank) != leavers.end()) {
      if (!rehome(id, req, -1, &calls)) fail_request(req, "no rank left to run it", &calls);
      ++reruns;
    }
  }
  sweep_finished();
  for (int r : leavers) {
    ranks_[r].in_flight = 0;
    ranks_[r].leaving = false;
    ranks_[r].state = RankState::kStopped;  // Its exit is not a loss.
    post(r, proto::Shutdown{proto::Shutdown::kLeave});
  }
  wake();
  lock.unlock();
  for (auto& [cb, ev] : calls) cb(ev);
  lock.lock();
  Status applied = wait_applied(sorted_union(survivors, leavers), epoch1, lock);
  (*report)["commit_s"] = seconds_since(t_commit);
  (*report)["rerun_requests"] = reruns;
  return applied;
}

Status ClusterEngine::Impl::restart_group(int num_ranks, nlohmann::json* report) {
  // Stop-the-world: admission is closed (503) by the caller; drain, stop all, restart.
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  reconfig_step_ = "draining";
  cv_.wait_for(lock, std::chrono::seconds(60), [&] { return halting() || requests_.empty(); });
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
  std::vector<pid_t> children;
  for (int r : members_) {
    RankInfo& info = ranks_[r];
    if (info.state != RankState::kDead) {
      post(r, proto::Shutdown{proto::Shutdown::kStop});
      info.state = RankState::kStopped;
    }
  }
  members_.clear();
  wake();
  cv_.wait_for(lock, std::chrono::seconds(10), [&] {
    return halting() ||
           std::all_of(ranks_.begin(), ranks_.end(), [](const RankInfo& i) { return i.pid == 0; });
  });
  for (auto& info : ranks_) {
    if (info.spawned && info.pid > 0) kill(info.pid, SIGKILL);
  }
  cv_.wait_for(lock, std::chrono::seconds(5), [&] {
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
    RankInfo& info = ranks_[r];
    const uint64_t incarnation = info.incarnation;
    info = RankInfo{};
    info.incarnation = incarnation;
    request_spawn(r);
  }
  cv_.wait_for(lock, std::chrono::milliseconds(options_.start_timeout_ms), [&] {
    return halting() || std::all_of(next.begin(), next.end(), [&](int r) {
             return ranks_[r].state == RankState::kReady || ranks_[r].state == RankState::kDead;
           });
  });
  for (int r : next) {
    if (ranks_[r].state != RankState::kReady) {
      phase_ = "degraded";
      return unavailable("rank " + std::to_string(r) + " did not restart");
    }
  }
  commit_epoch(next);
  ++num_reconfigs_;
  FLEX_RETURN_IF_ERROR(wait_applied(next, epoch_, lock));
  phase_ = "serving";
  accepting_ = true;
  (*report)["epoch"] = epoch_;
  (*report)["members"] = members_;
  (*report)["total_s"] = seconds_since(t0);
  return Status();
}

Result<nlohmann::json> ClusterEngine::Impl::scale(const ScaleTarget& target) {
  std::vector<int> joiners, leavers;
  const bool stop_the_world = options_.reconfigure == "stop-the-world";
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (reconfiguring_) return failed_precondition("a reconfiguration is already in progress");
    if (rebalancing_) return failed_precondition("an expert rebalance is in progress");
    if (halting()) return unavailable("the server is shutting down");
    if (phase_ != "serving") {
      return failed_precondition("the group is not serving (phase " + phase_ + ")");
    }
    for (int r : members_) {
      // As for a rebalance: no weight moves while a member may use an older map.
      if (ranks_[r].map_version != map_version_) {
        return failed_precondition("rank " + std::to_string(r) + " has not applied expert map " +
                                   std::to_string(map_version_) + " yet");
      }
    }
    const int max = options_.max_ranks;
    const int now = static_cast<int>(members_.size());
    if (!target.remove.empty()) {
      for (int r : target.remove) {
        if (r < 0 || r >= max || std::find(members_.begin(), members_.end(), r) == members_.end()) {
          return invalid_argument("rank " + std::to_string(r) + " is not a member");
        }
        if (std::find(leavers.begin(), leavers.end(), r) == leavers.end()) leavers.push_back(r);
      }
      if (static_cast<int>(leavers.size()) >= now) {
        return invalid_argument("cannot remove every member (at least 1 rank must stay)");
      }
    } else {
      if (target.ranks < 1 || target.ranks > max) {
        return invalid_argument("\"ranks\" must be in [1, " + std::to_string(max) +
                                "] (--max-ranks), got " + std::to_string(target.ranks));
      }
      if (target.ranks > now) {
        // Ids of ranks still exiting (a scale-down a moment ago) free up shortly.
        cv_.wait_for(lock, std::chrono::seconds(5), [&] {
          return halting() || static_cast<int>(free_ranks().size()) >= target.ranks - now;
        });
        const std::vector<int> free = free_ranks();
        if (static_cast<int>(free.size()) < target.ranks - now) {
          return failed_precondition("only " + std::to_string(free.size()) +
                                     " rank ids are free (others are still exiting)");
        }
        joiners.assign(free.begin(), free.begin() + (target.ranks - now));
      } else if (target.ranks < now) {
        // The least loaded leave (ties: the highest ids), so that fewest requests move.
        std::vector<int> order = members_;
        std::sort(order.begin(), order.end(), [&](int a, int b) {
          if (ranks_[a].in_flight != ranks_[b].in_flight) {
            return ranks_[a].in_flight < ranks_[b].in_flight;
          }
          return a > b;
        });
        leavers.assign(order.begin(), order.begin() + (now - target.ranks));
        std::sort(leavers.begin(), leavers.end());
      }
    }
    if (joiners.empty() && leavers.empty()) {
      return nlohmann::json{{"epoch", epoch_}, {"members", members_}, {"changed", false}};
    }
    if (stop_the_world && !options_.spawn_workers) {
      return invalid_argument("--reconfigure stop-the-world needs spawned workers");
    }
    reconfiguring_ = true;
    phase_ = "scaling";
    if (stop_the_world) accepting_ = false;
  }
  const auto t0 = Clock::now();
  nlohmann::json report = {{"kind", joiners.empty() ? "scale-down" : "scale-up"},
                           {"mode", stop_the_world ? "stop-the-world" : "live"}};
  if (!joiners.empty()) report["joined"] = joiners;
  if (!leavers.empty()) report["left"] = leavers;
  FLEX_LOG(INFO) << report["kind"].get<std::string>() << " (" << report["mode"].get<std::string>()
                 << "): +" << joiners.size() << " -" << leavers.size() << " ranks";
  Status s;
  if (stop_the_world) {
    int n = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      n = static_cast<int>(members_.size() + joiners.size() - leavers.size());
    }
    s = restart_group(n, &report);
  } else if (!joiners.empty()) {
    s = scale_up(joiners, &report);
  } else {
    s = scale_down(leavers, &report);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  reconfiguring_ = false;
  reconfig_step_.clear();
  if (!halting()) {
    if (phase_ == "scaling" || (stop_the_world && phase_ != "degraded")) phase_ = "serving";
    if (stop_the_world) accepting_ = phase_ == "serving";
  }
  report["total_s"] = seconds_since(t0);
  report["epoch"] = epoch_;
  report["members"] = members_;
  report["status"] = s.ok() ? "ok" : s.to_string();
  last_reconfig_ = report;
  cv_.notify_all();
  FLEX_LOG(INFO) << "reconfiguration: " << report.dump();
  if (!s.ok()) return s;
  return report;
}

nlohmann::json ClusterEngine::Impl::reconfig_status() const {
  // Caller holds mutex_.
  return {{"in_progress", reconfiguring_ || recovery_.active},
          {"step", recovery_.active ? std::string("reloading experts") : reconfig_step_},
          {"mode", options_.reconfigure},
          {"reconfigurations", num_reconfigs_},
          {"reruns", num_reruns_},
          {"last", last_reconfig_}};
}

Result<nlohmann::json> ClusterEngine::scale(const ScaleTarget& target) {
  return impl_->scale(target);
}

}  // namespace flexpert
