// SPDX-License-Identifier: Apache-2.0
// ClusterEngine's expert load balancing: the load it records (kept by eplb::LoadWindow),
// the rebalance driver (plan -> per layer: the steps of eplb::next_transition_step — pull
// experts into free slots then switch the map, or switch to a map that frees slots) and its
// status.
//
// Safety argument (docs/ARCHITECTURE.md, "Expert load balancing"): a slot is written only while no
// map of any member points at it (it is free in the committed map), and a slot is freed only after
// every pull that reads it finished; a map points at a slot only after its bytes landed. Map
// switches happen at a step boundary all members agree on (worker.cc), so a step never mixes two
// maps.
#include <algorithm>
#include <chrono>
#include <map>
#include <numeric>

#include "core/thread_name.h"
#include "engine/placement_wire.h"
#include "eplb/planner.h"
#include "eplb/transition.h"
#include "flexpert/logging.h"
#include "serve/cluster_engine_impl.h"

namespace flexpert {
namespace {

constexpr auto kAckTimeout = std::chrono::seconds(30);

}  // namespace

void ClusterEngine::Impl::record_load(int rank, const std::vector<int64_t>& slot_counts) {
  const int L = placement_.num_layers();
  const size_t S = static_cast<size_t>(slots_per_rank_);
  if (slot_counts.size() != L * S) return;
  load_.at(Clock::now());  // The window slides with every report, rows or none.
  for (int l = 0; l < L; ++l) {
    for (size_t i = 0; i < S; ++i) {
      const int64_t n = slot_counts[l * S + i];
      if (n == 0) continue;
      const int slot = rank * slots_per_rank_ + static_cast<int>(i);
      registry_
          .counter("flexpert_slot_tokens_total", "Rows computed per layer and physical slot.",
                   {{"layer", std::to_string(l)}, {"slot", std::to_string(slot)}})
          .inc(static_cast<double>(n));
      const int expert = placement_.slot_expert(l, slot);
      if (expert >= 0) load_.add(l, expert, static_cast<double>(n));
    }
  }
}

int ClusterEngine::Impl::min_replicas_for(int members) const {
  if (options_.min_replicas > 0) return std::min(options_.min_replicas, members);
  return auto_min_replicas(model_config_.num_experts, members, slots_per_rank_,
                           options_.eplb_spare_slots);
}

eplb::PlanInput ClusterEngine::Impl::plan_input(const std::vector<int>& ranks,
                                                std::vector<std::vector<double>> load,
                                                double prior) const {
  eplb::PlanInput input;
  input.num_experts = placement_.num_experts();
  input.slots_per_rank = slots_per_rank_;
  input.ranks = ranks;
  input.max_ranks = options_.max_ranks;
  input.load = std::move(load);
  for (auto& row : input.load) {
    for (double& x : row) x += prior;
  }
  for (int l = 0; l < placement_.num_layers(); ++l) input.current.push_back(placement_.slot_map(l));
  input.min_replicas = min_replicas_for(static_cast<int>(ranks.size()));
  input.num_groups = model_config_.num_expert_groups();  // For the hierarchical policy.
  if (auto policy = eplb::parse_policy(options_.eplb_policy); policy.ok()) input.policy = *policy;
  return input;
}

Status ClusterEngine::Impl::commit_map(ExpertPlacement next) {
  MutexLock lock(mutex_);
  if (epoch() != rebalance_epoch_ || cancel_rebalance_ || recovering()) {
    return aborted("the group changed during the rebalance");
  }
  std::vector<std::vector<int>> maps;
  for (int l = 0; l < next.num_layers(); ++l) maps.push_back(next.slot_map(l));
  // A step that leaves an expert without a replica on a member is refused, never sent.
  FLEX_RETURN_IF_ERROR(
      membership_.record_maps(std::move(maps), members()).annotate("expert map refused"));
  const uint64_t version = ++map_version_;
  proto::MapCommand cmd{version, to_wire(next)};
  for (int r : members()) post(r, cmd);
  // Requests and load attribution follow the new map from here on.
  placement_ = std::move(next);
  wake();
  const uint64_t epoch0 = epoch();
  const bool ok = cv_.wait_for(lock, kAckTimeout, [&]() REQUIRES(mutex_) {
    if (stop_.load() || epoch() != epoch0 || cancel_rebalance_) return true;
    for (int r : members()) {
      if (state(r) == RankState::kServing && ranks_[r].map_version < version) return false;
    }
    return true;
  });
  if (stop_.load()) return unavailable("shutting down");
  if (epoch() != epoch0) return aborted("membership changed during the rebalance");
  if (cancel_rebalance_) return aborted("rebalance cancelled");
  if (!ok) {
    return deadline_exceeded("expert map " + std::to_string(version) + " not applied in time");
  }
  return Status();
}

void ClusterEngine::Impl::add_pull(Pulls* pulls, int layer, int dst_slot, int src_rank,
                                   int src_slot) const {
  const int S = slots_per_rank_;
  proto::PullCommand& cmd = (*pulls)[{dst_slot / S, layer}];
  cmd.layer = layer;
  cmd.dst_slots.push_back(dst_slot % S);
  cmd.src_ranks.push_back(src_rank);
  cmd.src_slots.push_back(src_slot);
}

Status ClusterEngine::Impl::run_pulls(Pulls pulls, Clock::duration timeout,
                                      const std::function<bool()>& stop, PullTotals* totals) {
  std::vector<uint64_t> ids;
  std::map<uint64_t, int> num_slots;
  for (auto& [key, cmd] : pulls) {
    cmd.id = next_pull_id_++;
    ids.push_back(cmd.id);
    num_slots[cmd.id] = static_cast<int>(cmd.dst_slots.size());
    post(key.first, cmd);
  }
  wake();
  const bool answered = cv_.wait_for(mutex_, timeout, [&]() REQUIRES(mutex_) {
    return stop() || std::all_of(ids.begin(), ids.end(), [&](uint64_t id) REQUIRES(mutex_) {
             return pulls_done_.count(id) > 0;
           });
  });
  Status s = stop()      ? aborted("stopped while experts were copied")
             : !answered ? deadline_exceeded("expert copies timed out")
                         : Status();
  for (uint64_t id : ids) {
    auto it = pulls_done_.find(id);
    if (it == pulls_done_.end()) continue;
    const proto::PullDone& d = it->second;
    if (s.ok() && d.code != 0) s = Status(static_cast<StatusCode>(d.code), "pull: " + d.message);
    totals->num_bytes += d.num_bytes;
    totals->device_copies += d.device_copies;
    totals->seconds += d.seconds;
    totals->commands += 1;
    if (d.code == 0) totals->slots += num_slots[id];  // A failed pull placed none.
    pulls_done_.erase(it);
  }
  return s;
}

Status ClusterEngine::Impl::move_layer(int layer, const std::vector<int>& target,
                                       PullTotals* moved) {
  const int S = slots_per_rank_;
  for (int round = 0; round < 512; ++round) {
    std::vector<int> current;
    std::vector<std::vector<int>> maps;
    int num_experts = 0;
    {
      MutexLock lock(mutex_);
      if (cancel_rebalance_) return aborted("rebalance cancelled");
      for (int i = 0; i < placement_.num_layers(); ++i) maps.push_back(placement_.slot_map(i));
      current = maps[layer];
      num_experts = placement_.num_experts();
    }
    auto step = eplb::next_transition_step(current, target, S, num_experts);
    if (!step.ok()) {
      return step.status().code() == StatusCode::kNotFound ? Status() : step.status();
    }
    if (step->kind == eplb::TransitionStep::Kind::kFill) {
      // The destination slots are free in every member's map: pull, then point at them.
      Pulls pulls;
      for (const auto& [dst, src] : step->copies) add_pull(&pulls, layer, dst, src / S, src % S);
      MutexLock lock(mutex_);
      // Re-checked under the lock that posts: a recovery may own the free slots now.
      if (cancel_rebalance_ || recovering() || epoch() != rebalance_epoch_) {
        return aborted("the group changed during the rebalance");
      }
      PullTotals done;
      Status s = run_pulls(
          std::move(pulls), kAckTimeout,
          [&]() REQUIRES(mutex_) {
            return stop_.load() || epoch() != rebalance_epoch_ || cancel_rebalance_;
          },
          &done);
      if (stop_.load()) return unavailable("shutting down");
      if (epoch() != rebalance_epoch_) return aborted("membership changed during the rebalance");
      if (cancel_rebalance_) return aborted("rebalance cancelled");
      if (s.code() == StatusCode::kDeadlineExceeded) {
        return deadline_exceeded("expert pulls of layer " + std::to_string(layer) + " timed out");
      }
      FLEX_RETURN_IF_ERROR(s);
      moved->num_bytes += done.num_bytes;
      moved->device_copies += done.device_copies;
      moved->seconds += done.seconds;
      moved->commands += done.commands;
      moved->slots += done.slots;
      pull_seconds_ += done.seconds;
    }
    maps[layer] = step->map;
    FLEX_ASSIGN_OR_RETURN(ExpertPlacement next,
                          ExpertPlacement::from_slot_maps(num_experts, std::move(maps)));
    FLEX_RETURN_IF_ERROR(commit_map(std::move(next)));
  }
  return resource_exhausted("layer " + std::to_string(layer) + ": transition did not converge");
}

Result<nlohmann::json> ClusterEngine::Impl::rebalance(const std::string& trigger) {
  eplb::PlanInput input;
  double step_ms_before = 0;
  {
    MutexLock lock(mutex_);
    if (rebalancing_) return failed_precondition("a rebalance is already in progress");
    if (reconfiguring_ || recovering()) {
      return failed_precondition("a membership change is in progress");
    }
    if (phase() != Phase::kServing)
      return unavailable("no serving epoch (phase " + std::string(phase_name(phase())) + ")");
    for (int r : members()) {
      // After a timed-out switch the front end cannot know which map a rank uses:
      // no weight may move until every member reports the current one.
      if (ranks_[r].map_version != map_version_) {
        return failed_precondition("rank " + std::to_string(r) + " has not applied expert map " +
                                   std::to_string(map_version_) + " yet");
      }
    }
    rebalancing_ = true;
    cancel_rebalance_ = false;
    rebalance_epoch_ = epoch();
    pulls_done_.clear();
    rebalance_max_step_ms_ = 0;
    // The rebalance advances the smoothing: its window joins the kept shares.
    input = plan_input(members(), load_.advance(), /*prior=*/0.0);
    input.min_gain = options_.eplb_min_gain;  // Rebalances only (membership changes must move).
    int n = 0;
    for (int r : members()) {
      if (ranks_[r].step_ms > 0) {
        step_ms_before += ranks_[r].step_ms;
        ++n;
      }
    }
    if (n) step_ms_before /= n;
  }
  auto finish = [&](Status s, nlohmann::json report) -> Result<nlohmann::json> {
    MutexLock lock(mutex_);
    if (s.ok()) {
      // A worker reports its longest step every 200 ms; a rebalance often ends sooner, so
      // wait for one report per member after it (its steps since the last one include the
      // rebalance's) before taking the longest step reported.
      std::map<int, uint64_t> seen;
      for (int r : members()) seen[r] = ranks_[r].reports;
      cv_.wait_for(lock, std::chrono::milliseconds(600), [&]() REQUIRES(mutex_) {
        if (halting() || cancel_rebalance_ || epoch() != rebalance_epoch_) return true;
        for (const auto& [r, n] : seen) {
          if (ranks_[r].reports == n) return false;  // (A dead one: a new epoch, or the timeout.)
        }
        return true;
      });
    }
    rebalancing_ = false;
    cancel_rebalance_ = false;
    cv_.notify_all();  // drain_rebalance() waiters.
    report["trigger"] = trigger;
    report["status"] = s.ok() ? "ok" : s.to_string();
    report["max_step_ms_during"] = rebalance_max_step_ms_;
    report["mean_step_ms_before"] = step_ms_before;
    last_rebalance_ = report;
    if (!s.ok()) return s;
    rebalances().inc();
    return report;
  };
  const auto t0 = Clock::now();
  auto policy = eplb::parse_policy(options_.eplb_policy);
  if (!policy.ok()) return finish(policy.status(), {});
  input.policy = policy.value();
  // Dense layers have no experts: plan them with zero load (they keep their map).
  auto plan = eplb::plan(input);
  if (!plan.ok()) return finish(plan.status(), {});
  const double plan_s = std::chrono::duration<double>(Clock::now() - t0).count();
  PullTotals moved;
  double pull_s0 = 0;
  {
    MutexLock lock(mutex_);
    pull_s0 = pull_seconds_;
  }
  Status s;
  for (int l = 0; s.ok() && !plan->skipped && l < static_cast<int>(input.current.size()); ++l) {
    if (!model_config_.is_moe_layer(l)) continue;
    s = move_layer(l, plan->placement[l], &moved);
  }
  double pull_s = 0;
  {
    MutexLock lock(mutex_);
    pull_s = pull_seconds_ - pull_s0;
  }
  // pull_s: the movers' copy time, summed over the pulls (ranks copy in parallel).
  nlohmann::json report = {{"planned_moved_slots", plan->moved_slots},
                           {"pull_s", pull_s},
                           {"moved_bytes", moved.num_bytes},
                           {"moved_slots", moved.slots},
                           {"pull_commands", moved.commands},
                           {"plan_s", plan_s},
                           {"duration_s", std::chrono::duration<double>(Clock::now() - t0).count()},
                           {"balancedness_planned", plan->balancedness},
                           {"balancedness_gain", plan->balancedness_gain},
                           {"skipped", plan->skipped}};
  {
    MutexLock lock(mutex_);
    moved_bytes().inc(static_cast<double>(moved.num_bytes));
  }
  FLEX_LOG(INFO) << "rebalance (" << trigger << "): " << moved.slots << " slots, "
                 << moved.num_bytes << " bytes in " << report["duration_s"].get<double>() << " s"
                 << (s.ok() ? "" : ": " + s.to_string());
  return finish(s, report);
}

void ClusterEngine::Impl::eplb_loop() {
  name_this_thread("fx-eplb");
  MutexLock lock(mutex_);
  while (!stop_.load()) {
    eplb_cv_.wait_for(lock, std::chrono::duration<double>(options_.eplb_interval_s),
                      [&]() REQUIRES(mutex_) { return stop_.load(); });
    if (stop_.load()) break;
    double total = 0;
    for (const auto& row : load_.sum()) total += std::accumulate(row.begin(), row.end(), 0.0);
    if (total == 0 || phase() != Phase::kServing) continue;
    lock.unlock();
    auto r = rebalance("periodic");
    if (!r.ok()) FLEX_LOG(WARN) << "periodic rebalance: " << r.status().to_string();
    lock.lock();
  }
}

nlohmann::json ClusterEngine::Impl::eplb_status() const {
  MutexLock lock(mutex_);
  const auto load = load_.sum();
  const auto planned = load_.smoothed();
  nlohmann::json layers = nlohmann::json::array();
  for (int l = 0; l < placement_.num_layers(); ++l) {
    if (!model_config_.is_moe_layer(l)) continue;
    layers.push_back(
        {{"layer", l},
         {"slot_to_expert", placement_.slot_map(l)},
         {"window_load", load[l]},
         {"smoothed_shares",
          l < static_cast<int>(load_.shares().size()) ? load_.shares()[l] : std::vector<double>{}},
         {"planned_load", planned[l]},
         {"balancedness",
          eplb::balancedness(load[l], placement_.slot_map(l), members(), slots_per_rank_)}});
  }
  return {{"enabled", options_.eplb},
          {"window_s", options_.eplb_window_s},
          {"interval_s", options_.eplb_interval_s},
          {"policy", options_.eplb_policy},
          {"smoothing", options_.eplb_smoothing},
          {"min_gain", options_.eplb_min_gain},
          {"slots_per_rank", slots_per_rank_},
          {"map_version", map_version_},
          {"in_progress", rebalancing_},
          {"rebalances", static_cast<uint64_t>(rebalances().value())},
          {"moved_bytes_total", static_cast<uint64_t>(moved_bytes().value())},
          {"layers", layers},
          {"last_rebalance", last_rebalance_}};
}

void ClusterEngine::Impl::update_eplb_gauges() const {
  const auto load = load_.sum();
  for (int l = 0; l < placement_.num_layers(); ++l) {
    if (!model_config_.is_moe_layer(l)) continue;
    registry_
        .gauge("flexpert_eplb_balancedness", "Mean over max rank load in the window, per layer.",
               {{"layer", std::to_string(l)}})
        .set(eplb::balancedness(load[l], placement_.slot_map(l), members(), slots_per_rank_));
  }
}

Result<nlohmann::json> ClusterEngine::rebalance() { return impl_->rebalance("request"); }

bool ClusterEngine::drain_rebalance(bool cancel) {
  Impl& m = *impl_;
  MutexLock lock(m.mutex_);
  const bool was_running = m.rebalancing_;
  if (cancel && m.rebalancing_) {
    m.cancel_rebalance_ = true;
    m.cv_.notify_all();
  }
  m.cv_.wait(lock, [&]() REQUIRES(m.mutex_) { return !m.rebalancing_; });
  return was_running;
}

nlohmann::json ClusterEngine::eplb_status() const { return impl_->eplb_status(); }

}  // namespace flexpert
