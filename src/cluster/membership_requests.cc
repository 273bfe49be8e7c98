// SPDX-License-Identifier: Apache-2.0
// cluster::Membership: where requests run, which are held, and shutdown
// (docs/ARCHITECTURE.md, "The membership state machine").
#include <algorithm>

#include "cluster/membership.h"
#include "cluster/membership_util.h"

namespace flexpert::cluster {

using detail::act;

// --- Requests ----------------------------------------------------------------------------

size_t Membership::num_held() const {
  return static_cast<size_t>(std::count_if(requests_.begin(), requests_.end(),
                                           [](const auto& r) { return r.second.rank < 0; }));
}

void Membership::place(uint64_t request, RequestView& req, Actions* out) {
  int best = -1;
  // During a recovery nothing is placed: the members are halted until the next epoch.
  if (phase_ != Phase::kRecovering) {
    for (bool allow_leaving : {false, true}) {
      for (int r : members_) {
        const RankView& info = ranks_[r];
        if (info.state != RankState::kServing || (info.leaving && !allow_leaving)) continue;
        if (best < 0 || info.in_flight < ranks_[best].in_flight) best = r;
      }
      if (best >= 0) break;
    }
  }
  const int from = req.rank;
  if (from >= 0) {
    ranks_[from].in_flight = std::max(0, ranks_[from].in_flight - 1);
    req.attempt += 1;
    req.rank = -1;
  }
  if (best < 0) {
    {
      Action a = act(ActionKind::kHold);
      a.request = request;
      a.attempt = req.attempt;
      a.from_rank = from;
      out->push_back(std::move(a));
    }
    return;
  }
  req.rank = best;
  ranks_[best].in_flight += 1;
  {
    Action a = act(ActionKind::kPlace, best);
    a.incarnation = ranks_[best].incarnation;
    a.request = request;
    a.attempt = req.attempt;
    a.from_rank = from;
    out->push_back(std::move(a));
  }
}

void Membership::place_held(Actions* out) {
  for (auto& [id, req] : requests_) {
    if (req.rank < 0) place(id, req, out);
  }
}

Result<Action> Membership::submit(uint64_t request) {
  if (phase_ == Phase::kStopping || phase_ == Phase::kStopped) {
    return unavailable("the server is shutting down");
  }
  if (phase_ == Phase::kStarting || phase_ == Phase::kDegraded) {
    return unavailable("no serving epoch (phase " + std::string(phase_name(phase_)) +
                       (degraded_reason_.empty() ? "" : ": " + degraded_reason_) + ")");
  }
  if (requests_.count(request)) return invalid_argument("request id in use");
  RequestView& req = requests_[request];
  Actions out;
  place(request, req, &out);
  return out.front();
}

Actions Membership::finished(uint64_t request, int r, uint32_t attempt) {
  Actions out;
  auto it = requests_.find(request);
  if (it == requests_.end() || it->second.rank != r || it->second.attempt != attempt) return out;
  ranks_[r].in_flight = std::max(0, ranks_[r].in_flight - 1);
  requests_.erase(it);
  {
    Action a = act(ActionKind::kAnswer, r);
    a.request = request;
    a.attempt = attempt;
    out.push_back(std::move(a));
  }
  return out;
}

std::optional<int> Membership::cancel(uint64_t request) {
  auto it = requests_.find(request);
  if (it == requests_.end()) return std::nullopt;
  const int r = it->second.rank;
  requests_.erase(it);
  if (r < 0) return std::nullopt;
  ranks_[r].in_flight = std::max(0, ranks_[r].in_flight - 1);
  return r;
}

Actions Membership::shutdown() {
  Actions out;
  if (phase_ == Phase::kStopping || phase_ == Phase::kStopped) return out;
  set_phase(Phase::kStopping);
  proposal_.reset();
  rebalancing_ = false;
  for (auto& [id, req] : requests_) {
    {
      Action a = act(ActionKind::kFail);
      a.request = id;
      a.reason = "abort";
      out.push_back(std::move(a));
    }
  }
  requests_.clear();
  for (RankView& info : ranks_) info.in_flight = 0;
  return out;
}

void Membership::stopped() {
  set_phase(Phase::kStopped);
  for (RankView& info : ranks_) {
    if (info.state != RankState::kDead && info.state != RankState::kEmpty) {
      info.state = RankState::kStopped;
    }
  }
}

}  // namespace flexpert::cluster
