// SPDX-License-Identifier: Apache-2.0
// DeviceEpMoe: mapping the members' exchange buffers (ready_for, a slice a step; map_peers
// at a device step) and retiring departed ranks' mappings (ep_moe.h).
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include "cuda/ep_moe.h"
#include "cuda/ep_moe_peers.h"
#include "flexpert/logging.h"

namespace flexpert::cuda {

using ep_moe_detail::kNumWindowBuffers;
using ep_moe_detail::kRouteH;
using ep_moe_detail::kRouteSlot;
using ep_moe_detail::kRowOfPair;
using ep_moe_detail::kSlotsBuffer;
using ep_moe_detail::kWindow;
using ep_moe_detail::kWindowBuffer;
using ep_moe_detail::kY;
using ep_moe_detail::now_ns;

void DeviceEpMoe::retire(std::unique_ptr<PeerMapping> peer, std::unique_ptr<SlotMapping> slots) {
  if (peer == nullptr && slots == nullptr) return;
  std::lock_guard<std::mutex> lock(retire_mu_);
  // An owner that still lives (it left the group) is not being torn down: its mappings close
  // at once, before it exits (ep_moe.h says why not after).
  const bool living = peer != nullptr && peer->owner_ending && !peer->owner_ending();
  retired_.push_back(Retired{std::move(peer), std::move(slots), now_ns(), living});
  if (!closer_.joinable()) {
    closer_ = std::thread([this] {
      std::unique_lock<std::mutex> lk(retire_mu_);
      while (!closer_stop_ || !retired_.empty()) {
        if (retired_.empty()) {
          retire_cv_.wait(lk, [this] { return closer_stop_ || !retired_.empty(); });
        } else {
          retire_cv_.wait_for(lk, std::chrono::milliseconds(5));  // Polls the owners.
        }
        // Closable: the owner has exited (or was never watched), or it is past the cap.
        std::vector<Retired> close;
        const int64_t now = now_ns();
        for (size_t i = 0; i < retired_.size();) {
          const Retired& r = retired_[i];
          const bool ready = closer_stop_ || r.living || r.peer == nullptr ||
                             !r.peer->owner_exited || r.peer->owner_exited() ||
                             now - r.since_ns > kRetireCapNs;
          if (ready) {
            close.push_back(std::move(retired_[i]));
            retired_.erase(retired_.begin() + static_cast<std::ptrdiff_t>(i));
          } else {
            ++i;
          }
        }
        if (close.empty()) continue;
        lk.unlock();
        close.clear();  // The last references: the transport's mappings close now.
        lk.lock();
      }
    });
  }
  retire_cv_.notify_all();
}

Status DeviceEpMoe::init_device_exchange(EpMoeExecutor& executor) {
  const MoeDims& d = config_.dims;
  const int n = executor.transport().max_ranks();
  const int64_t max_pairs = static_cast<int64_t>(config_.max_tokens) * d.top_k;
  FLEX_ASSIGN_OR_RETURN(
      window_, DeviceBuffer::create_zeroed(sizeof(EpWindow) + max_pairs * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(peer_table_, DeviceBuffer::create_zeroed(kEpMaxRanks * sizeof(EpPeer)));
  FLEX_ASSIGN_OR_RETURN(status_, DeviceBuffer::create_zeroed(sizeof(EpStatus)));
  FLEX_ASSIGN_OR_RETURN(num_rows_, DeviceBuffer::create_zeroed(sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(
      stats_, DeviceBuffer::create_zeroed(config_.moe_layers.size() * config_.num_local_slots *
                                          sizeof(int64_t)));
  FLEX_ASSIGN_OR_RETURN(status_host_, PinnedBuffer::create(sizeof(EpStatus)));
  FLEX_ASSIGN_OR_RETURN(abort_, PinnedBuffer::create(sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(progress_, PinnedBuffer::create(sizeof(uint64_t)));
  std::memset(status_host_.data(), 0, sizeof(EpStatus));
  std::memset(abort_.data(), 0, sizeof(int32_t));
  std::memset(progress_.data(), 0, sizeof(uint64_t));
  FLEX_ASSIGN_OR_RETURN(step_done_, Event::create());
  FLEX_ASSIGN_OR_RETURN(release_stream_, Stream::create());
  ahead_events_.clear();
  for (int i = 0; i < kExchangesAhead; ++i) {
    FLEX_ASSIGN_OR_RETURN(Event e, Event::create());
    ahead_events_.push_back(std::move(e));
  }
  self_.window = window_.as<EpWindow>();
  self_.pos = reinterpret_cast<const int32_t*>(self_.window + 1);
  self_.h = config_.route_h;
  self_.slot = config_.route_slot;
  self_.y = scratch_.y.data();
  self_.row_of_pair = scratch_.row_of_pair.as<int32_t>();

  // Registered before this rank reports ready: peers map them in their first device step of
  // an epoch that has this rank.
  Transport& transport = executor.transport();
  const size_t T = static_cast<size_t>(config_.max_tokens), K = static_cast<size_t>(d.top_k);
  const struct {
    const void* data;
    size_t num_bytes;
  } buffers[kNumWindowBuffers] = {
      {self_.window, window_.num_bytes()},
      {self_.h, T * d.hidden * dtype_size(d.dtype)},
      {self_.slot, T * K * sizeof(int32_t)},
      {self_.y, scratch_.y.num_bytes()},
      {self_.row_of_pair, scratch_.row_of_pair.num_bytes()},
  };
  for (int b = 0; b < kNumWindowBuffers; ++b) {
    FLEX_RETURN_IF_ERROR(transport
                             .register_buffer(kWindowBuffer + b, const_cast<void*>(buffers[b].data),
                                              buffers[b].num_bytes)
                             .annotate("EP exchange buffer " + std::to_string(b)));
  }
  // And the slot buffers of every MoE layer, for peers' weight movers.
  ep_ = &executor;
  FLEX_RETURN_IF_ERROR(register_slot_buffers());
  mapped_.resize(static_cast<size_t>(n));
  device_exchange_ = true;
  executor.set_device_probe([this](const Group& group) { return ready_for(group); });
  return Status();
}

size_t DeviceEpMoe::slot_buffer_bytes() const {
  // Every rank's slot buffer of a layer has this rank's shape (one configuration).
  return static_cast<size_t>(config_.num_local_slots) * config_.dims.slot_bytes();
}

Result<uint64_t> DeviceEpMoe::window_incarnation(int r) {
  if (r < 0 || r >= static_cast<int>(mapped_.size())) {
    return invalid_argument("rank " + std::to_string(r) + " out of range");
  }
  Result<PeerBuffer> window = ep_->transport().map_peer_buffer(r, kWindowBuffer, MapMode::kLookup);
  if (!window.ok()) return window.status().annotate("EP window of rank " + std::to_string(r));
  return window->incarnation;
}

Result<bool> DeviceEpMoe::open_peer(PeerMapping& m, int64_t deadline_ns) {
  Transport& transport = ep_->transport();
  const int64_t t0 = now_ns();
  while (m.opened < kNumWindowBuffers) {
    const int b = m.opened;
    Result<PeerBuffer> mapped = transport.map_peer_buffer(m.rank, kWindowBuffer + b, MapMode::kMap);
    if (!mapped.ok()) {
      return mapped.status().annotate("mapping rank " + std::to_string(m.rank) + "'s EP buffers");
    }
    if (mapped->incarnation != m.incarnation) {
      return unavailable("rank " + std::to_string(m.rank) + " is a new incarnation (" +
                         std::to_string(mapped->incarnation) + ") since its mapping began");
    }
    if (b == 0) {
      m.owner_exited = mapped->owner_exited;
      m.owner_ending = mapped->owner_ending;
    }
    m.at[b] = mapped->data;
    m.maps.push_back(std::move(mapped).value());
    ++m.opened;
    if (now_ns() >= deadline_ns) break;
  }
  m.open_ns += now_ns() - t0;
  if (m.opened < kNumWindowBuffers) return false;
  m.peer.window = static_cast<EpWindow*>(m.at[kWindow]);
  m.peer.pos = reinterpret_cast<const int32_t*>(m.peer.window + 1);
  m.peer.h = m.at[kRouteH];
  m.peer.slot = static_cast<const int32_t*>(m.at[kRouteSlot]);
  m.peer.y = m.at[kY];
  m.peer.row_of_pair = static_cast<const int32_t*>(m.at[kRowOfPair]);
  return true;
}

Status DeviceEpMoe::map_peer(int r) {
  FLEX_ASSIGN_OR_RETURN(const uint64_t incarnation, window_incarnation(r));
  std::unique_ptr<PeerMapping>& m = mapped_[r];
  if (m != nullptr && m->incarnation == incarnation) return Status();
  // A new rank or incarnation: map it afresh (the old incarnation's mappings are closed
  // once it has exited, as a departed rank's).
  retire(std::move(m), nullptr);
  auto fresh = std::make_unique<PeerMapping>();
  fresh->rank = r;
  fresh->incarnation = incarnation;
  FLEX_RETURN_IF_ERROR(open_peer(*fresh, std::numeric_limits<int64_t>::max()).status());
  m = std::move(fresh);
  ++peer_mappings_;
  return Status();
}

bool DeviceEpMoe::ready_for(const Group& group) {
  if (!device_exchange_) return false;
  stepped_.store(true);
  if (peers_mapped_ && group.epoch == mapped_group_.epoch && group.ranks == mapped_group_.ranks) {
    return true;
  }
  // A failed mapping (a window not readable, an open that failed) is tried again a second
  // later; the host exchange serves meanwhile.
  if (map_failed_ && now_ns() >= map_retry_ns_) checked_ = false;
  if (!checked_ || group.epoch != checked_group_.epoch || group.ranks != checked_group_.ranks) {
    // A group not checked yet: the members whose buffers are not mapped (or belong to an
    // incarnation that left) are to be mapped, a slice a step; the rest is ready now.
    checked_ = true;
    checked_group_ = group;
    checked_ready_ = false;
    map_failed_ = false;
    for (auto& m : staged_) retire(std::move(m), nullptr);  // An epoch never run.
    staged_.clear();
    map_todo_.clear();
    for (int r : group.ranks) {
      if (r == ep_->transport().rank()) continue;
      Result<uint64_t> incarnation = window_incarnation(r);
      if (!incarnation.ok() && incarnation.status().code() == StatusCode::kUnimplemented) {
        // A member whose buffers the transport never maps (hier: a rank on another host):
        // the host exchange for as long as this group lasts. The member itself answers no as
        // well (this rank is on another host for it), and every header carries the answer.
        FLEX_LOG(INFO) << "rank " << ep_->transport().rank() << ", epoch " << group.epoch
                       << ": host exchange, " << incarnation.status().to_string();
        map_failed_ = true;
        map_retry_ns_ = std::numeric_limits<int64_t>::max();
        return false;
      }
      if (!incarnation.ok()) {
        FLEX_LOG(WARN) << "epoch " << group.epoch << ": no device exchange yet, "
                       << incarnation.status().to_string();
        map_failed_ = true;
        map_retry_ns_ = now_ns() + kMapRetryNs;
        return false;
      }
      if (mapped_[r] != nullptr && mapped_[r]->incarnation == *incarnation) continue;
      auto m = std::make_unique<PeerMapping>();
      m->rank = r;
      m->incarnation = *incarnation;
      map_todo_.push_back(std::move(m));
    }
  }
  if (checked_ready_ || map_failed_) return checked_ready_;
  // A slice of the mapping a step, before this rank's step header: mapping a peer across
  // GPUs takes milliseconds, and the group waits for its slowest member at every step.
  const int64_t deadline = now_ns() + kMapSliceNs;
  while (!map_todo_.empty()) {
    PeerMapping& m = *map_todo_.back();
    Result<bool> done = open_peer(m, deadline);
    if (!done.ok()) {
      FLEX_LOG(WARN) << "epoch " << group.epoch << ": no device exchange yet, "
                     << done.status().to_string();
      map_failed_ = true;
      map_retry_ns_ = now_ns() + kMapRetryNs;
      return false;
    }
    if (!done.value()) break;  // This step's slice is used up.
    FLEX_LOG(INFO) << "rank " << ep_->transport().rank() << ", epoch " << group.epoch << ": rank "
                   << m.rank << " mapped in " << m.open_ns / 1e6 << " ms, " << map_todo_.size() - 1
                   << " to go";
    staged_.push_back(std::move(map_todo_.back()));
    map_todo_.pop_back();
    if (now_ns() >= deadline) break;
  }
  checked_ready_ = map_todo_.empty();
  return checked_ready_;
}

Status DeviceEpMoe::map_peers(const Group& group) {
  if (peers_mapped_ && group.epoch == mapped_group_.epoch && group.ranks == mapped_group_.ranks) {
    return Status();
  }
  const int me = ep_->transport().rank();
  const int64_t t0 = now_ns();
  const int64_t mappings0 = peer_mappings_;
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));  // Nothing reads the mappings replaced below.
  const bool checked =
      checked_ready_ && group.epoch == checked_group_.epoch && group.ranks == checked_group_.ranks;
  if (checked) {
    // What ready_for mapped for this group, in place of older incarnations.
    for (auto& m : staged_) {
      const int r = m->rank;
      retire(std::move(mapped_[r]), nullptr);
      mapped_[r] = std::move(m);
      ++peer_mappings_;
    }
    staged_.clear();
  }
  std::vector<EpPeer> table(kEpMaxRanks);
  std::vector<bool> member(mapped_.size(), false);
  for (int r : group.ranks) {
    if (r < 0 || r >= static_cast<int>(mapped_.size())) {
      return invalid_argument("rank " + std::to_string(r) + " out of range");
    }
    member[r] = true;
    if (r == me) {
      table[r] = self_;
      continue;
    }
    // Mapped and checked already when a worker drives the steps (ready_for); else here.
    if (!checked || mapped_[r] == nullptr) FLEX_RETURN_IF_ERROR(map_peer(r));
    table[r] = mapped_[r]->peer;
  }
  // Departed ranks: nothing runs that reads them (the last step finished; a slot copy
  // through a mapping holds slots_mu_ until it landed, and one over the transport, which
  // holds no lock while it reads, fails on the generation: copy_slot).
  const int64_t t1 = now_ns();
  int released = 0;
  {
    std::lock_guard<std::mutex> lock(slots_mu_);
    ++slots_generation_;
    for (size_t r = 0; r < mapped_.size(); ++r) {
      if (member[r]) continue;
      released += mapped_[r] != nullptr || slot_maps_[r] != nullptr;
      retire(std::move(mapped_[r]), std::move(slot_maps_[r]));
    }
  }
  const int64_t t2 = now_ns();
  FLEX_CUDA_TRY(cudaMemcpyAsync(peer_table_.data(), table.data(), kEpMaxRanks * sizeof(EpPeer),
                                cudaMemcpyHostToDevice, stream_));
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));
  if (!peers_mapped_ || group.epoch != mapped_group_.epoch) exchange_index_ = 0;
  mapped_group_ = group;
  peers_mapped_ = true;
  if (const int64_t t3 = now_ns(); t3 - t0 > 1'000'000) {
    FLEX_LOG(INFO) << "rank " << me << ", epoch " << group.epoch << ": peers mapped in "
                   << (t3 - t0) / 1e6 << " ms (" << peer_mappings_ - mappings0 << " mapped in "
                   << (t1 - t0) / 1e6 << " ms, " << released << " released in " << (t2 - t1) / 1e6
                   << " ms)";
  }
  return Status();
}
}  // namespace flexpert::cuda
